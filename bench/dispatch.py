"""Latency of worker-group calls: what the single controller adds on top of the workers' own work.

Measures the mean round trip of an empty call on a LocalWorkerGroup and on a 2-worker RayWorkerGroup, and
of a DP_COMPUTE_PROTO call carrying a 256 x 2048 int64 DataProto (4 MiB) that the 2 Ray workers send back.

    .venv/bin/python bench/dispatch.py [--out bench/results/dispatch.json] [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow import DataProto
from hybridflow.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, Worker, register


class EchoWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


def mean_ms(call: Callable[[], object], calls: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/dispatch.json"))
    parser.add_argument("--calls", type=int, default=300, help="calls per empty-call measurement")
    parser.add_argument("--proto-calls", type=int, default=30, help="calls per DataProto measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import ray

    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup, init_ray

    batch = DataProto.from_dict({"input_ids": torch.randint(0, 50_000, (256, 2048), dtype=torch.int64)})
    local = LocalWorkerGroup(ClassWithInitArgs(EchoWorker))
    rows = [
        ("local, 1 worker", "empty call", mean_ms(local.noop, args.calls * 10)),
        (
            "local, 1 worker",
            "DP_COMPUTE_PROTO 256x2048 int64",
            mean_ms(lambda: local.echo(batch), args.proto_calls),
        ),
    ]

    temp_dir = tempfile.mkdtemp(prefix="hfray-")
    started = init_ray(num_cpus=2, _temp_dir=temp_dir)
    try:
        pool = RayResourcePool([2], cpus_per_process=0.5, name="bench")
        group = RayWorkerGroup(pool, ClassWithInitArgs(EchoWorker), name_prefix="bench")
        echoed = group.echo(batch)
        assert torch.equal(echoed.batch["input_ids"], batch.batch["input_ids"]), "round trip changed the data"
        rows += [
            ("ray, 2 workers", "empty call", mean_ms(group.noop, args.calls)),
            (
                "ray, 2 workers",
                "DP_COMPUTE_PROTO 256x2048 int64",
                mean_ms(lambda: group.echo(batch), args.proto_calls),
            ),
        ]
        group.shutdown()
        pool.remove()
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    print(f"{'group':<18} {'call':<34} {'mean ms':>9}")
    for group_name, call, ms in rows:
        print(f"{group_name:<18} {call:<34} {ms:>9.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "cpus": os.cpu_count(),
        },
        "results": [{"group": g, "call": c, "mean_ms": round(ms, 4)} for g, c, ms in rows],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
