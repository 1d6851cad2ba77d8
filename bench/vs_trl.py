"""hybridflow against TRL's ``GRPOTrainer`` on the same GRPO task, side by side in one process.

    pip install -e '.[bench]'        # TRL is a bench-only dependency
    .venv/bin/python bench/vs_trl.py [--steps 3] [--out bench/results/vs_trl.json]

The task is the demo's: one-shot two-digit addition prompts (~95 tokens), the demo's reward,
SmolLM2-135M-Instruct in fp32, 8 prompts x 4 samples a step, 16 new tokens, temperature 0.7, lr 1e-5, no
KL term. TRL runs with 8 x 4 completions per optimiser step (``per_device_train_batch_size=8``,
``gradient_accumulation_steps=4``, no gradient checkpointing, CPU). The two alternate step by step (each
hybridflow step runs from TRL's ``on_step_end`` callback, outside TRL's timing), so a machine whose load
changes hits both alike; the first step of each is a warm-up and not counted. Prints the median seconds a
step and the ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybridflow.commands.demo import DEMO_FILTER, DEMO_SETTINGS
from hybridflow.config.schema import load_config
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import default_model_path
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.trainer.ppo import PPOTrainer


def arithmetic_reward(completions, ground_truth, a, b, **_) -> list[float]:
    """The demo's score on TRL's conversational completions."""
    return [
        compute_score(c[0]["content"], t, {"a": x, "b": y})["score"]
        for c, t, x, y in zip(completions, ground_truth, a, b)
    ]


def trl_trainer(data_dir: Path, run_dir: Path, steps: int, callback):
    import datasets
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    frame = pd.read_parquet(data_dir / "train.parquet")
    rows = [
        {
            "prompt": [dict(m) for m in r.prompt],
            "ground_truth": r.reward_model["ground_truth"],
            "a": int(r.extra_info["a"]),
            "b": int(r.extra_info["b"]),
        }
        for r in frame.itertuples()
    ]
    args = GRPOConfig(
        output_dir=str(run_dir / "trl"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=16,
        temperature=0.7,
        learning_rate=1e-5,
        beta=0.0,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    return GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[callback],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each, after one warm-up step")
    parser.add_argument("--out", default="bench/results/vs_trl.json")
    parser.add_argument("--run-dir", default="runs/bench_vs_trl")
    args = parser.parse_args()
    from transformers import TrainerCallback

    run_dir = Path(args.run_dir)
    data_dir = run_dir / "data"
    prepare_data(["arithmetic", str(data_dir), "--train-size", "1000", "--test-size", "8", "--seed", "0"])
    config = load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"trainer.default_local_dir={run_dir}",
            f"actor_rollout_ref.model.path={default_model_path()}",
            *(s for s in DEMO_SETTINGS if s != DEMO_FILTER),  # TRL's sampler: every group trains
            "trainer.logger=[console]",
            f"trainer.total_training_steps={args.steps + 1}",
        ]
    )
    hybridflow = PPOTrainer(config)
    hybridflow.init_workers()
    batches = iter(hybridflow.train_loader)
    results: dict[str, list[dict[str, float]]] = {"trl": [], "hybridflow": []}

    class Alternate(TrainerCallback):
        """Times TRL's optimiser step, then runs one hybridflow step outside that timing."""

        def on_step_begin(self, *_, **__) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            results["trl"].append({"step_s": time.perf_counter() - self.start})
            metrics: dict[str, float] = {}
            start = time.perf_counter()
            hybridflow.train_step(next(batches), metrics)
            results["hybridflow"].append(
                {
                    "step_s": time.perf_counter() - start,
                    "gen_s": metrics["timing_s/gen"],
                    "update_s": metrics["timing_s/update_actor"],
                }
            )
            print(
                f"step {len(results['trl'])}: TRL {results['trl'][-1]['step_s']:.1f} s, hybridflow "
                f"{results['hybridflow'][-1]['step_s']:.1f} s (gen {metrics['timing_s/gen']:.1f}, update "
                f"{metrics['timing_s/update_actor']:.1f})",
                flush=True,
            )

    trl_trainer(data_dir, run_dir, args.steps + 1, Alternate()).train()
    hybridflow.close()

    def median(name: str, key: str = "step_s") -> float:
        return statistics.median(r[key] for r in results[name][1:])

    trl_s, hf_s = median("trl"), median("hybridflow")
    print(
        f"\n8 prompts x 4 samples, 16 new tokens, SmolLM2-135M-Instruct fp32, median of {args.steps} steps "
        f"after a warm-up, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| {'trainer':<24} | {'s/step':>7} | {'gen s':>6} | {'update s':>8} |\n|{'-' * 26}|{'-' * 9}|"
        f"{'-' * 8}|{'-' * 10}|"
    )
    print(f"| {'TRL GRPOTrainer':<24} | {trl_s:7.1f} | {'':>6} | {'':>8} |")
    print(
        f"| {'hybridflow':<24} | {hf_s:7.1f} | {median('hybridflow', 'gen_s'):6.1f} | "
        f"{median('hybridflow', 'update_s'):8.1f} |"
    )
    print(f"hybridflow is {trl_s / hf_s:.2f}x TRL's throughput")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "steps": results,
                "median_s": {"trl": trl_s, "hybridflow": hf_s},
                "ratio": trl_s / hf_s,
                "load_average": os.getloadavg(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
