"""What every example shares and none is about: a tiny random model, prompts, a small GRPO config.

The model is a 2-layer Llama with a ~1k-token tokenizer (``hybridflow.models.make_tiny_model``), the
prompts are two-digit additions (``hybridflow prepare-data arithmetic``), and the reward is one the random
model can learn quickly: the share of digits in its reply. A step (4 prompts x 2 samples of 4 tokens)
takes a fraction of a second on a CPU, so each example runs in seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import make_tiny_model
from hybridflow.trainer import PPOConfig, load_config


def digit_share(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The share of digits in the reply (``compute_score`` signature): a reward with signal from step 1."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


def tiny_config(out_dir: str | Path, *overrides: str, steps: int = 4) -> PPOConfig:
    """A GRPO config on the tiny model and arithmetic prompts (both made in ``out_dir`` on first use),
    rewarded by ``digit_share``; ``overrides`` are the usual dotted ``key=value`` strings. The run folder
    ``out_dir/run`` starts empty each time (else the trainer would resume from its last checkpoint)."""
    out = Path(out_dir)
    shutil.rmtree(out / "run", ignore_errors=True)
    if not (out / "model" / "config.json").exists():
        make_tiny_model(out / "model")
    if not (out / "data" / "train.parquet").exists():
        prepare_data(
            ["arithmetic", str(out / "data"), "--train-size", "32", "--test-size", "4", "--seed", "0"]
        )
    return load_config(
        [
            f"data.train_files={out / 'data' / 'train.parquet'}",
            f"actor_rollout_ref.model.path={out / 'model'}",
            f"trainer.default_local_dir={out / 'run'}",
            f"trainer.total_training_steps={steps}",
            f"custom_reward_function.path={__file__}",
            "custom_reward_function.name=digit_share",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.logger=[file]",
            "trainer.val_before_train=false",
            *overrides,
        ]
    )


def logged(out_dir: str | Path) -> list[dict[str, float]]:
    """The training steps' metrics from the run's ``metrics.jsonl``, in step order."""
    lines = (Path(out_dir) / "run" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "timing_s/step" in row]


def run(main: Callable[[Path], dict]) -> None:
    """``python examples/NN_name.py [OUT_DIR]``: run ``main`` in OUT_DIR (default: a new temporary folder)."""
    torch.set_num_threads(
        1
    )  # a tiny model gains nothing from threads, and on a busy CPU they wait on each other
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="hybridflow-example-"))
    main(out_dir)
    print(f"run folder: {out_dir / 'run'}")
