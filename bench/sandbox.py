"""Cost of one ``python`` tool call: the sandbox's wall time for a trivial script, per mode.

Each mode this user can get (``namespaces``; ``bwrap`` when not root; the ``unsafe`` opt-out, for
comparison: limits only) runs ``print(1)`` ``--calls`` times after two warm-up calls; the table gives the
median and the 90th percentile.

    .venv/bin/python bench/sandbox.py [--out bench/results/sandbox.json] [--calls 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from hybridflow.tools import sandbox
from hybridflow.tools.sandbox import SandboxLimits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/sandbox.json"))
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    limits = SandboxLimits(timeout_s=30.0)
    rows = {}
    for mode in (*sandbox.MODES, "unsafe"):
        if mode != "unsafe" and sandbox._why_not(mode) is not None:
            print(f"{mode}: not available here ({sandbox._why_not(mode)})")
            continue
        seconds = []
        for i in range(args.calls + 2):
            result = sandbox._run("print(1)", limits, mode)
            assert result.ok and result.stdout == "1\n", result
            if i >= 2:
                seconds.append(result.duration_s)
        seconds.sort()
        rows[mode] = {
            "median_ms": 1000 * statistics.median(seconds),
            "p90_ms": 1000 * seconds[int(0.9 * (len(seconds) - 1))],
        }
    print(f"{'mode':<12} {'median ms':>10} {'p90 ms':>8}")
    for mode, row in rows.items():
        print(f"{mode:<12} {row['median_ms']:>10.1f} {row['p90_ms']:>8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "user": "root" if os.geteuid() == 0 else "non-root",
        "machine": platform.machine(),
        "modes": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
