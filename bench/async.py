"""Synchronous, one-step-off and fully asynchronous GRPO side by side on a long-tail task.

    .venv/bin/python bench/async.py [--steps 8] [--modes sync,one_step_off,fully_async] [--out ...]

The task is the demo's one-shot two-digit addition, made long-tailed: one training prompt in eight asks the
model to explain its steps first, so most answers take about 10 tokens and a few run past 100 (the response
limit is 192). A lock-step step waits for its longest answer, then the rollout idles while the actor trains;
asynchronous modes overlap the two. Each mode runs in its own process on the embedded SmolLM2-135M-Instruct
(fp32, 8 prompts x 4 samples a step, T 0.7, top-k 50, lr 1e-5) for the same number of steps, so the same
number of samples, then evaluates greedily on 64 held-out (short) problems. sync runs in one process
(the local backend) with both cores as torch threads; the asynchronous modes run on Ray with split
placement (``--async-backend ray``, the default): the actor in one process and the rollout in another,
sharing the cores as their work comes and goes (``trainer.share_cores``; ``one_step_off_fixed`` runs
one-step-off with one core each instead). ``--async-backend local`` runs them as threads of one process
(one torch thread each), where the Python-bound decoding loop and the trainer share one interpreter lock.
Prints steps per hour, samples per second and answer tokens per second (the first step, which also warms up,
and the last, which also validates and saves, are not counted; stale weights learn other answer lengths,
which samples per second rewards and tokens per second does not), the idle fractions and held-out accuracy;
writes JSON (``--table`` prints the table of one again).

Run it alone: two benchmarks on the same 2 cores measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRAIN, TEST, LONG_EVERY = 512, 64, 8
LONG_ASK = "Explain your steps in a few sentences first, then end with {a}+{b}=<answer>."
SETTINGS = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.temperature=0.7",
    "actor_rollout_ref.rollout.top_k=50",
    "data.max_prompt_length=160",
    "data.max_response_length=192",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "trainer.logger=[file]",
    "trainer.resume_mode=disable",
    "trainer.val_before_train=false",
]
MODES = {
    "sync": ["async_training.mode=sync"],
    "one_step_off": ["async_training.mode=one_step_off"],
    "fully_async": [
        "async_training.mode=fully_async",
        "async_training.max_staleness=1",
        "actor_rollout_ref.actor.off_policy_mask=token",
    ],
    # one-step-off with each Ray process keeping half the cores (what ran before trainer.share_cores)
    "one_step_off_fixed": ["async_training.mode=one_step_off", "trainer.share_cores=false"],
}
# where the asynchronous modes run; Ray's processes share the cores (trainer.share_cores): each at work takes
# the cores divided among those at work at that moment
BACKENDS = {"ray": ["trainer.backend=ray", "trainer.placement=split"], "local": []}
ACC = "val/arithmetic/acc/mean@1"


def long_tail_data(folder: Path, test_size: int = TEST) -> Path:
    """The arithmetic task's files, with every ``LONG_EVERY``-th training prompt asking for an explanation."""
    from hybridflow.data.dataset import read_rows
    from hybridflow.data.prepare import main as prepare_data
    from hybridflow.data.prepare import write_parquet

    prepare_data(
        ["arithmetic", str(folder), "--train-size", str(TRAIN), "--test-size", str(test_size), "--seed", "0"]
    )
    rows = read_rows(folder / "train.parquet")
    for i, row in enumerate(rows):
        if i % LONG_EVERY == 0:
            a, b = row["extra_info"]["a"], row["extra_info"]["b"]
            last = dict(row["prompt"][-1])
            last["content"] = f"Compute {a}+{b}. " + LONG_ASK.format(a=a, b=b)
            row["prompt"] = [*row["prompt"][:-1], last]
    write_parquet(rows, folder / "train.parquet")
    return folder


def run_mode(mode: str, data: Path, run_dir: Path, steps: int, extra: list[str]) -> dict:
    """One mode's run, in this process: per-step metrics and the held-out accuracy at the end."""
    from hybridflow.models import default_model_path
    from hybridflow.trainer import PPOTrainer, load_config

    config = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.model.path={default_model_path()}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}",
            *SETTINGS,
            *MODES[mode],
            *extra,
        ]
    )
    stamps: list[float] = []
    start = time.perf_counter()
    with PPOTrainer(config) as trainer:
        trainer.register_hook("on_step_end", lambda *_: stamps.append(time.perf_counter()))
        last = trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "mode": mode,
        "wall_s": time.perf_counter() - start,
        "stamps": stamps,
        "rows": rows,
        "acc": last[ACC],
    }


