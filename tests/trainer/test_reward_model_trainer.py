"""Reward-model training (``hybridflow rm``): the Bradley-Terry loss by hand, the pairs kept whole, the run loop
(checkpoints, resume, validation), LoRA, FSDP2 on Ray, and a checkpoint PPO's reward model loads as it is."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hybridflow.algorithms import bradley_terry_loss
from hybridflow.config.offline import RMConfig, load_offline_config
from hybridflow.config.schema import PPOConfig
from hybridflow.data.offline import RewardPairDataset, reward_model_tokens
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
from hybridflow.trainer.main_rm import main as main_rm
from hybridflow.trainer.offline import OfflineTrainer
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.modeling import load_tokenizer
from hybridflow.workers.packing import PairBatching


def pairs(n: int, seed: int = 0, margin: float | None = None) -> list[dict]:
    """Right sums against a near miss with chatter: easy for a tiny model to separate."""
    import random

    r = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = r.randint(10, 99), r.randint(10, 99)
        row = {
            "prompt": f"Compute {a}+{b}.",
            "chosen": f"{a}+{b}={a + b}",
            "rejected": f"{a + b + 3} or so, maybe",
        }
        if margin is not None:
            row["margin"] = margin
        rows.append(row)
    return rows


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def config(tmp_path, tiny_model_path, *extra: str, steps: int = 4) -> RMConfig:
    return load_offline_config(
        RMConfig,
        [
            f"data.train_files={write(tmp_path / 'train.jsonl', pairs(16))}",
            f"data.val_files={write(tmp_path / 'val.jsonl', pairs(8, seed=1))}",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=2",
            f"model.partial_pretrain={tiny_model_path}",
            "optim.lr=1e-3",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[file]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_the_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.5, -0.2]), torch.tensor([0.5, 0.3])
    plain = bradley_terry_loss(chosen, rejected)
    assert plain.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))])
    margin = torch.tensor([0.25, 0.0])
    centred = bradley_terry_loss(chosen, rejected, margin, center_rewards_coefficient=0.1)
    assert centred.tolist() == pytest.approx(
        [math.log1p(math.exp(-0.75)) + 0.1 * 2.0**2, math.log1p(math.exp(0.5)) + 0.1 * 0.1**2]
    )


def test_the_worker_loss_equals_one_computed_from_plain_transformers(tmp_path, tiny_model_path):
    """Margins and centring on: the first update's loss is what TRL's formula gives on the scalars an
    AutoModelForSequenceClassification with the same weights returns for each whole sequence."""
    cfg = config(tmp_path, tiny_model_path, "rm.center_rewards_coefficient=0.01")
    tokenizer = load_tokenizer(tiny_model_path)
    rows = pairs(4, margin=0.5)
    dataset = RewardPairDataset(write(tmp_path / "m.jsonl", rows), tokenizer, margin_key="margin")
    batch = dataset.collate([dataset[i] for i in range(4)])
    batch.meta_info["offline"] = cfg.loss_spec()
    trainer = OfflineTrainer(cfg)
    trainer.init_workers()
    worker = trainer.wg.actor_rollout.workers[0].role_workers["actor_rollout"]
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    reference.config.pad_token_id = tokenizer.pad_token_id
    reference.load_state_dict(worker.model.state_dict())
    scalars = []
    for row in rows:
        for key in ("chosen", "rejected"):
            ids = reward_model_tokens(
                tokenizer,
                [{"role": "user", "content": row["prompt"]}],
                [{"role": "assistant", "content": row[key]}],
            )
            scalars.append(reference(torch.tensor([ids])).logits[0, 0].item())
    rc, rr = torch.tensor(scalars[0::2]), torch.tensor(scalars[1::2])
    expected = (-torch.nn.functional.logsigmoid(rc - rr - 0.5) + 0.01 * (rc + rr) ** 2).mean().item()
    metrics = trainer.wg.actor_rollout.update_reward_model(batch).meta_info["metrics"]
    assert sum(metrics["loss"]) / len(metrics["loss"]) == pytest.approx(expected, abs=1e-5)
    assert metrics["rewards/margins"][0] == pytest.approx((rc - rr).mean().item(), abs=1e-5)
    trainer.close()


def test_token_budget_micro_batches_keep_pairs_whole_and_give_the_same_update(tmp_path, tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    rows = pairs(6)
    rows[2]["chosen"] = "a much longer chosen answer " * 6
    dataset = RewardPairDataset(write(tmp_path / "p.jsonl", rows), tokenizer)
    batch = dataset.collate([dataset[i] for i in range(6)])
    budget = PairBatching(2, max_token_len=200)
    for idx in budget.indices(batch, count=5):  # more micro-batches than fit: fillers, never half a pair
        assert len(idx) % 2 == 0 and all(a % 2 == 0 and b == a + 1 for a, b in zip(idx[0::2], idx[1::2]))
    assert sorted(i for idx in budget.indices(batch) for i in idx) == list(range(12))
    norms = {}
    for i, mode in enumerate(("data.use_dynamic_bsz=false", "data.use_dynamic_bsz=true")):
        (tmp_path / str(i)).mkdir()
        cfg = config(
            tmp_path / str(i), tiny_model_path, mode, "data.max_token_len_per_gpu=200", "data.max_length=100"
        )
        trainer = OfflineTrainer(cfg)
        trainer.init_workers()
        batch.meta_info["offline"] = cfg.loss_spec()
        norms[mode] = trainer.wg.actor_rollout.update_reward_model(batch).meta_info["metrics"][
            "rm/grad_norm"
        ][0]
        trainer.close()
    assert norms["data.use_dynamic_bsz=true"] == pytest.approx(norms["data.use_dynamic_bsz=false"], rel=1e-4)
    with pytest.raises(Exception, match="must hold a whole pair"):
        config(tmp_path, tiny_model_path, "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=100")


@pytest.mark.learning
def test_rm_learns_resumes_and_its_checkpoint_scores_in_ppo(tmp_path, tiny_model_path, chat_prompts):
    assert main_rm([*overrides(tmp_path, tiny_model_path, steps=3), "trainer.save_freq=3"]) == 0
    assert (
        main_rm(
            [*overrides(tmp_path, tiny_model_path, steps=6), "trainer.save_freq=3", "trainer.test_freq=6"]
        )
        == 0
    )
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "train/loss" in m] == [1, 2, 3, 4, 5, 6]  # resumed at step 4
    final = [m for m in logged if "val/rewards/accuracies" in m][-1]
    assert final["val/rewards/accuracies"] == 1.0 and final["val/loss"] < 0.3
    folder = tmp_path / "run" / "global_step_6" / "reward_model" / "huggingface"
    loaded = AutoModelForSequenceClassification.from_pretrained(folder)  # as it is: nothing else needed
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id is not None
    # PPO's reward model loads the folder and scores a right answer above a wrong one, as trained
    rm = PPOConfig().reward_model
    rm.enable, rm.model.path = True, str(folder)
    group = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, rm, policy_tokenizer_path=tiny_model_path))
    group.init_model()
    tokenizer = load_tokenizer(tiny_model_path)
    batch = chat_prompts(tokenizer, ["Compute 21+34.", "Compute 21+34."])
    answers = [
        tokenizer("21+34=55", add_special_tokens=False)["input_ids"],
        tokenizer("58 or so, maybe", add_special_tokens=False)["input_ids"],
    ]
    width = max(map(len, answers))
    batch.batch["responses"] = torch.tensor(
        [a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers]
    )
    batch.batch["response_mask"] = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    scores = group.compute_rm_score(batch).batch["rm_scores"].sum(-1)
    assert scores[0] > scores[1]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 21+34."}, {"role": "assistant", "content": "21+34=55"}],
        tokenize=False,
    )
    direct = loaded(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    assert scores[0].item() == pytest.approx(direct.item(), abs=1e-5)  # what PPO scores is what was trained


def overrides(tmp_path, tiny_model_path, steps: int) -> list[str]:
    return [
        f"data.train_files={write(tmp_path / 'train.jsonl', pairs(24))}",
        f"data.val_files={write(tmp_path / 'val.jsonl', pairs(8, seed=1))}",
        "data.train_batch_size=4",
        f"model.partial_pretrain={tiny_model_path}",
        "optim.lr=1e-3",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]


def test_lora_trains_adapters_and_the_head_and_saves_a_merged_classifier(tmp_path, tiny_model_path):
    cfg = config(
        tmp_path, tiny_model_path, "model.lora_rank=8", "model.lora_alpha=16", "trainer.save_freq=2", steps=2
    )
    with OfflineTrainer(cfg) as trainer:
        trainer.fit()
        worker = trainer.wg.actor_rollout.workers[0].role_workers["actor_rollout"]
        trainable = sorted(n for n, p in worker.model.named_parameters() if p.requires_grad)
    assert any("lora_A" in n for n in trainable) and any(n.endswith("score.weight") for n in trainable)
    assert not any(n.endswith("embed_tokens.weight") for n in trainable)
    folder = tmp_path / "run" / "global_step_2" / "reward_model"
    merged = AutoModelForSequenceClassification.from_pretrained(folder / "huggingface")
    fresh = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    assert not torch.equal(
        merged.model.layers[0].self_attn.q_proj.weight, fresh.model.layers[0].self_attn.q_proj.weight
    )
    assert (folder / "lora_adapter").is_dir()


def test_a_bad_margin_names_the_row(tmp_path, tiny_model_path):
    rows = pairs(2)
    rows[1]["margin"] = "large"
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: field 'margin' must be a number"):
        RewardPairDataset(write(tmp_path / "bad.jsonl", rows), load_tokenizer(tiny_model_path))


def test_a_pair_with_images_is_refused_naming_the_row(tmp_path, tiny_model_path):
    """Reward models train on text pairs: a row's pictures would otherwise be dropped without a word."""
    rows = pairs(2)
    rows[1]["images"] = [{"path": "square.png"}]
    with pytest.raises(ValueError, match=r"pics.jsonl: row 1: a reward model trains on text pairs only"):
        RewardPairDataset(write(tmp_path / "pics.jsonl", rows), load_tokenizer(tiny_model_path))


