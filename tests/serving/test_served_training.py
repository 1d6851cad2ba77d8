"""GRPO on the tiny model with an agent written with the ``openai`` SDK: the batch holds what the server
sampled (two calls joined into one row per session, the tokens between them masked out), and the policy
learns what the agent rewards."""

import json
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import ConfigError, load_config
from hybridflow.trainer import PPOTrainer

AGENT = '''
async def run(client, sample):
    """Ask, then ask again in the same conversation; reward 1 when the first reply starts with a digit."""
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    text = first.choices[0].message.content
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    used = first.usage.completion_tokens + second.usage.completion_tokens
    return {"score": float(text[:1].isdigit()), "sampled_tokens": used}
'''


def test_grpo_trains_an_sdk_agent(data_dir, tiny_model_path, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    cfg = load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=64",
            "data.max_response_length=40",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=25",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
            "trainer.seed=0",
        ]
    )
    batches = []
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("after_reward", lambda t, step, metrics, batch: batches.append(batch))
        trainer.fit()
    first = batches[0]
    assert len(first) == 64  # 8 prompts x 8 sessions, one row each: the second call continues the first
    sampled = first.batch["response_mask"].sum(-1).tolist()
    assert sampled == list(first.non_tensor_batch["reward_extra/sampled_tokens"])  # the agent's extra value
    scores = first.batch["token_level_scores"]
    assert torch.equal(scores, first.batch["rm_scores"])  # the agent's return values, no reward function
    assert set(scores.sum(-1).tolist()) <= {0.0, 1.0}
    rows = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "served/joined_calls" in row]
    assert len(steps) == 25 and all(row["served/joined_calls"] == 0.5 for row in steps)
    assert all(row["served/batch_rows/max"] > 1 for row in steps)  # the sessions' calls were batched
    rewards = [row["critic/score/mean"] for row in steps]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late - early >= 0.3, f"mean reward went from {early:.2f} to {late:.2f}: {rewards}"


def _async_config(data_dir: Path, model: str, tmp_path: Path, *extra: str):
    (tmp_path / "agent.py").write_text(AGENT)
    return load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=64",
            "data.max_response_length=40",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "trainer.total_training_steps=4",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "mode",
    [
        ["async_training.mode=one_step_off"],
        ["async_training.mode=fully_async", "async_training.partial_rollout=false"],
    ],
)
def test_an_sdk_agent_trains_asynchronously_on_what_was_served(data_dir, tiny_model_path, tmp_path, mode):
    """The served rollout in the asynchronous modes: the agents' sessions run ahead of the trainer on older
    weights, and each batch is still the served tokens (every session's two calls joined into one row)."""
    with PPOTrainer(_async_config(data_dir, tiny_model_path, tmp_path, *mode)) as trainer:
        trainer.fit()
    rows = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["served/joined_calls"] for row in rows] == [0.5] * 4
    assert [row["async/staleness_max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]  # one step behind, as bound
    assert [row["async/weight_version_max"] for row in rows] == [0.0, 0.0, 1.0, 2.0]


def test_a_partial_rollout_of_a_served_agent_is_refused_naming_the_key(data_dir, tiny_model_path, tmp_path):
    """A served agent's engine generates whole samples, so new weights cannot reach a generation in flight."""
    with pytest.raises(ConfigError, match="async_training.partial_rollout=false"):
        _async_config(data_dir, tiny_model_path, tmp_path, "async_training.mode=fully_async")
