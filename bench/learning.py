"""How much each method learns per generated sample and per second: GRPO on the embedded model, with and
without each of dynamic sampling, overlong shaping, masking truncated samples, Clip-Cov, KL-Cov and on-policy
distillation, on two tasks, over seeds.

    .venv/bin/python bench/learning.py                        # the whole bench (about an hour on 2 cores)
    .venv/bin/python bench/learning.py --tasks arithmetic --arms baseline,filter --seeds 0
    .venv/bin/python bench/learning.py --model tiny --samples 64,128 --steps 2,4   # a smoke run, minutes
    .venv/bin/python bench/learning.py --tasks countdown --arms baseline,filter --resume   # more, same --out

Every run is the demo's GRPO without its dynamic sampling (8 prompts x 4 samples a step, up to 16 new tokens,
T 0.7, top-k 50, lr 1e-5) on SmolLM2-135M-Instruct with one method on (the ``baseline`` arm: none) and ``trainer.seed`` set to the seed
(which also orders the data); the arms of one task and seed run one after the other in a process of their
own. Held-out greedy accuracy is measured on the task's 64 test problems when the run has generated each
``--samples`` count (at the step that first reaches it) and at each ``--steps`` count: for every arm but
dynamic sampling these are the same points (32 samples a step); a dynamic-sampling step generates more
samples, so its accuracy is given at the same number of samples (fewer steps) and at the same number of steps
(more samples). A run ends at the last of both. The base model's accuracy is measured once per task.
Training time counts the steps only (``timing_s/step``), not validation, as the number of steps times the
run's median step (``steady_seconds``), so that another job on the cores for a while does not tilt one arm;
the sum as measured is in the JSON beside it.

The tasks: the demo's two-digit addition (``arithmetic``) and ``countdown`` (reach the target from two numbers
up to 25 with + - * /, targets up to 50, the equation in ``<answer>`` tags; 512 training problems, 48 new
tokens), scored by the built-in rules, ``acc`` the share of exactly right answers. On-policy distillation
(``opd``, arithmetic only) distils a teacher made by 8 steps of SFT on the task's demonstrations
(``hybridflow sft``; its held-out accuracy is measured too) into the base model: the teacher's per-token
reverse KL is a reward beside the task's (``actor_rollout_ref.teacher`` at its defaults).

Prints a table (mean and min-max over the seeds) and writes JSON (``--out``) after every task and seed, so a
bench cut short keeps what it measured; ``--resume`` keeps the runs and base accuracies ``--out`` holds
(measured with the same ``--samples`` and ``--steps``), runs only the missing ones, and tabulates them all
(the teacher's SFT is reused from the ``--work`` folder). Run it alone, under the heavy
lock on a shared machine: other jobs on the same cores slow the runs unevenly.
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

REPO = Path(__file__).resolve().parents[1]
TEST = 64
TASKS = {
    "arithmetic": {
        "prepare": ["arithmetic", "--train-size", "1000"],
        "response_length": 16,
        "settings": [],
    },
    "countdown": {
        "prepare": ["countdown", "--train-size", "512", "--num-numbers", "2", "--max-number", "25"]
        + ["--max-target", "50"],
        "response_length": 48,
        "settings": ["data.max_prompt_length=160"],
    },
}
ARMS = {
    "baseline": [],
    "filter": ["algorithm.filter_groups.enable=true"],  # DAPO's dynamic sampling, metric seq_reward
    # the penalty over the last quarter of the response budget
    "overlong": ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len={quarter}"],
    "mask_truncated": ["actor_rollout_ref.actor.mask_truncated_samples=true"],
    "clip_cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"],
    "kl_cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"],
    "opd": [],  # the teacher's path is added when it exists
}
ONLY = {"opd": ("arithmetic",)}  # arms that run on some tasks only
# the reward of every run: the built-in rule scorers, with ``acc`` (exactly right) for scorers without one
REWARD = """
from hybridflow.rewards import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    result = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return result if isinstance(result, dict) else {"score": result, "acc": float(result == 1.0)}
"""


def settings(task: str, arm: str, seed: int, work: Path, model: str, teacher: str | None) -> list[str]:
    """The config of one run: the demo's GRPO, the task's files and length, the arm's method, the seed."""
    from hybridflow.commands.demo import DEMO_FILTER, DEMO_SETTINGS

    # the baseline arm is plain GRPO: the demo's dynamic sampling is the filter arm's method
    kept = [
        s
        for s in DEMO_SETTINGS
        if s != DEMO_FILTER and not s.startswith(("trainer.", "data.max_response_length"))
    ]
    length = TASKS[task]["response_length"]
    arm_settings = [item.format(quarter=length // 4) for item in ARMS.get(arm, [])]
    if arm == "opd":
        arm_settings.append(f"actor_rollout_ref.teacher.path={teacher}")
    data = work / "data" / task
    return [
        *kept,
        f"data.max_response_length={length}",
        *TASKS[task]["settings"],
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"actor_rollout_ref.model.path={model}",
        f"custom_reward_function.path={work / 'reward.py'}",
        f"trainer.default_local_dir={work / 'runs' / f'{task}-{arm}-{seed}'}",
        f"trainer.seed={seed}",
        "trainer.total_training_steps=1000",  # the run stops itself at its last measuring point
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[file]",
        "trainer.resume_mode=disable",
        *arm_settings,
    ]


def run_one(spec: dict) -> dict:
    """One run, in this process: held-out accuracy at each measuring point (``spec``: task, arm, seed,
    samples and steps points, work folder, model, teacher)."""
    from hybridflow.trainer import PPOTrainer, load_config

    task, acc_key = spec["task"], f"val/{spec['task']}/acc/mean@1"
    overrides = settings(task, spec["arm"], spec["seed"], Path(spec["work"]), spec["model"], spec["teacher"])
    if spec["arm"] == "base":  # the model's accuracy before training (the teacher's: "of")
        overrides = [o for o in overrides if not o.startswith("trainer.val_before_train")]
        name = f"{task}-{spec.get('of', 'base')}"
        overrides += [
            "trainer.val_only=true",
            f"trainer.default_local_dir={Path(spec['work']) / 'runs' / name}",
        ]
    config = load_config(overrides)
    points, state, step_s = [], {"samples": 0, "train_s": 0.0}, []
    samples_left, steps_left = sorted(spec["samples"]), sorted(spec["steps"])

    def measure(trainer, step, metrics, batch) -> None:
        state["samples"] += int(metrics.get("dynamic_sampling/samples_generated", len(batch)))
        state["train_s"] += metrics["timing_s/step"]
        step_s.append(metrics["timing_s/step"])
        due = False
        while samples_left and state["samples"] >= samples_left[0]:
            samples_left.pop(0)
            due = True
        while steps_left and step >= steps_left[0]:
            steps_left.pop(0)
            due = True
        if due:
            acc = trainer.validate()[acc_key]
            points.append(
                {"step": step, "samples": state["samples"], "train_s": state["train_s"], "acc": acc}
            )
            print(
                f"[{task} {spec['arm']} seed {spec['seed']}] step {step}, {state['samples']} samples: {acc:.0%}"
            )
        if not samples_left and not steps_left:
            trainer.total_steps = step  # the loop ends here (no checkpoint: none is needed)

    start = time.perf_counter()
    with PPOTrainer(config) as trainer:
        trainer.register_hook("on_step_end", measure)
        last = trainer.fit()
    if spec["arm"] == "base":
        points.append({"step": 0, "samples": 0, "train_s": 0.0, "acc": last[acc_key]})
    return {**spec, "points": points, "step_s": step_s, "wall_s": time.perf_counter() - start}


def children(specs: list[dict]) -> list[dict]:
    """``run_one`` for each of ``specs``, one after the other in a process of their own (both cores as torch
    threads; one interpreter start for all of them), the results read from its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, __file__, "--one", json.dumps(specs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results = []
    for row in process.stdout:  # progress lines as they come
        if row.startswith("RESULT "):
            results.append(json.loads(row[len("RESULT ") :]))
        elif row.startswith("["):
            print(row.rstrip(), flush=True)
    errors = process.stderr.read()
    if process.wait() or len(results) != len(specs):
        sys.exit(f"runs {[(s['task'], s['arm'], s['seed']) for s in specs]} failed:\n{errors[-4000:]}")
    return results


def make_teacher(work: Path, model: str, steps: int) -> str:
    """SFT on the arithmetic task's demonstrations (the RL split's training problems): the teacher's folder."""
    from hybridflow.data.prepare import main as prepare_data

    data = work / "data" / "arithmetic_sft"
    prepare_data(
        ["arithmetic", str(data), "--format", "sft", "--train-size", "1000", "--test-size", str(TEST)]
    )
    run_dir = work / "runs" / "teacher_sft"
    folder = run_dir / f"global_step_{steps}" / "actor" / "huggingface"
    if (folder / "config.json").exists():  # made by an earlier run of the bench in this --work folder
        return str(folder)
    command = [
        sys.executable,
        "-m",
        "hybridflow.commands.cli",
        "sft",
        f"data.train_files={data / 'train.parquet'}",
        f"model.partial_pretrain={model}",
        "optim.lr=1e-5",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the teacher's SFT failed:\n{out.stderr[-4000:]}")
    return str(folder)


def prepare(work: Path, tasks: list[str], seed: int = 0) -> None:
    from hybridflow.data.prepare import main as prepare_data

    work.mkdir(parents=True, exist_ok=True)
    (work / "reward.py").write_text(REWARD)
    for task in tasks:
        folder = work / "data" / task
        prepare_data([*TASKS[task]["prepare"], str(folder), "--test-size", str(TEST), "--seed", str(seed)])


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.0%} ({min(values):.0%}-{max(values):.0%})" if len(values) > 1 else f"{mean:.0%}"


def at(points: list[dict], key: str, value: int) -> dict | None:
    """The first measuring point at or past ``value`` samples (or steps)."""
    return next((p for p in points if p[key] >= value), None)


def steady_seconds(run: dict, steps: int) -> float:
    """Training seconds of a run's first ``steps`` steps as ``steps`` x their median step: a job that shared
    the cores for a while (a test run, a first step's warm-up) slows a few steps, not the median."""
    seconds = run.get("step_s")
    if seconds is None:  # a run measured before step_s was recorded: its run folder's metrics
        folder = Path(run["work"]) / "runs" / f"{run['task']}-{run['arm']}-{run['seed']}"
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        seconds = [row["timing_s/step"] for row in rows if "timing_s/step" in row]
    return steps * statistics.median(seconds[:steps])


def summarise(
    results: list[dict],
    base: dict[str, float],
    samples: list[int],
    steps: list[int],
    timed: list[int] | None = None,
) -> list[dict]:
    """Per task and arm, over seeds: accuracy at each samples and steps point, samples at the last steps
    point, training seconds to the last samples point, and the gain per 1000 samples and per minute (the
    seconds over the seeds in ``timed`` only, when given: those that ran alone on the machine)."""
    rows = []
    for task, arm in dict.fromkeys((r["task"], r["arm"]) for r in results if r["arm"] != "base"):
        runs = [r for r in results if (r["task"], r["arm"]) == (task, arm)]
        by_samples = {n: [at(r["points"], "samples", n) for r in runs] for n in samples}
        by_steps = {n: [at(r["points"], "step", n) for r in runs] for n in steps}
        reached = [(r, p) for r, p in zip(runs, by_samples[samples[-1]]) if p]  # the runs at the last point
        last = [p for _, p in reached]
        gain = [p["acc"] - base[task] for p in last]
        clocked = [  # (gain, seconds) of the runs whose clock counts
            (g, steady_seconds(r, p["step"]))
            for g, (r, p) in zip(gain, reached)
            if timed is None or r["seed"] in timed
        ]
        rows.append(
            {
                "task": task,
                "arm": arm,
                "seeds": [r["seed"] for r in runs],
                "base_acc": base[task],
                "acc_at_samples": {n: [p["acc"] for p in ps if p] for n, ps in by_samples.items()},
                "steps_at_samples": {n: [p["step"] for p in ps if p] for n, ps in by_samples.items()},
                "acc_at_steps": {n: [p["acc"] for p in ps if p] for n, ps in by_steps.items()},
                "samples_at_steps": {n: [p["samples"] for p in ps if p] for n, ps in by_steps.items()},
                "train_s": [seconds for _, seconds in clocked],
                "train_s_as_measured": [p["train_s"] for p in last],
                "gain_per_1k_samples": [1000 * g / p["samples"] for g, p in zip(gain, last)],
                "gain_per_minute": [60 * g / seconds for g, seconds in clocked],
                "timed_seeds": timed,
            }
        )
    return rows


def print_table(rows: list[dict], samples: list[int], steps: list[int]) -> None:
    heads = [f"acc @{n} samples (steps)" for n in samples] + [f"acc @{n} steps (samples)" for n in steps]
    print("| task | arm | base | " + " | ".join(heads) + " | train s | gain / 1k samples | gain / min |")
    print("|---" * (len(heads) + 6) + "|")
    for row in rows:
        cells = [
            f"{spread(row['acc_at_samples'][n])} ({statistics.mean(row['steps_at_samples'][n] or [0]):.1f})"
            for n in samples
        ]
        cells += [
            f"{spread(row['acc_at_steps'][n])} ({statistics.mean(row['samples_at_steps'][n] or [0]):.0f})"
            for n in steps
        ]
        gain_k = statistics.mean(row["gain_per_1k_samples"] or [0.0])
        gain_m = statistics.mean(row["gain_per_minute"] or [0.0])
        print(
            f"| {row['task']} | {row['arm']} | {row['base_acc']:.0%} | " + " | ".join(cells) + " | "
            f"{statistics.mean(row['train_s'] or [0.0]):.0f} | {100 * gain_k:+.0f} pts | {100 * gain_m:+.1f} pts |"
        )


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="arithmetic,countdown")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--samples", default="128,256", help="generated samples at which to measure")
    parser.add_argument("--steps", default="4,8", help="training steps at which to measure")
    parser.add_argument("--teacher-steps", type=int, default=8, help="SFT steps that make the opd teacher")
    parser.add_argument("--model", default="default", help="default (the embedded model), tiny, or a folder")
    parser.add_argument("--work", default="runs/bench_learning")
    parser.add_argument("--out", default="bench/results/learning.json")
    parser.add_argument(
        "--resume", action="store_true", help="keep the runs (and base accuracies) --out holds; run the rest"
    )
    parser.add_argument(
        "--timing-seeds", help="seeds whose runs had the machine alone: only their seconds go into the table"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one run, printed as JSON
    args = parser.parse_args()
    if args.one:
        for spec in json.loads(args.one):
            print("RESULT " + json.dumps(run_one(spec)), flush=True)
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    work, tasks, arms = Path(args.work).resolve(), args.tasks.split(","), args.arms.split(",")
    samples, steps = ints(args.samples), ints(args.steps)
    model = args.model
    if model == "tiny":
        from hybridflow.models import make_tiny_model

        model = make_tiny_model(work / "tiny")
    elif model == "default":
        from hybridflow.models import default_model_path

        model = str(default_model_path())
    prepare(work, tasks)
    done = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else {}
    teacher = None
    if "opd" in arms and "arithmetic" in tasks:
        teacher = make_teacher(work, model, args.teacher_steps)
    spec = {"work": str(work), "model": model, "teacher": teacher, "samples": samples, "steps": steps}
    base, teacher_acc = before_training(spec, tasks, done)
    if teacher:
        print(f"the opd teacher ({args.teacher_steps} SFT steps): {teacher_acc:.0%} held out", flush=True)
    results = list(done.get("runs", []))
    finished = {(r["task"], r["arm"], r["seed"]) for r in results}
    for seed in ints(args.seeds):  # every arm of a seed before the next seed: a cut-short run still compares
        for task in tasks:
            group = [{**spec, "task": task, "arm": arm, "seed": seed} for arm in arms]
            todo = [g for g in group if task in ONLY.get(g["arm"], (task,))]
            todo = [g for g in todo if (task, g["arm"], seed) not in finished]
            results += children(todo) if todo else []
            # a cut-short bench keeps its runs (--resume goes on from them)
            write(args.out, {"partial": True, "base": base, "teacher_acc": teacher_acc, "runs": results})
    timed = ints(args.timing_seeds) if args.timing_seeds else None
    rows = summarise(results, base, samples, steps, timed)
    minutes = (time.perf_counter() - started) / 60
    print(
        f"\nGRPO on {Path(model).name}, 8 prompts x 4 samples a step; seeds {args.seeds}; {minutes:.0f} minutes "
        f"in all; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    if teacher_acc is not None:
        print(f"opd teacher: {teacher_acc:.0%} held-out accuracy")
    print_table(rows, samples, steps)
    report = {"table": rows, "base": base, "teacher_acc": teacher_acc, "runs": results, "minutes": minutes}
    write(args.out, {**report, "load_average": [load, os.getloadavg()[0]]})


def before_training(spec: dict, tasks: list[str], done: dict) -> tuple[dict[str, float], float | None]:
    """The base model's held-out accuracy per task and the opd teacher's (None without one), measured where
    ``done`` (an earlier report, for --resume) does not hold them already."""
    base, teacher_acc = dict(done.get("base", {})), done.get("teacher_acc")
    first = [{**spec, "task": task, "arm": "base", "seed": 0} for task in tasks if task not in base]
    if spec["teacher"] and teacher_acc is None:  # the teacher's own held-out accuracy
        first.append(
            {
                **spec,
                "model": spec["teacher"],
                "task": "arithmetic",
                "arm": "base",
                "seed": 0,
                "of": "teacher",
            }
        )
    for r in children(first) if first else []:
        if "of" in r:
            teacher_acc = r["points"][0]["acc"]
        else:
            base[r["task"]] = r["points"][0]["acc"]
    return base, teacher_acc


def write(out: str, report: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
