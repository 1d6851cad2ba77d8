"""Memory per rank of one actor update on 2 ranks: full replicas (ddp), FSDP2 sharding, FSDP2 with optimizer
offload, and a KL run's reference policy as a second copy (ddp) or as the LoRA actor with its adapter off.

    .venv/bin/python bench/memory.py [--model default] [--rows 8] [--prompt 64] [--response 32] [--out FILE]

Each setting runs in 2 fresh processes (gloo), which load the model, compute the reference log-probs when
the setting has a reference, and take one optimiser step on the same synthetic batch. Per rank it reports
the bytes of parameters + gradients + optimiser state that the rank holds (its shards under FSDP2) and
the peak resident memory of the process (which also counts the full model each rank loads before
sharding, activations, and torch itself). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybridflow.config.schema import PPOConfig
from hybridflow.protocol import DataProto

SETTINGS = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2 + optimizer_offload": {"strategy": "fsdp2", "optimizer_offload": True},
    "ddp + reference copy (KL)": {"strategy": "ddp", "kl": True},
    "LoRA r=16 + reference = adapter off (KL)": {"strategy": "ddp", "kl": True, "lora_rank": 16},
}


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _batch(rows: int, prompt: int, response: int, vocab: int, seed: int) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (rows, prompt + response), generator=gen)
    ones = torch.ones(rows, prompt + response, dtype=torch.long)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": ones,
            "position_ids": torch.arange(prompt + response).expand(rows, -1),
            "responses": input_ids[:, prompt:],
            "response_mask": ones[:, prompt:],
            "advantages": torch.randn(rows, response, generator=gen),
        }
    )


def _rank(
    rank: int, world: int, port: int, model: str, setting: dict, args: argparse.Namespace, out: dict
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from hybridflow.workers import ActorRolloutRefWorker

    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = model
    arr.model.lora_rank = setting.get("lora_rank", 0)
    arr.actor.strategy = setting["strategy"]
    arr.actor.fsdp_config.optimizer_offload = setting.get("optimizer_offload", False)
    arr.actor.use_kl_loss = setting.get("kl", False)
    arr.actor.ppo_mini_batch_size = args.rows
    arr.actor.ppo_micro_batch_size_per_gpu = 2
    arr.ref.log_prob_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu = 2
    arr.actor.optim.lr = 1e-6
    role = "actor_rollout_ref" if arr.actor.use_kl_loss else "actor_rollout"
    worker = ActorRolloutRefWorker(cfg.resolve().actor_rollout_ref, role=role)
    worker.init_model()
    data = _batch(args.rows, args.prompt, args.response, worker.tokenizer.vocab_size, 0)
    data = data.chunk(world)[rank]
    if arr.actor.use_kl_loss:
        data = data.union(worker.compute_ref_log_prob(data))
    start = time.perf_counter()
    worker.update_actor(data)
    seconds = time.perf_counter() - start
    modules = [m for m in (worker.module, worker.ref_module) if m is not None]
    params = sum(_local_bytes(p) for m in modules for p in m.parameters())
    grads = sum(_local_bytes(p.grad) for p in worker.module.parameters() if p.grad is not None)
    optim = sum(
        _local_bytes(v)
        for s in worker.engine.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    out[rank] = {
        "params_mib": params / 2**20,
        "grads_mib": grads / 2**20,
        "optim_mib": optim / 2**20,
        "state_mib": (params + grads + optim) / 2**20,
        "step_s": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="default", help="model folder, or 'default' for SmolLM2-135M-Instruct"
    )
    parser.add_argument("--rows", type=int, default=8, help="sequences in the step, split over the 2 ranks")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--only", action="append", help="run only these settings (repeatable)")
    parser.add_argument("--out", default="bench/results/memory.json")
    args = parser.parse_args()

    results = {}
    ctx = mp.get_context("spawn")
    for name, setting in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        with ctx.Manager() as manager:
            out = manager.dict()
            port = _free_port()
            procs = [
                ctx.Process(target=_rank, args=(r, 2, port, args.model, setting, args, out)) for r in range(2)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise SystemExit(f"setting {name!r} failed (exit codes {[p.exitcode for p in procs]})")
            results[name] = [dict(out[r]) for r in range(2)]
        print(f"{name}: done", flush=True)
    header = (
        "| setting | params + grads + optimizer per rank (MiB) | peak RSS rank 0 / rank 1 (MiB) | step s |"
    )
    print("\n" + header + "\n|---|---|---|---|")
    for name, row in results.items():
        state = (
            f"{row[0]['state_mib']:.0f} ({row[0]['params_mib']:.0f} + {row[0]['grads_mib']:.0f} + "
            f"{row[0]['optim_mib']:.0f})"
        )
        print(
            f"| {name} | {state} | {row[0]['peak_rss_mib']:.0f} / {row[1]['peak_rss_mib']:.0f} | "
            f"{max(r['step_s'] for r in row):.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
