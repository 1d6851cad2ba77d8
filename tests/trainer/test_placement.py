"""Placement of roles in processes (``trainer.placement``): ``split`` runs the actor, the rollout and the
reward in their own Ray worker processes and must train exactly as ``colocated`` does."""

import json
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from transformers import AutoModelForCausalLM

from hybridflow import DataProto
from hybridflow.config.schema import ConfigError, TrainerConfig
from hybridflow.single_controller.ray import shared_cpus
from hybridflow.single_controller.ray.worker_group import _RayBackend
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.worker_groups import build_worker_groups, placement, ray_cpus_per_worker
from hybridflow.utils.errors import UserError

# rollout/logprob_diff: the actor's log-probs of what the rollout worker sampled, same fp32 weights and
# code, but another process; any stale weight would show as a difference of order 0.1 at lr 1e-2
SYNCED_TOL = 1e-4

# A reward that varies within every group (so GRPO updates each step), shipped to the reward worker by value.
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 20.0
"""


def _config(data_dir: Path, model: str, run_dir: Path, *overrides: str):
    reward_file = run_dir.parent / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    return load_config(
        [
            f"custom_reward_function.path={reward_file}",
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={run_dir}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=3",
            "trainer.logger=[file]",
            "trainer.backend=ray",
            "trainer.cpus_per_worker=0.5",
            "trainer.save_freq=-1",
            "trainer.seed=3",
            *overrides,
        ]
    )


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _payload_bytes(value) -> int:
    """Bytes of the arrays and tensors inside ``value`` (nested containers and DataProtos included)."""
    if isinstance(value, np.ndarray | torch.Tensor):
        return value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
    if isinstance(value, DataProto):
        return _payload_bytes(dict(value.batch.items()) if value.batch is not None else {})
    if isinstance(value, dict):
        return sum(_payload_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_payload_bytes(v) for v in value)
    return 0


def test_split_runs_roles_apart_and_trains_as_colocated(
    data_dir, tiny_model_path, tmp_path, ray_session, monkeypatch
):
    with PPOTrainer(_config(data_dir, tiny_model_path, tmp_path / "colocated")) as trainer:
        trainer.fit()
    crossing = []  # (method, bytes) of what every call sent from and brought back to the driver
    submit, fetch = _RayBackend.submit, _RayBackend.fetch

    def watched_submit(self, method, shards, group, label):
        crossing.append((label, _payload_bytes([shards.args, shards.kwargs])))
        return submit(self, method, shards, group, label)

    def watched_fetch(self, handles, group, label, timeout_s=None):
        results = fetch(self, handles, group, label, timeout_s)
        crossing.append((label, _payload_bytes(results)))
        return results

    monkeypatch.setattr(_RayBackend, "submit", watched_submit)
    monkeypatch.setattr(_RayBackend, "fetch", watched_fetch)
    with PPOTrainer(
        _config(data_dir, tiny_model_path, tmp_path / "split", "trainer.placement=split")
    ) as trainer:
        trainer.fit()
        wg = trainer.wg
        pids = {
            "driver": os.getpid(),
            "actor": wg.actor_rollout.execute_all("pid")[0],
            "rollout": wg.rollout.execute_all("pid")[0],
            "reward": wg.reward.execute_all("pid")[0],
        }
    assert len(set(pids.values())) == 4, pids

    colocated, split = _steps(tmp_path / "colocated"), _steps(tmp_path / "split")
    assert [row["step"] for row in split] == [1, 2, 3]
    # after each update the rollout worker samples with the actor's new weights
    assert all(row["rollout/logprob_diff_max"] < SYNCED_TOL for row in split), [
        r["rollout/logprob_diff_max"] for r in split
    ]
    assert all(row["timing_s/sync_weights"] > 0 for row in split)
    assert "timing_s/sync_weights" not in colocated[0]
    # the weights went from the actor's process to the rollout's directly: no call carried them through the
    # driver (the largest payloads are batches, a fraction of the model's bytes)
    model_bytes = sum(  # every tensor once (parameters() lists the tied embedding once, as the link sends it)
        t.numel() * t.element_size()
        for t in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters()
    )
    assert {label for label, _ in crossing} >= {"send_weights", "receive_weights", "update_actor"}
    assert max(size for _, size in crossing) < model_bytes / 2, sorted(crossing, key=lambda c: -c[1])[:3]
    assert all(row["weight_sync/mb"] * 2**20 >= model_bytes * 0.99 for row in split)
    assert colocated[-1]["actor/pg_loss"] != colocated[0]["actor/pg_loss"]  # it did train
    for a, b in zip(colocated, split):
        for key in (
            "critic/score/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/entropy",
            "response_length/mean",
            "critic/advantages/mean",
        ):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])


def test_placement_presets_and_overrides(data_dir, tiny_model_path, tmp_path):
    cfg = _config(
        data_dir,
        tiny_model_path,
        tmp_path,
        "trainer.placement=split",
        "trainer.n_workers=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "+trainer.resource_pool_spec.rollout=[2]",
    )
    pools, roles = placement(cfg.trainer)
    assert pools == {"actor": [2], "rollout": [2], "reward": [1]}
    assert roles["critic"] == roles["ref"] == "actor" and roles["reward_model"] == "reward"
    cfg = _config(data_dir, tiny_model_path, tmp_path, "+trainer.role_pools.rollout=nowhere")
    with pytest.raises(ConfigError, match=r"maps \{'rollout': 'nowhere'\} to undefined pools"):
        placement(cfg.trainer)
    with pytest.raises(ConfigError, match="set trainer.backend=ray"):
        _config(data_dir, tiny_model_path, tmp_path, "trainer.placement=split", "trainer.backend=local")


def test_split_with_default_cpus_shares_a_small_machine(
    data_dir, tiny_model_path, tmp_path, ray_session, caplog
):
    """Before: "trainer.n_workers=1 needs 3 CPUs on Ray, but Ray sees 2 available (of 2)". The 3 processes
    of split placement now share Ray's 2 CPUs and train."""
    assert TrainerConfig().cpus_per_worker == 1.0  # the default is what this test runs with
    cfg = _config(
        data_dir,
        tiny_model_path,
        tmp_path / "run",
        "trainer.placement=split",
        "trainer.total_training_steps=2",
        f"trainer.cpus_per_worker={TrainerConfig().cpus_per_worker}",
    )
    with caplog.at_level(logging.WARNING, logger="hybridflow"), PPOTrainer(cfg) as trainer:
        trainer.fit()
    assert [row["step"] for row in _steps(tmp_path / "run")] == [1, 2]
    shared = [r.getMessage() for r in caplog.records if "share them" in r.getMessage()]
    assert shared == [
        "3 worker processes x trainer.cpus_per_worker=1 ask 3 CPUs, Ray has 2: they share them, 0.6666 CPUs each"
    ]


