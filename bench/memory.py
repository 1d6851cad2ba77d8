"""Peak memory per worker of a GRPO run through the path users run: ``hybridflow train`` on Ray.

    .venv/bin/python bench/memory.py [--random-model 1024,16 | --model PATH] [--ranks 1 4]
        [--generation sharded gathered] [--prompts 4] [--samples 2] [--micro 1] [--steps 2] [--validate]
        [--interval 0.2] [--out FILE] [-- KEY=VALUE ...]
    .venv/bin/python bench/memory.py --bare ...      # bare processes on a synthetic batch (bench/memory_bare.py)

Writes the arithmetic task with ``hybridflow prepare-data``, then for each worker count and generation mode
runs ``hybridflow train`` as a user would (``trainer.backend=ray``, ``trainer.cpus_per_worker=0.5``, actor
``strategy=fsdp2``, ``rollout.sharded_generation`` true or false; GRPO with ``--prompts`` prompts x
``--samples`` samples, micro-batches of ``--micro``, ``--steps`` steps; every other key at the CLI's default,
so the run ends with its checkpoint; keys after ``--`` are added). Two steps by default: the first generation
runs before any gradient or AdamW moment exists, the second beside them, as every later one does (with the
default gathered generation, that is where a worker holds the whole model beside its share of the state). and watches the Ray worker processes the
trainer starts (the run's own process tree, so other Ray sessions on the machine are not counted).

What is measured, per worker, every ``--interval`` seconds: the kernel's peak resident set since the last
sample (``VmHWM`` in ``/proc/PID/status``, reset after each read through ``/proc/PID/clear_refs``, so a peak
between two samples is not missed), the resident set split into anonymous memory (the heap: tensors,
allocator arenas), file pages (shared libraries, mapped checkpoint files) and shared memory (Ray's object store
mapped into the worker), and the proportional and unique set sizes (``PSS``, ``USS`` from
``/proc/PID/smaps_rollup``). The headline is the peak RSS, as the issue measured it and the operating system
accounts a process's memory; it counts the shared libraries in full in every worker, which the other two
split (``PSS``) or leave out (``USS``). The stage running when each worker peaked comes from the run's
``timeline.jsonl`` (start-up and validation before the first step are not in it: "start-up"). ``hybridflow
doctor`` is run with the same keys and its per-worker estimate shown beside. Prints a table, writes JSON.

Run it alone (``flock /work/wt/heavy.lock``): 4 ranks of the 194M model take about 6 GiB.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RANK_LINE = re.compile(r"rank (\d+)\] on .*, pid (\d+)")
STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
SMAPS_KEYS = ("Pss", "Private_Clean", "Private_Dirty")


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, float]:
    """``key: value kB`` lines of a /proc file, in MiB."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) / 1024
    return out


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (its children, theirs...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def sample(pid: int) -> dict[str, float]:
    """One reading of ``pid``'s memory (MiB); its peak-RSS mark is reset afterwards."""
    values = _kib_fields(f"/proc/{pid}/status", STATUS_KEYS)
    smaps = _kib_fields(f"/proc/{pid}/smaps_rollup", SMAPS_KEYS)
    values["PSS"] = smaps["Pss"]
    values["USS"] = smaps["Private_Clean"] + smaps["Private_Dirty"]
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
    except OSError:
        values["VmHWM"] = values["VmRSS"]  # no reset: fall back to the sampled resident set
    return values


class WorkerWatch(threading.Thread):
    """Samples the Ray worker processes (``ray::_WorkerHost``) under ``root``, and ``root`` itself (the
    driver), every ``interval`` seconds until ``root`` exits: ``series[pid]`` is a list of ``(time, sample)``."""

    def __init__(self, root: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.series: dict[int, list[tuple[float, dict[str, float]]]] = {}

    def run(self) -> None:
        while os.path.exists(f"/proc/{self.root}") and _state(self.root) != "Z":
            now = time.time()
            for pid in [self.root, *descendants(self.root)]:
                if pid != self.root and pid not in self.series and "_WorkerHost" not in _cmdline(pid):
                    continue
                try:
                    self.series.setdefault(pid, []).append((now, sample(pid)))
                except (OSError, KeyError):  # the process ended between listing and reading
                    continue
            time.sleep(self.interval)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def overrides(args: argparse.Namespace, model: str, data: Path, run: Path, ranks: int, gen: str) -> list[str]:
    """The ``hybridflow train`` keys of one measurement (everything else at the CLI's default)."""
    keys = [
        f"data.train_files={data / 'train.parquet'}",
        f"actor_rollout_ref.model.path={model}",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={args.samples}",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.rollout.sharded_generation={str(gen == 'sharded').lower()}",
        "trainer.backend=ray",
        f"trainer.n_workers={ranks}",
        "trainer.cpus_per_worker=0.5",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run}",
        "trainer.resume_mode=disable",
    ]
    if args.validate:
        keys.append(f"data.val_files={data / 'test.parquet'}")
    return keys + args.keys


def stage_at(when: float, spans: list[dict], first: float | None) -> str:
    """The step stage running at ``when`` (the innermost span), "start-up" before the first step."""
    inside = [s for s in spans if s["start"] <= when <= s["end"] + 0.25 and s["stage"] != "step"]
    if inside:
        return min(inside, key=lambda s: s["end"] - s["start"])["stage"]
    if first is not None and when < first:
        return "start-up"
    return "step" if any(s["start"] <= when <= s["end"] for s in spans) else "end"


def measure(keys: list[str], run: Path, interval: float, log: Path | None = None) -> dict:
    """``hybridflow train KEYS``, watched (its output copied to ``log``); per rank its peak and where it was."""
    # every worker's line that names its rank and pid, not one of them with "[repeated 3x across cluster]"
    env = dict(os.environ, HYBRIDFLOW_DEBUG="1", RAY_DEDUP_LOGS="0")
    start = time.time()
    proc = subprocess.Popen(
        [str(BIN / "hybridflow"), "train", *keys],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    watch = WorkerWatch(proc.pid, interval)
    watch.start()
    ranks, tail = {}, []
    copy = open(log, "a") if log else None  # noqa: SIM115 (closed below)
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if copy:
            copy.write(line)
        found = RANK_LINE.search(line)
        if found:
            ranks[int(found.group(2))] = int(found.group(1))
    proc.wait()
    watch.join()
    if copy:
        copy.close()
    if proc.returncode:
        raise SystemExit(f"hybridflow train failed ({proc.returncode}):\n{''.join(tail)}")
    spans = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    first = min((s["start"] for s in spans), default=None)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    workers = {}
    for pid, series in watch.series.items():
        if pid == proc.pid:
            continue
        when, peak = max(series, key=lambda item: item[1]["VmHWM"])
        by_stage: dict[str, float] = {}
        for t, values in series:
            stage = stage_at(t, spans, first)
            by_stage[stage] = max(by_stage.get(stage, 0.0), values["VmHWM"])
        workers[ranks.get(pid, f"pid {pid}")] = {
            "peak_rss_mib": peak["VmHWM"],
            "at_peak": peak,
            "stage": stage_at(when, spans, first),
            "peak_pss_mib": max(v["PSS"] for _, v in series),
            "peak_uss_mib": max(v["USS"] for _, v in series),
            "peak_by_stage_mib": by_stage,
        }
    driver = watch.series.get(proc.pid, [])
    stage_s: dict[str, float] = {}
    for span in spans:
        stage_s[span["stage"]] = stage_s.get(span["stage"], 0.0) + span["end"] - span["start"]
    return {
        "startup_s": (first or time.time()) - start,  # Ray, the workers, loading and sharding the model
        "stage_s": stage_s,
        "workers": dict(sorted(workers.items(), key=lambda item: (isinstance(item[0], str), item[0]))),
        "driver_peak_rss_mib": max((v["VmHWM"] for _, v in driver), default=0.0),
        "step_s": [row["timing_s/step"] for row in steps if "timing_s/step" in row],
        "wall_s": time.time() - start,
    }


def doctor_mib(keys: list[str], ranks: int) -> float:
    """``hybridflow doctor``'s memory estimate per worker (MiB) for the same keys."""
    out = subprocess.run(
        [str(BIN / "hybridflow"), "doctor", "--json", *keys], capture_output=True, text=True, check=False
    )
    checks = json.loads(out.stdout.strip().splitlines()[-1])["checks"]
    memory = next(c for c in checks if c["name"] == "memory")
    return memory["data"]["estimate_bytes"] / ranks / 2**20  # CPU workers: the estimate is for all of them


def prepare(args: argparse.Namespace, scratch: Path) -> tuple[str, Path]:
    data = scratch / "data"
    subprocess.run(
        [str(BIN / "hybridflow"), "prepare-data", "arithmetic", str(data), "--train-size", "64"]
        + ["--test-size", str(args.prompts)],
        check=True,
        capture_output=True,
    )
    if args.model:
        return args.model, data
    sys.path.insert(0, str(Path(__file__).parent))
    from memory_bare import random_model

    return random_model(args.random_model), data


def table(results: dict) -> str:
    lines = [
        "| generation | ranks | peak RSS per worker (MiB) | largest vs 1 rank | stage of the peak | "
        "PSS / USS at most (MiB) | driver (MiB) | doctor (MiB) | step s | start-up s | checkpoint s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (gen, ranks), r in results.items():
        workers = r["workers"].values()
        peak = max(w["peak_rss_mib"] for w in workers)
        one = results.get((gen, 1))
        ratio = peak / max(w["peak_rss_mib"] for w in one["workers"].values()) if one else None
        largest = max(workers, key=lambda w: w["peak_rss_mib"])
        peaks = " / ".join(f"{w['peak_rss_mib']:.0f}" for w in workers)
        lines.append(
            f"| {gen} | {ranks} | {peaks} | "
            f"{f'{ratio:.2f}x' if ratio else '-'} | {largest['stage']} | "
            f"{max(w['peak_pss_mib'] for w in workers):.0f} / {max(w['peak_uss_mib'] for w in workers):.0f} | "
            f"{r['driver_peak_rss_mib']:.0f} | {r['doctor_mib']:.0f} ({r['doctor_mib'] / peak - 1:+.0%}) | "
            f"{', '.join(f'{s:.1f}' for s in r['step_s'])} | {r['startup_s']:.0f} | "
            f"{r['stage_s'].get('checkpoint', 0.0):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if "--bare" in sys.argv[1:]:
        sys.path.insert(0, str(Path(__file__).parent))
        from memory_bare import main as bare

        bare([a for a in sys.argv[1:] if a != "--bare"])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random-model", default="1024,16", help="HIDDEN,LAYERS of a random Llama")
    parser.add_argument("--model", help="a model folder instead of the random model")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--generation", nargs="+", default=["sharded", "gathered"], choices=["sharded", "gathered"]
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--micro", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="training steps (from the 2nd, generation runs beside the gradients and moments)",
    )
    parser.add_argument("--validate", action="store_true", help="validate before and after (data.val_files)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--out", default="bench/results/memory.json")
    parser.add_argument("--log", type=Path, help="append every run's output to this file")
    parser.add_argument("keys", nargs="*", help="more hybridflow train keys (after --)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hfmem-run-"))  # data, runs and checkpoints: removed at exit
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    model, data = prepare(args, scratch)
    results = {}
    for gen in args.generation:
        for ranks in args.ranks:
            if ranks == 1 and gen == "gathered" and (("sharded", 1) in results):
                results[(gen, 1)] = results[("sharded", 1)]  # one rank is not sharded: nothing to gather
                continue
            run = scratch / f"run-{gen}-{ranks}"
            keys = overrides(args, model, data, run, ranks, gen)
            results[(gen, ranks)] = measure(keys, run, args.interval, args.log)
            results[(gen, ranks)]["doctor_mib"] = doctor_mib(keys, ranks)
            results[(gen, ranks)]["keys"] = keys
            print(
                f"{gen} generation, {ranks} rank(s): done in {results[(gen, ranks)]['wall_s']:.0f} s",
                flush=True,
            )
    print("\n" + table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "results": [{"generation": g, "ranks": n, **r} for (g, n), r in results.items()],
            },
            indent=2,
            default=str,  # paths (--log)
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