def test_rm_on_two_ray_workers_with_fsdp2(tmp_path, tiny_model_path, ray_session):
    """Sharded over 2 ranks: trains, validates, and the consolidated folder loads as a classifier."""
    cfg = config(
        tmp_path,
        tiny_model_path,
        "model.strategy=fsdp2",
        "trainer.backend=ray",
        "trainer.n_workers=2",
        "trainer.save_freq=1",
        "trainer.test_freq=1",
        "trainer.val_before_train=false",
        steps=1,
    )
    with OfflineTrainer(cfg) as trainer:
        metrics = trainer.fit()
    assert "val/rewards/accuracies" in metrics and math.isfinite(metrics["val/loss"])
    loaded = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "run" / "global_step_1" / "reward_model" / "huggingface"
    )
    assert loaded.score.weight.shape == (1, loaded.config.hidden_size)


def test_plain_text_pairs_read_as_the_plain_reward_model_reads_them(tmp_path, tiny_model_path):
    """data.apply_chat_template=false: each side is the prompt, a newline and the completion with the
    tokenizer's special tokens, the form PPO's reward model reads without a template (input_format=plain)."""
    tokenizer = load_tokenizer(tiny_model_path)
    rows = [{"prompt": "Compute 2+3.", "chosen": "5", "rejected": "6"}]
    dataset = RewardPairDataset(write(tmp_path / "plain.jsonl", rows), tokenizer, apply_chat_template=False)
    batch = dataset.collate([dataset[0]])
    chosen = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    assert chosen == tokenizer("Compute 2+3.\n5")["input_ids"]
    assert batch.batch["margin"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="must be a string with data.apply_chat_template=false"):
        RewardPairDataset(
            write(tmp_path / "chat.jsonl", [{**rows[0], "chosen": [{"role": "assistant", "content": "5"}]}]),
            tokenizer,
            apply_chat_template=False,
        )
