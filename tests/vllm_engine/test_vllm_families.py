"""The vLLM rollout's column of the model-family matrix. On vLLM's CPU build: for each family it runs exactly
(``vllm_rollout.CPU_CHECKED``) the engine's sampled log-probs are the trainer's and an update of the actor
reaches the engine (its log-probs of a fixed sequence follow the trainer's); every other family is refused in
one line when the worker builds the engine, naming the model type and the key; routing replay through vLLM
(R3) is refused, the CPU build's routed-expert capture needing Triton. On a GPU (``scripts/gpu_check.py``'s
vllm stage, a few minutes in all) Qwen3-MoE takes the first test and R3 the last: the trainer's forwards use
the experts the engine chose."""

import pytest
import torch
from test_vllm_rollout import DEVICE, LOGPROB_TOL, QUESTIONS, _config, _engine_log_probs

from hybridflow.models.families import TINY_FAMILIES
from hybridflow.models.tiny import make_tiny_model
from hybridflow.utils.errors import UserError
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.rollout.vllm_rollout import CPU_CHECKED, CPU_REFUSED


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Each family at width 64 with 2 heads of 32 (vLLM's CPU attention has no kernel for 16)."""
    root = tmp_path_factory.mktemp("vllm-families")
    return {f: make_tiny_model(root / f, family=f, num_heads=2, num_kv_heads=1) for f in TINY_FAMILIES}


def test_every_family_is_checked_or_refused_with_its_reason():
    assert set(CPU_CHECKED) | set(CPU_REFUSED) == set(TINY_FAMILIES)
    assert not set(CPU_CHECKED) & set(CPU_REFUSED)


ON_GPU = DEVICE.type == "cuda"
# on a GPU (the gpu_check script's few minutes) the MoE family the CPU build refuses, where R3 matters
EXACT = ["qwen3_moe"] if ON_GPU else list(CPU_CHECKED)
REFUSED = [] if ON_GPU else sorted(CPU_REFUSED)


@pytest.mark.parametrize("family", EXACT)
def test_the_engines_log_probs_are_the_trainers_before_and_after_an_update(folders, family, chat_prompts):
    worker = ActorRolloutRefWorker(_config(folders[family]), role="actor_rollout", response_length=8)
    worker.init_model()
    prompts = chat_prompts(worker.tokenizer, QUESTIONS)
    prompts.meta_info.update(n=2, temperature=1.0)
    batch = worker.generate_sequences(prompts)
    metrics = worker.compute_log_prob(batch).meta_info["metrics"]
    assert metrics["rollout/logprob_diff_max"] < LOGPROB_TOL, metrics
    length = int(batch.batch["response_mask"][0].sum())
    sequence = batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()].tolist()
    before = _engine_log_probs(worker, sequence, length)
    batch.batch["advantages"] = torch.ones_like(batch.batch["response_mask"], dtype=torch.float)
    worker.update_actor(batch)
    after = _engine_log_probs(worker, sequence, length)
    trainer, _ = response_log_probs(worker.module, batch[0:1], temperature=1.0)
    assert (after - trainer[0, :length].detach()).abs().max() < LOGPROB_TOL
    assert (after - before).abs().max() > 20 * LOGPROB_TOL, "the engine still holds the old weights"


@pytest.mark.parametrize("family", REFUSED)
def test_the_other_families_are_refused_in_one_line(folders, family):
    worker = ActorRolloutRefWorker(_config(folders[family]), role="actor_rollout", response_length=8)
    with pytest.raises(UserError, match=rf"^actor_rollout_ref.rollout.name=vllm: .* run {family} exactly \("):
        worker.init_model()


def test_routing_replay_uses_the_engines_choices_or_is_refused_on_a_cpu(folders, chat_prompts):
    config = _config(folders["qwen3_moe"])
    config.actor.router_replay.mode = "R3"
    worker = ActorRolloutRefWorker(config, role="actor_rollout", response_length=8)
    if not ON_GPU:
        with pytest.raises(UserError, match=r"router_replay.mode=R3 with rollout.name=vllm needs .* Triton"):
            worker.init_model()
        return
    worker.init_model()
    prompts = chat_prompts(worker.tokenizer, QUESTIONS)
    prompts.meta_info.update(n=2, temperature=1.0)
    batch = worker.generate_sequences(prompts)
    recorded = batch.batch["routed_experts"]
    assert (recorded >= 0).all(dim=-1).all(dim=-1).sum() >= batch.batch["attention_mask"].sum() - len(batch)
    metrics = worker.compute_log_prob(batch).meta_info["metrics"]
    assert metrics["moe/replay_differed"] < 0.05 and metrics["rollout/logprob_diff_max"] < LOGPROB_TOL, (
        metrics
    )