def summary(result: dict, samples_per_step: int) -> dict[str, float]:
    stamps, rows = result["stamps"], [r for r in result["rows"] if "timing_s/step" in r]
    # between the ends of steps 1 and N-1: not the first step (warm-up), nor the last (validation, checkpoint)
    step_s = statistics.mean(b - a for a, b in zip(stamps[:-2], stamps[1:-1]))
    # the modes' policies differ (stale weights), so do their answers' lengths: tokens a second compares the
    # work done where samples a second would favour the mode that learned to answer shorter
    tokens = samples_per_step * sum(r["response_length/mean"] for r in rows[1:-1])
    if result["mode"] == "sync":  # the rollout idles while the actor trains, the actor while it generates
        rollout_idle = statistics.mean(1 - r["timing_s/gen"] / r["timing_s/step"] for r in rows[1:])
        trainer_idle = statistics.mean(r["timing_s/gen"] / r["timing_s/step"] for r in rows[1:])
    else:
        rollout_idle = statistics.mean(r["async/rollout_idle_frac"] for r in rows[1:])
        trainer_idle = statistics.mean(r["async/trainer_idle_frac"] for r in rows[1:])
    return {
        "step_s": step_s,
        "steps_per_hour": 3600 / step_s,
        "samples_per_s": samples_per_step / step_s,
        "tokens_per_s": tokens / (stamps[-2] - stamps[0]),
        "rollout_idle": rollout_idle,
        "trainer_idle": trainer_idle,
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in rows),
        "response_length_max": max(r["response_length/max"] for r in rows),
        # over the counted steps: answers that ran long cost their step time, whatever the mode
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in rows[1:-1]),
        "acc": result["acc"],
    }


def run_modes(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """Each mode in a process of its own (threads and Ray's state are per process), in order."""
    results = {}
    for mode in args.modes.split(","):
        threads = args.threads.split(",")[0 if mode == "sync" else 1]
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(Path(__file__).parents[1])}
        backend = [] if mode == "sync" else BACKENDS[args.async_backend]
        out = subprocess.run(
            [sys.executable, __file__, "--one", mode, "--steps", str(args.steps), "--work", str(work)]
            + [f"--set={override}" for override in [*backend, *args.set]],
            env=env,
            capture_output=True,
            text=True,
        )
        line = [row for row in out.stdout.splitlines() if row.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(line[0][len("RESULT ") :])
        print(f"{mode}: done in {results[mode]['wall_s']:.0f} s", flush=True)
    return results


def print_table(table: dict[str, dict[str, float]]) -> None:
    first = table.get("sync", next(iter(table.values())))
    base, base_tokens = first["samples_per_s"], first["tokens_per_s"]
    print(
        "| mode | steps/h | samples/s | vs sync | answer tokens/s | vs sync | rollout idle | trainer idle | "
        "staleness | mean answer | held-out acc |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for mode, row in table.items():
        print(
            f"| {mode} | {row['steps_per_hour']:.0f} | {row['samples_per_s']:.2f} | "
            f"{row['samples_per_s'] / base:.2f}x | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / base_tokens:.2f}x | {row['rollout_idle']:.0%} | {row['trainer_idle']:.0%} | "
            f"{row['staleness_mean']:.2f} | {row['response_length_mean']:.1f} | {row['acc']:.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", default="sync,one_step_off,fully_async")
    parser.add_argument("--out", default="bench/results/async.json")
    parser.add_argument("--work", default="runs/bench_async")
    parser.add_argument(
        "--set", action="append", default=[], help="a config override for every mode (repeatable)"
    )
    parser.add_argument(
        "--async-backend",
        choices=["ray", "local"],
        default="ray",
        help="the asynchronous modes' processes: ray (split placement, a process each) or local (threads)",
    )
    parser.add_argument(
        "--threads", default="2,1", help="torch threads of sync, and of the async modes on the local backend"
    )
    parser.add_argument("--samples-per-step", type=int, default=32, help="train_batch_size x rollout.n")
    parser.add_argument("--test-size", type=int, default=TEST, help="held-out problems")
    parser.add_argument("--table", help="print the table of a JSON this bench wrote, running nothing")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: run this mode, print JSON
    args = parser.parse_args()
    work = Path(args.work)
    if args.one:
        result = run_mode(args.one, work / "data", work / args.one, args.steps, args.set)
        print("RESULT " + json.dumps(result))
        return
    if args.table:
        runs = json.loads(Path(args.table).read_text())["runs"]
        print_table({mode: summary(result, args.samples_per_step) for mode, result in runs.items()})
        return
    long_tail_data(work / "data", args.test_size)
    results = run_modes(args, work)
    table = {mode: summary(result, args.samples_per_step) for mode, result in results.items()}
    print(
        f"\n{args.steps} steps, {args.samples_per_step} samples each (1 prompt in {LONG_EVERY} asks for an "
        f"explanation), SmolLM2-135M-Instruct, async modes on {args.async_backend}, overrides {args.set}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print_table(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"table": table, "runs": results, "load_average": os.getloadavg()}, indent=2)
    )


if __name__ == "__main__":
    main()
