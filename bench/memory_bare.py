"""Memory per rank in bare processes (``bench/memory.py --bare``): one actor update with full replicas (ddp),
FSDP2 sharding, FSDP2 with optimizer offload, a KL run's reference policy as a second copy (ddp) or as the LoRA
actor with its adapter off, and a whole GRPO step (generation from the sharded actor, old log-probs, update), on
1, 2 or 4 ranks, each rank a process of its own running ``ActorRolloutRefWorker`` on a synthetic batch (no Ray,
no trainer, no checkpoint at the end: what the path users run adds is measured by ``bench/memory.py``).

    .venv/bin/python bench/memory.py --bare [--model default | --random-model 1024,16] [--ranks 1 2 4]
        [--only SETTING ...] [--rows 8] [--prompt 64] [--response 32] [--out FILE]

Each setting runs in fresh processes, one per rank (gloo), which load the model, compute the reference
log-probs when the setting has a reference (or generate the rollouts, for the GRPO step), and take
``--updates`` optimiser steps (2) on the same synthetic batch, split over the ranks: the first builds AdamW's
moments only at its end, so its backward runs without them, as no later step of a run does. Per rank it reports the bytes of
parameters + gradients + optimiser state that the rank holds (its shards under FSDP2) and the peak resident
memory of the process (which also counts the checkpoint as rank 0 reads it, gathered layers, activations, and
torch itself). ``--random-model HIDDEN,LAYERS`` builds a random Llama from a config (the tiny tokenizer's 1.2k-token
vocabulary, MLP 3x hidden; 1024,16 is 194M parameters): no download. Each rank hands freed blocks of 4 MiB and more back to
the OS, as every worker does with ``trainer.return_freed_memory`` (the default); ``--keep-freed-memory`` leaves
glibc's allocator as it is, for comparison. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybridflow.config.schema import PPOConfig
from hybridflow.protocol import DataProto
from hybridflow.utils.memory import return_freed_memory

SETTINGS = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2 + optimizer_offload": {"strategy": "fsdp2", "optimizer_offload": True},
    "ddp + reference copy (KL)": {"strategy": "ddp", "kl": True},
    "LoRA r=16 + reference = adapter off (KL)": {"strategy": "ddp", "kl": True, "lora_rank": 16},
    # generation from the sharded actor without gathering it (rollout.sharded_generation), then the update
    "fsdp2 GRPO step (sharded generation)": {"strategy": "fsdp2", "grpo": True},
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
    if not args.keep_freed_memory:  # what trainer.return_freed_memory does in every worker process
        return_freed_memory()
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
    arr.rollout.n = 4 if setting.get("grpo") else 1
    arr.rollout.sharded_generation = True
    arr.model.enable_gradient_checkpointing = args.gradient_checkpointing
    role = "actor_rollout_ref" if arr.actor.use_kl_loss else "actor_rollout"
    worker = ActorRolloutRefWorker(cfg.resolve().actor_rollout_ref, role=role, response_length=args.response)
    worker.init_model()
    data = _batch(args.rows, args.prompt, args.response, worker.tokenizer.vocab_size, 0)
    data = data.chunk(world)[rank]
    start = time.perf_counter()
    if setting.get("grpo"):  # this rank's prompts, n samples each, then old log-probs and the update
        ids = data.batch["input_ids"][:: arr.rollout.n, : args.prompt]
        prompts = DataProto.from_dict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(args.prompt).expand(len(ids), -1),
            }
        )
        data = worker.generate_sequences(prompts)
        data = data.union(worker.compute_log_prob(data))
        data.batch["advantages"] = torch.randn(data.batch["responses"].shape)
    if arr.actor.use_kl_loss:
        data = data.union(worker.compute_ref_log_prob(data))
    after_update = []  # the first update builds AdamW's moments only at its end: later ones carry them throughout
    for _ in range(args.updates):
        worker.update_actor(data)
        after_update.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
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
        "peak_rss_mib": after_update[-1],
        "peak_rss_after_update_mib": after_update,
    }


def doctor_mib(model: str, setting: dict, world: int, args: argparse.Namespace) -> float:
    """What ``hybridflow doctor`` estimates for the largest worker of this setting (MiB)."""
    from transformers import AutoConfig

    from hybridflow.commands.memory_estimate import estimate_memory, model_shape
    from hybridflow.config.schema import load_config
    from hybridflow.models import resolve_model_path

    n = 4 if setting.get("grpo") else 1
    cfg = load_config(
        [
            "data.train_files=unused.parquet",
            "algorithm.adv_estimator=grpo",
            "trainer.device=cpu",
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.model.lora_rank={setting.get('lora_rank', 0)}",
            f"actor_rollout_ref.actor.strategy={setting['strategy']}",
            f"actor_rollout_ref.actor.use_kl_loss={setting.get('kl', False)}",
            f"data.max_prompt_length={args.prompt}",
            f"data.max_response_length={args.response}",
            f"data.train_batch_size={args.rows // n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.rows // n}",
            f"actor_rollout_ref.rollout.n={n}",
            "actor_rollout_ref.rollout.sharded_generation=true",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        ]
    )
    shape = model_shape(AutoConfig.from_pretrained(resolve_model_path(model)))
    return estimate_memory(cfg, shape, world).device / 2**20


def random_model(spec: str) -> str:
    """``HIDDEN,LAYERS``: a random Llama in a scratch folder removed at exit (about 4 bytes per parameter), with
    hidden // 64 heads, hidden // 256 key/value heads and an MLP of 3 x hidden; no download."""
    from hybridflow.models import make_tiny_model

    hidden, layers = (int(v) for v in spec.split(","))
    scratch = tempfile.mkdtemp(prefix="hfmem-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return make_tiny_model(
        Path(scratch) / "model",
        vocab_size=8192,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=max(1, hidden // 256),
        intermediate_size=3 * hidden,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench/memory.py --bare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default="default", help="model folder, or 'default' for SmolLM2-135M-Instruct"
    )
    parser.add_argument(
        "--random-model", help="HIDDEN,LAYERS: a random Llama built from a config instead of --model"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="worker counts to measure")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the step, split over the ranks")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--only", action="append", help="run only these settings (repeatable)")
    parser.add_argument(
        "--updates",
        type=int,
        default=2,
        help="optimiser steps on the batch: from the 2nd, the backward runs beside AdamW's moments, as in a run",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in the backward"
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="leave glibc's allocator as it is (trainer.return_freed_memory=false) instead of returning freed blocks",
    )
    parser.add_argument("--out", default="bench/results/memory_bare.json")
    args = parser.parse_args(argv)

    model = random_model(args.random_model) if args.random_model else args.model
    results = {}
    ctx = mp.get_context("spawn")
    for name, setting in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        for world in args.ranks:
            with ctx.Manager() as manager:
                out = manager.dict()
                port = _free_port()
                procs = [
                    ctx.Process(target=_rank, args=(r, world, port, model, setting, args, out))
                    for r in range(world)
                ]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                if any(p.exitcode for p in procs):
                    raise SystemExit(f"setting {name!r} failed (exit codes {[p.exitcode for p in procs]})")
                results[f"{name}, {world} rank{'s' * (world > 1)}"] = [dict(out[r]) for r in range(world)]
            print(f"{name}, {world} ranks: done", flush=True)
    header = (
        "| setting | params + grads + optimizer per rank (MiB) | peak RSS per rank (MiB) | largest vs 1 rank "
        "| after the 1st update | doctor's estimate (MiB) | step s |"
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|")
    for name, row in results.items():
        state = (
            f"{row[0]['state_mib']:.0f} ({row[0]['params_mib']:.0f} + {row[0]['grads_mib']:.0f} + "
            f"{row[0]['optim_mib']:.0f})"
        )
        peak = max(r["peak_rss_mib"] for r in row)
        single = results.get(name.rsplit(", ", 1)[0] + ", 1 rank")
        ratio = f"{peak / max(r['peak_rss_mib'] for r in single):.2f}x" if single else "-"
        peaks = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in row)
        doctor = doctor_mib(model, SETTINGS[name.rsplit(", ", 1)[0]], len(row), args)
        first = " / ".join(f"{r['peak_rss_after_update_mib'][0]:.0f}" for r in row)
        print(
            f"| {name} | {state} | {peaks} | {ratio} | "
            f"{first} | "
            f"{doctor:.0f} ({doctor / peak - 1:+.0%}) | "
            f"{max(r['step_s'] for r in row):.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
