"""Two GRPO steps of ``hybridflow train`` on the families whose paths differ most from Llama's, each built tiny
(``make_tiny_model(family=...)``): sliding windows of 16 tokens (Mistral, Gemma 3, gpt-oss), hybrid linear
attention (Qwen3.5 dense and MoE), latent attention (DeepSeek-V3). The rollout's log-probs of its samples equal
the trainer's (``rollout/logprob_diff_max`` < 1e-5), prompts and answers together past the window; an MoE run
with routing replay (R3) and the balancing loss reports what they did."""

import json
from pathlib import Path

import pytest
from tiny_runs import reward_written, run_settings

from hybridflow.models.tiny import make_tiny_model
from hybridflow.trainer import PPOTrainer, load_config

DIGITS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    return arithmetic_data(8, 4)


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> Path:
    return reward_written(tmp_path_factory, "digits.py", DIGITS)


def train(model: str, data_dir: Path, reward: Path, run_dir: Path, *extra: str) -> list[dict]:
    """Two steps, prompts of the demo task (about 60 of the tiny tokenizer's tokens) with 24-token answers."""
    settings = run_settings(
        data_dir,
        model,
        run_dir,
        f"custom_reward_function.path={reward}",
        "data.max_prompt_length=128",
        "data.max_response_length=24",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.total_training_steps=2",
        *extra,
    )
    with PPOTrainer(load_config(settings)) as trainer:
        trainer.fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "family", ["mistral", "gemma3_text", "gpt_oss", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v3"]
)
def test_two_steps_keep_the_rollout_and_the_trainer_in_agreement(family, data_dir, reward, tmp_path):
    model = make_tiny_model(tmp_path / "model", family=family, num_layers=4)
    steps = train(model, data_dir, reward, tmp_path / "run")
    assert len(steps) == 2
    for step in steps:
        assert step["rollout/logprob_diff_max"] < 1e-5
        assert step["prompt_length/mean"] + step["response_length/mean"] > 16  # past a window


def test_an_moe_run_replays_its_rollouts_routing_and_balances_its_experts(data_dir, reward, tmp_path):
    model = make_tiny_model(tmp_path / "model", family="qwen3_moe", num_layers=2)
    replay = [
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.actor.router_aux_loss_coef=0.01",
    ]
    steps = train(model, data_dir, reward, tmp_path / "run", *replay)
    for step in steps:
        assert step["rollout/logprob_diff_max"] < 1e-5
        assert step["moe/replay_differed"] < 0.05  # the same weights and module: it routes as the rollout did
        assert 1.0 <= step["moe/imbalance"] <= 4.0  # 1: even; 4: every token on one expert
        assert 0.5 < step["moe/aux_loss"] < 4.0  # Switch's loss: 1 when both loads are even
