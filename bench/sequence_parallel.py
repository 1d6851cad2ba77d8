"""Activation memory per rank for one long sequence under Ulysses sequence parallelism (1, 2 and 4 CPU
processes over gloo), with gradient checkpointing beside it.

    .venv/bin/python bench/sequence_parallel.py [--tokens 8192] [--response 1024] [--hidden 512] [--layers 2]
        [--sizes 1,2,4] [--out bench/results/sequence_parallel.json]

One sequence of ``--tokens`` tokens (a prompt, then a ``--response``-token response whose log-probs and
entropies train, as the actor's update computes them) through a tiny wide Llama (random weights, 8 heads, the
1k-token test tokenizer, so the layers' activations dominate and not the output layer). Each setting runs in
fresh processes, one per rank (forked), each doing one forward and backward. Per rank:

- ``saved``: bytes of the tensors autograd keeps from the forward for the backward (the activations; the
  weights themselves are not counted), each storage once;
- ``peak``: how far the process's resident memory rose above what it held just before the forward, at its
  highest during forward and backward (the kernel's high-water mark, reset through ``/proc/self/clear_refs``);
- seconds of forward and backward (the ranks share this machine's cores, so compare checkpointing's cost at
  one size, not sizes with each other).

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.models import make_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.utils.memory import return_freed_memory
from hybridflow.workers.modeling import load_model, response_log_probs
from hybridflow.workers.ulysses import enable_ulysses, sequence_parallel

MB = 2**20
KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory figure in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def one_sequence(tokens: int, response: int) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (1, tokens), generator=gen)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(tokens)[None],
            "responses": ids[:, -response:],
            "response_mask": torch.ones(1, response, dtype=torch.long),
        }
    )


def fwd_bwd(model: torch.nn.Module, data: DataProto, sp) -> tuple[int, float]:
    """One forward and backward; returns the bytes saved for the backward and the seconds it took."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_probs, entropy = response_log_probs(
            model, data, with_entropy=True, entropy_grad=True, share_prompt=False, sp=sp
        )
        loss = -(log_probs + 0.01 * entropy).mean()
    loss.backward()
    return sum(saved.values()), time.perf_counter() - start


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, path: str, out: str) -> None:
    torch.set_num_threads(1)
    return_freed_memory()
    sp = None
    if size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        sp = sequence_parallel(size, KEY)
    model = load_model(path, torch.device("cpu"), "fp32", gradient_checkpointing=args.checkpointing)
    model.train()
    if sp is not None:
        enable_ulysses(model, size, KEY)
    data = one_sequence(args.tokens, args.response)
    fwd_bwd(model, one_sequence(256, 64), sp)  # warm-up: kernels, allocator, the collectives' buffers
    model.zero_grad(set_to_none=False)  # the gradients' memory is held before the measured pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident-memory high-water mark
    before = _status("VmRSS")
    saved, seconds = fwd_bwd(model, data, sp)
    result = {
        "rank": rank,
        "saved_bytes": saved,
        "peak_rise_bytes": _status("VmHWM") - before,
        "seconds": seconds,
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    if sp is not None:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, size: int, path: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(size, port, args, path, out), nprocs=size, start_method="fork")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(size)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--out", default="bench/results/sequence_parallel.json")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="hf-sp-model-")
    path = make_tiny_model(
        folder,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=2 * args.hidden,
        max_position_embeddings=args.tokens,
    )
    rows = []
    for checkpointing in (False, True):
        for size in [int(s) for s in args.sizes.split(",")]:
            args.checkpointing = checkpointing
            ranks = measure(args, size, path)
            row = {
                "sequence_parallel": size,
                "gradient_checkpointing": checkpointing,
                "saved_mb": max(r["saved_bytes"] for r in ranks) / MB,
                "peak_rise_mb": max(r["peak_rise_bytes"] for r in ranks) / MB,
                "seconds": max(r["seconds"] for r in ranks),
                "ranks": ranks,
            }
            rows.append(row)
            print(
                f"SP {size}  checkpointing {'on ' if checkpointing else 'off'}  saved for backward "
                f"{row['saved_mb']:8.0f} MB  peak rise {row['peak_rise_mb']:8.0f} MB  fwd+bwd {row['seconds']:6.1f} s",
                flush=True,
            )
    print(
        "\n| SP size | gradient checkpointing | saved for backward per rank, MB | peak rise per rank, MB | fwd+bwd s |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['sequence_parallel']} | {'on' if row['gradient_checkpointing'] else 'off'} | "
            f"{row['saved_mb']:.0f} | {row['peak_rise_mb']:.0f} | {row['seconds']:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    setup = {k: getattr(args, k) for k in ("tokens", "response", "hidden", "layers")}
    Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
