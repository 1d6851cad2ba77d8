"""LoRA through peft: only the adapters train, the reference is the same module with the adapter off (its
log-probs are the base model's), and checkpoints hold an adapter that peft loads and a merged folder that
plain transformers loads, both giving the trained policy's logits; ``load_trained_actor`` takes either."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hybridflow.algorithms import compute_advantage
from hybridflow.config.schema import PPOConfig
from hybridflow.runs.trained_model import load_trained_actor
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.modeling import response_log_probs


def lora_config(path: str, save_lora_only: bool = False):
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = path
    arr.model.lora_rank, arr.model.lora_alpha = 4, 8
    arr.rollout.n = 2
    arr.actor.ppo_mini_batch_size = 2
    arr.actor.ppo_micro_batch_size_per_gpu = 2
    arr.actor.optim.lr = 1e-2
    arr.actor.use_kl_loss = True
    arr.actor.checkpoint.save_lora_only = save_lora_only
    return cfg.resolve().actor_rollout_ref


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]).logits


def test_lora_trains_adapters_only_and_checkpoints_load_everywhere(tiny_model_path, chat_prompts, tmp_path):
    group = LocalWorkerGroup(
        ClassWithInitArgs(
            ActorRolloutRefWorker, lora_config(tiny_model_path), role="actor_rollout_ref", response_length=6
        )
    )
    group.init_model()
    worker = group.workers[0]
    assert worker.ref_module is None  # no second copy of the weights
    trainable = [n for n, p in worker.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    torch.manual_seed(0)
    batch = group.generate_sequences(chat_prompts(worker.tokenizer, ["Compute 3+4.", "Say hi."]))
    scores = torch.zeros(4, 6)
    scores[[0, 2], batch.batch["response_mask"].sum(-1)[[0, 2]] - 1] = 1.0
    batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, "grpo")
    for _ in range(2):  # lora_B starts at zero: after updates the adapter changes the policy
        batch = (
            batch.union(group.compute_ref_log_prob(batch))
            if "ref_log_prob" not in batch.batch.keys()
            else batch
        )
        group.update_actor(batch)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    base_lp, _ = response_log_probs(base, batch)
    ref_lp = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
    actor_lp = group.compute_log_prob(batch).batch["old_log_probs"]
    torch.testing.assert_close(ref_lp, base_lp, rtol=1e-5, atol=1e-5)
    assert (actor_lp - base_lp).abs().max() > 1e-3  # the adapter did learn something

    group.save_checkpoint(str(tmp_path / "full"))
    trained = logits(worker.module, batch)
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "full" / "lora_adapter"
    )
    torch.testing.assert_close(logits(adapter, batch), trained, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "huggingface")
    torch.testing.assert_close(logits(merged, batch), trained, rtol=1e-4, atol=1e-4)
    model, _ = load_trained_actor(tmp_path / "full" / "lora_adapter")
    torch.testing.assert_close(logits(model, batch), trained, rtol=1e-4, atol=1e-4)

    # save_lora_only: no merged folder; the checkpoint still loads, through its adapter
    worker.config.actor.checkpoint.save_lora_only = True
    group.save_checkpoint(str(tmp_path / "lean" / "actor"))
    assert not (tmp_path / "lean" / "actor" / "huggingface").exists()
    model, tokenizer = load_trained_actor(tmp_path / "lean")
    torch.testing.assert_close(logits(model, batch), trained, rtol=1e-4, atol=1e-4)
    assert tokenizer.chat_template == worker.tokenizer.chat_template

    # resume: the adapters and their optimiser state come back from the DCP checkpoint
    resumed = LocalWorkerGroup(
        ClassWithInitArgs(
            ActorRolloutRefWorker, lora_config(tiny_model_path), role="actor_rollout_ref", response_length=6
        )
    )
    resumed.init_model()
    resumed.load_checkpoint(str(tmp_path / "full"))
    torch.testing.assert_close(logits(resumed.workers[0].module, batch), trained, rtol=0, atol=0)
    assert resumed.update_actor(batch).meta_info["metrics"]["actor/grad_norm"][0] == pytest.approx(
        group.update_actor(batch).meta_info["metrics"]["actor/grad_norm"][0], rel=1e-6
    )