def test_a_resource_pool_spec_that_over_asks_is_shared_and_an_impossible_one_refused(
    data_dir, tiny_model_path, tmp_path, ray_session, caplog
):
    """A spelled-out layout of 4 processes (the rollout on 2) at 1 CPU each on Ray's 2 CPUs: half a CPU
    each, every CPU reserved while the workers live. A Ray with no CPU free can never place them: refused at
    once, naming what is missing, as is a cuda run with fewer GPUs than processes."""
    cfg = _config(
        data_dir,
        tiny_model_path,
        tmp_path,
        "trainer.placement=split",
        "trainer.cpus_per_worker=1",
        "+trainer.resource_pool_spec.rollout=[2]",
    )
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        groups = build_worker_groups(cfg, reward_fn=lambda **kw: {})
    try:
        assert groups.rollout.world_size == 2 and groups.reward is not None
        assert ray.available_resources().get("CPU", 0.0) == pytest.approx(0.0, abs=1e-6)
    finally:
        groups.shutdown()
    assert any("they share them, 0.5 CPUs each" in r.getMessage() for r in caplog.records)

    # a GPU each is never shared: with no GPU on Ray a cuda run can never be placed
    cuda = SimpleNamespace(device="cuda", n_workers=2, placement="colocated", cpus_per_worker=1.0)
    with pytest.raises(
        UserError, match=r"starts 2 worker processes, each needing a GPU of its own, but Ray sees 0 GPUs"
    ):
        ray_cpus_per_worker(cuda, 2)
    held = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])  # other work holds every CPU
    assert held.wait(120)  # a state, with a safety net: the previous test's workers may still be going
    try:
        with pytest.raises(
            UserError,
            match=r"trainer.n_workers=1 with trainer.placement=split starts 4 worker processes, but Ray sees 0 "
            r"CPUs available \(of 2\); other Ray work holds 2",
        ):
            build_worker_groups(cfg, reward_fn=lambda **kw: {})
    finally:
        remove_placement_group(held)


def test_shared_cpus_gives_each_process_an_equal_share_ray_accepts():
    assert shared_cpus(3, 1.0, 4.0) == 1.0  # they fit: as asked
    assert shared_cpus(3, 1.0, 2.0) == pytest.approx(0.6666)  # ten-thousandths, floored: 3 x 0.6666 <= 2
    assert shared_cpus(3, 4.0, 8.0) == 2.0  # above one CPU Ray takes whole numbers only (8/3 -> 2)
    assert shared_cpus(2, 1.0, 0.0) == 0.0  # no CPU: nothing to share
