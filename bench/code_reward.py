"""Cost of code rewards: one sandbox per sample, at 1, 2, 4, 8 and 16 sandboxes in parallel.

Scores ``--samples`` responses of the generated function task (``prepare-data code``: five assert tests
each; right and wrong programs alternating) with ``reward_model.code.max_concurrent`` 1 to 16, side by
side, after a warm-up, next to an empty sandbox (``print(1)``). Prints the wall seconds per sample (the
batch's wall time over its samples: what a training step waits for), the mean sandbox seconds per sample
(each sandbox's own wall time), the CPU seconds the sandboxes used per sample, and the seconds 256 samples
take at that rate. Then all 164 HumanEval canonical solutions (``prepare-data humaneval``) at the default
concurrency, as a check that the harness passes what is right. Writes JSON.

    .venv/bin/python bench/code_reward.py [--samples 32] [--out bench/results/code_reward.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

from hybridflow.config.schema import CodeRewardConfig
from hybridflow.data.code_tasks import function_solution, function_splits, humaneval_rows
from hybridflow.rewards import CodeScorer
from hybridflow.tools import sandbox


def task_items(count: int) -> list[tuple[str, str, None]]:
    """Right programs and wrong ones (the one-shot example's ``x * 3``), alternating."""
    rows, _ = function_splits(count, 0, seed=0)
    items = []
    for i, row in enumerate(rows):
        op, n = row["extra_info"]["op"], row["extra_info"]["n"]
        answer = function_solution(op, n) if i % 2 == 0 else function_solution("times", 3)
        items.append((answer, row["reward_model"]["ground_truth"], None))
    return items


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the sandboxes, once they are reaped
    return usage.ru_utime + usage.ru_stime


def measure(items: list, concurrency: int, repeats: int) -> dict[str, float]:
    scorer = CodeScorer(CodeRewardConfig(max_concurrent=concurrency))
    walls, inside, cpu = [], [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), _children_cpu_s()
        results = scorer.score_many(items)
        walls.append((time.perf_counter() - start) / len(items))
        cpu.append((_children_cpu_s() - cpu_start) / len(items))
        inside.append(statistics.mean(r["sandbox_s"] for r in results))
        assert [r["score"] for r in results] == [1.0 - i % 2 for i in range(len(items))], results
    per_sample = statistics.median(walls)
    return {
        "wall_s_per_sample": per_sample,
        "sandbox_s_per_sample": statistics.median(inside),
        "cpu_s_per_sample": statistics.median(cpu),
        "seconds_for_256": 256 * per_sample,
    }


def empty_sandbox_s(calls: int = 10) -> float:
    """Median wall time of a sandbox that runs ``print(1)``: what any one-sandbox-per-sample scorer pays."""
    times = [sandbox.run_python("print(1)").duration_s for _ in range(calls)]
    return statistics.median(times)


def humaneval_check() -> dict[str, float]:
    rows = humaneval_rows()
    items = [(r["extra_info"]["canonical_solution"], r["reward_model"]["ground_truth"], None) for r in rows]
    start = time.perf_counter()
    results = CodeScorer().score_many(items)
    return {
        "problems": len(rows),
        "passed": sum(r["score"] for r in results),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path("bench/results/code_reward.json"))
    args = parser.parse_args()
    items = task_items(args.samples)
    CodeScorer().score_many(items[:4])  # warm-up: the sandbox probe, the page cache
    empty = empty_sandbox_s()
    rows = {c: measure(items, c, args.repeats) for c in args.concurrency}
    print(f"an empty sandbox (print(1)), one at a time: {empty:.3f} s")
    print(
        f"{'parallel':>8} {'wall s/sample':>14} {'sandbox s/sample':>17} {'CPU s/sample':>13} {'256 samples s':>14}"
    )
    for c, row in rows.items():
        print(
            f"{c:>8} {row['wall_s_per_sample']:>14.3f} {row['sandbox_s_per_sample']:>17.3f} "
            f"{row['cpu_s_per_sample']:>13.3f} {row['seconds_for_256']:>14.1f}"
        )
    check = humaneval_check()
    print(
        f"HumanEval canonical solutions: {check['passed']:.0f} of {check['problems']} pass ({check['wall_s']:.1f} s)"
    )
    result = {
        "mode": sandbox.sandbox_mode(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "machine": platform.machine(),
        "samples": args.samples,
        "empty_sandbox_s": empty,
        "by_concurrency": rows,
        "humaneval": check,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
