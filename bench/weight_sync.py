"""Weight sync from the actor to a rollout worker of its own (``trainer.placement=split``, the asynchronous
modes) over the weight link, against a plain memcpy of the same bytes on this machine (the floor).

    .venv/bin/python bench/weight_sync.py [--model default] [--random-model 1024,16] [--ranks 1 4]
        [--bucket-mb 64] [--repeats 3] [--out bench/results/weight_sync.json]

Real workers on Ray: the actor (FSDP2 over ``--ranks`` processes; 1 = one unsharded rank) and one rollout
worker, each its own process; the trainer's ``LinkedWeights`` forms the link and runs each sync (the actor's
rank 0 streams buckets, the rollout loads each in place and reads it back against the trainer's checksum).
Side by side:
- a sharded actor's ranks filling the shared-memory buckets with their shards in place (``weight_shards``,
  what a run does here), and gathering whole tensors to rank 0 (what every sync did before, and still does
  for LoRA and across machines);
- a lock-step sync written straight into the rollout's model (the link's model segment, which the rollout's
  model holds: what a run does here), and through the two bucket segments, copied out of them by the
  rollout (what every lock-step sync did before);
- the rollout receiving as an asynchronous run does (``staged``: it copies the version to keep it, then
  takes it before its next generation, outside the timing), into the memory of the version it forgot, and
  into new memory (what every staged sync did before).
Per setting, after one warm-up sync, the median of ``--repeats`` syncs, split into what the sender spent
(filling the buckets: gathering or writing the shards; the transfers) and what the receiver did (receiving;
loading or keeping, and checking), and each process's peak resident memory during the syncs above what it
held before them (the kernel's high-water mark, reset through ``/proc/self/clear_refs``), next to the bucket
size. ``--model`` is the embedded SmolLM2-135M (fp32) by default; ``--random-model HIDDEN,LAYERS`` adds a
random Llama built from a config (vocabulary 8k, MLP 3x hidden; 1024,16 is about 200M parameters).
Prints a table and writes JSON; run it alone (``flock /work/wt/heavy.lock ...``): timings on a busy machine
are not the machine's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.config.schema import PPOConfig
from hybridflow.models import make_tiny_model, resolve_model_path
from hybridflow.single_controller import ClassWithInitArgs, Dispatch, register
from hybridflow.single_controller.ray import (
    ProcessSetup,
    RayResourcePool,
    RayWorkerGroup,
    init_ray,
    processes_per_node,
)
from hybridflow.trainer.weight_transport import LinkedWeights
from hybridflow.workers import ActorRolloutRefWorker

MB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


@dataclass(frozen=True)
class Mode:
    """How one setting syncs: ``to_rank0``, a sharded actor gathers whole tensors to its rank 0 even where its
    ranks could fill the shared buckets in place (what every sync did before ``weight_shards``; still the way
    for LoRA and across machines); ``via_buckets``, a lock-step sync goes through the two bucket segments even
    where the link has a model segment (what every lock-step sync did before it); ``staged``, received as an
    asynchronous run does, into the ``spare`` (the version it forgot) or into new memory."""

    to_rank0: bool = False
    via_buckets: bool = False
    staged: bool = False
    spare: bool = True

    def applies(self, ranks: int, device: str) -> bool:
        """Whether this mode differs from the others for an actor of ``ranks`` on ``device``: only several
        ranks gather to rank 0, and only CPU links have shared memory to choose a segment in."""
        return (ranks > 1 or not self.to_rank0) and (device == "cpu" or not self.via_buckets)

    def fill(self, ranks: int) -> str:
        return "to rank 0" if self.to_rank0 or ranks == 1 else "in place"

    def received(self) -> str:
        if self.staged:
            return "kept, into a spare" if self.spare else "kept, into new memory"
        return "loaded, via buckets" if self.via_buckets else "loaded, into the model"


#: what each row compares: lock-step into the model segment and through the buckets, filled in place and
#: gathered to rank 0 (sharded actors only), and an asynchronous run's receive into a spare and new memory
MODES = (
    Mode(),
    Mode(via_buckets=True),
    Mode(to_rank0=True),
    Mode(staged=True),
    Mode(staged=True, spare=False),
)


class MeasuredWorker(ActorRolloutRefWorker):
    """The policy worker, plus its memory (resident memory on CPU, allocated GPU memory on CUDA): ``mark``
    resets the peak and returns what it holds now, ``peak`` the highest since; it syncs as ``mode`` says."""

    def __init__(self, *args, mode: Mode = Mode(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode

    def _fills_in_place(self, policy: torch.nn.Module) -> bool:
        return not self.mode.to_rank0 and super()._fills_in_place(policy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, into_model: bool = False) -> dict[str, float] | None:
        return super().send_weights(into_model and not self.mode.via_buckets)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_version(self, version: int, spare: bool) -> None:
        """What an asynchronous run's rollout does before its next generation: load ``version`` and forget
        the older ones; without ``spare`` the forgotten one is dropped (what every sync did before), so the
        next version is received into new memory."""
        assert self.mailbox is not None
        self.mailbox.use(version, keep_from=version)
        if not spare:
            self.mailbox.take_spare()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mark(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peak(self) -> int:
        return (
            torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else _status("VmHWM")
        )


def memcpy_floor(nbytes: int, repeats: int, device: str = "cpu", threads: int | None = None) -> float:
    """Seconds of one ``copy_`` of ``nbytes`` between two buffers in one process (the best of ``repeats``):
    host memory, or on ``cuda`` one GPU's; on the CPU with ``threads`` torch threads (None: this process's)."""
    if threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return memcpy_floor(nbytes, repeats, device)
        finally:
            torch.set_num_threads(previous)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched before timing
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def setting(
    model: str,
    ranks: int,
    bucket_mb: int,
    repeats: int,
    device: str = "cpu",
    mode: Mode = Mode(),
) -> dict:
    cfg = PPOConfig()
    cfg.trainer.device = device
    arr = cfg.actor_rollout_ref
    arr.model.path, arr.rollout.weight_sync_bucket_mb = model, bucket_mb
    arr.actor.strategy = "fsdp2" if ranks > 1 else "ddp"
    arr = cfg.resolve().actor_rollout_ref
    # 2 cores: the actor's ranks and the rollout worker share them
    gpu = device == "cuda"  # then each process has a GPU of its own
    cpus = 1.0 if gpu else 2.0 / (ranks + 1)
    pools = [RayResourcePool([n], use_gpu=gpu, cpus_per_process=cpus, name=f"ws{n}") for n in (ranks, 1)]
    init = lambda role: ClassWithInitArgs(  # noqa: E731
        MeasuredWorker, arr, role=role, device=device, mode=mode
    )
    # the torch threads a run gives them: the machine's cores shared among every worker process on it
    setup = ProcessSetup(node_processes=processes_per_node(pools))
    actor = RayWorkerGroup(pools[0], init("actor"), name_prefix="ws_actor", setup=setup)
    rollout = RayWorkerGroup(pools[1], init("rollout"), name_prefix="ws_rollout", setup=setup)
    try:
        actor.init_model()
        rollout.init_model()
        link = LinkedWeights(actor, rollout)
        link.send(version=1, staged=mode.staged)  # warm-up: buffers, pages, the link's first use
        if mode.staged:
            rollout.take_version(1, mode.spare)
        before = actor.mark() + rollout.mark()
        syncs = []
        for version in range(2, 2 + repeats):
            start = time.perf_counter()
            stats = link.send(version, staged=mode.staged)
            syncs.append((time.perf_counter() - start, stats))
            if mode.staged:
                rollout.take_version(version, mode.spare)
        peaks = actor.peak() + rollout.peak()
    finally:
        for group in (actor, rollout):
            group.shutdown()
        for pool in pools:
            pool.remove()
    seconds, stats = sorted(syncs, key=lambda s: s[0])[len(syncs) // 2]
    rises = [(peak - held) / MB for peak, held in zip(peaks, before)]
    return {
        "ranks": ranks,
        "fill": mode.fill(ranks),
        "received": mode.received(),
        "bucket_mb": bucket_mb,
        "mb": stats["weight_sync/mb"],
        "sync_s": seconds,
        "sync_s_all": [s for s, _ in syncs],
        **{
            key.removeprefix("weight_sync/"): value for key, value in stats.items() if key != "weight_sync/mb"
        },
        "actor_rank_peak_rise_mb": rises[:-1],
        "actor_rank_held_mb": [held / MB for held in before[:-1]],
        "rollout_peak_rise_mb": rises[-1],
        "rollout_held_mb": before[-1] / MB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--random-model", default="1024,16", help="HIDDEN,LAYERS; empty: none")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU per process: ranks + 1 GPUs)")
    parser.add_argument("--out", default="bench/results/weight_sync.json")
    args = parser.parse_args()
    models = {"SmolLM2-135M (fp32)": resolve_model_path(args.model)} if args.model else {}
    if args.random_model:
        hidden, layers = (int(v) for v in args.random_model.split(","))
        folder = tempfile.mkdtemp(prefix="hf-ws-model-")
        models[f"random {hidden}x{layers}"] = make_tiny_model(
            folder,
            vocab_size=8192,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=hidden // 64,
            num_kv_heads=max(1, hidden // 256),
            intermediate_size=3 * hidden,
        )
    init_ray(num_cpus=None if args.device == "cuda" else 2)
    rows = []
    for name, path in models.items():
        for ranks, mode in [(r, m) for r in args.ranks for m in MODES if m.applies(r, args.device)]:
            row = {"model": name, **setting(path, ranks, args.bucket_mb, args.repeats, args.device, mode)}
            row["memcpy_s"] = memcpy_floor(int(row["mb"] * MB), 5, args.device)
            row["vs_memcpy"] = row["sync_s"] / row["memcpy_s"]
            if args.device == "cpu":  # each worker process has one core's share of this machine's threads
                row["memcpy_1thread_s"] = memcpy_floor(int(row["mb"] * MB), 5, threads=1)
                row["vs_memcpy_1thread"] = row["sync_s"] / row["memcpy_1thread_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    print(
        "\n| model | actor ranks | buckets filled | received | MB | memcpy s | sync s | x memcpy | x memcpy, 1 thread | gather s | send s "
        "| receive s | load+check s | peak rise per actor rank MB | rollout peak rise MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        actor_rises = " / ".join(f"{v:.0f}" for v in r["actor_rank_peak_rise_mb"])
        print(
            f"| {r['model']} | {r['ranks']} | {r['fill']} | {r['received']} | {r['mb']:.0f} | {r['memcpy_s']:.3f} | {r['sync_s']:.2f} | "
            f"{r['vs_memcpy']:.1f} | {r.get('vs_memcpy_1thread', float('nan')):.1f} | {r['gather_s']:.2f} | "
            f"{r['send_s']:.2f} | {r['receive_s']:.2f} | {r['load_s']:.2f} | {actor_rises} | {r['rollout_peak_rise_mb']:.0f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"bucket_mb": args.bucket_mb, "device": args.device, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
