"""The PPO driver end to end on a tiny model: GRPO and PPO, local and on 2 Ray workers, and learning."""

import json
import math
from pathlib import Path

import pytest
from tiny_runs import run_settings

from hybridflow.trainer import PPOTrainer, load_config

EXPECTED_METRICS = [
    *(f"timing_s/{k}" for k in ("gen", "reward", "adv", "update_actor", "step")),
    *(f"actor/{k}" for k in ("pg_loss", "entropy", "grad_norm", "lr")),
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "perf/throughput",
    "perf/time_per_step",
    "perf/reward_share",
    "perf/total_num_tokens",
    "rollout/logprob_diff",
]
WITH_CRITIC = ["timing_s/values", "timing_s/update_critic", "critic/vf_loss", "critic/values/mean"]
# logged when the update's data was scored by an older policy pass (0 by construction on-policy)
OLD_POLICY = ["timing_s/old_log_prob", "actor/ppo_kl", "actor/pg_clipfrac"]
WITH_REF = ["timing_s/ref", "actor/kl_loss"]

FIRST_DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str[:1].isdigit() else 0.0
"""


def config(data_dir: Path, model: str, run_dir: Path, *overrides: str):
    return load_config(
        run_settings(
            data_dir,
            model,
            run_dir,
            f"data.val_files={data_dir / 'test.parquet'}",
            "data.max_response_length=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=3",
            *overrides,
        )
    )


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(run_dir: Path, expected: list[str]) -> None:
    steps = [row for row in logged(run_dir) if "timing_s/step" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    for row in steps:
        missing = [k for k in expected if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        bad = {k: row[k] for k in expected if not math.isfinite(row[k])}
        assert not bad, f"step {row['step']} has non-finite metrics {bad}"
    assert (run_dir / "global_step_3" / "actor" / "huggingface" / "config.json").exists()


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_grpo_three_steps(backend, data_dir, tiny_model_path, tmp_path, request, capsys):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    cfg = config(
        data_dir,
        tiny_model_path,
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"trainer.backend={backend}",
        "trainer.n_workers=2" if backend == "ray" else "trainer.n_workers=1",
        "trainer.log_val_generations=2",
    )
    with PPOTrainer(cfg) as trainer:  # closing gives the Ray actors' CPUs back for the next test
        metrics = trainer.fit()
    check_run(tmp_path, EXPECTED_METRICS + WITH_REF)
    # on-policy (one mini-batch, one epoch): the ratio is exactly 1, and the KL to the old policy not logged
    assert not [
        row["step"] for row in logged(tmp_path) if "actor/ppo_kl" in row or "timing_s/old_log_prob" in row
    ]
    assert "val/arithmetic/acc/mean@1" in metrics
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[val step")]
    # two samples at the validation before training and two after the last step
    assert [line.split("]")[0] for line in shown] == ["[val step 0"] * 2 + ["[val step 3"] * 2
    assert "Compute" in shown[0] and " -> " in shown[0]


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_ppo_with_critic_three_steps(backend, data_dir, tiny_model_path, tmp_path, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    cfg = config(
        data_dir,
        tiny_model_path,
        tmp_path,
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.ppo_epochs=2",
        f"trainer.backend={backend}",
        f"trainer.n_workers={2 if backend == 'ray' else 1}",
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    check_run(tmp_path, EXPECTED_METRICS + WITH_CRITIC + OLD_POLICY + ["timing_s/ref"])
    assert (tmp_path / "global_step_3" / "critic" / "huggingface" / "config.json").exists()


# Rank-8 adapters, on the output layer too: the random tiny model's logits are near uniform, and adapters on
# its hidden layers alone barely move them (the reward stayed at 0.16-0.20 with all-linear at lr 3e-2 and 1e-1).
LORA = [
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
    "actor_rollout_ref.actor.optim.lr=3e-2",
]


@pytest.mark.learning
@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
def test_grpo_learns_a_simple_preference(extra, data_dir, tiny_model_path, tmp_path):
    """Reward 1 when the response starts with a digit (about 1 in 8 samples of the random tiny model)."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(FIRST_DIGIT_REWARD)
    cfg = config(
        data_dir,
        tiny_model_path,
        tmp_path / "run",
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={reward_file}",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.total_training_steps=25",
        "trainer.val_before_train=false",
        "trainer.seed=0",
        *extra,
    )
    cfg.data.val_files = None
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    rewards = [row["critic/score/mean"] for row in logged(tmp_path / "run")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, f"mean reward went from {first:.2f} to {last:.2f}: {rewards}"
