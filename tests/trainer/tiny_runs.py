"""Tests' helpers for short training runs of the tiny model (``tests/trainer``): the settings every such run
shares, and a reward function written to a file for ``custom_reward_function.path``."""

from pathlib import Path

import pytest


def run_settings(data_dir: Path, model: str, run_dir: Path, *extra: str) -> list[str]:
    """Overrides for a run of ``model`` on ``data_dir``'s ``train.parquet``: 4 prompts of at most 64 tokens x
    2 samples a step, one mini-batch, metrics to a file under ``run_dir``; ``extra`` holds what a test's runs
    set apart (the response length, the learning rate, the steps, ...)."""
    return [
        f"data.train_files={data_dir / 'train.parquet'}",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={run_dir}",
        "data.max_prompt_length=64",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.logger=[file]",
        *extra,
    ]


def reward_written(factory: pytest.TempPathFactory, name: str, source: str) -> Path:
    """``source`` (a module defining ``compute_score``) written to a new folder as ``name``."""
    path = factory.mktemp("reward") / name
    path.write_text(source)
    return path
