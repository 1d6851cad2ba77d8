#!/usr/bin/env bash
# FSDP2 on ONE GPU keeps its policies (CUDA only; not run in CI): an fsdp2 actor on a single rank is
# wrapped over a process group of its own rank, computes in bf16 over fp32 master weights, and with
# fsdp_config.param_offload / optimizer_offload keeps its parameters and AdamW moments in CPU memory, so
# its peak GPU memory is lower than without offload. Run from the repository root:
#   bash scripts/gpu_check_fsdp_single.sh        (uses .venv/bin/python unless PYTHON is set)
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
PYTHONPATH=$PWD "$PYTHON" - <<'PY'
import tempfile

import torch

from hybridflow.models import make_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.sharding import is_sharded

assert torch.cuda.is_available(), "this check needs a GPU"
model = make_tiny_model(tempfile.mkdtemp() + "/m", vocab_size=4096, hidden_size=1024, num_layers=8,
                        num_heads=16, num_kv_heads=4, intermediate_size=3072)


def run(offload: bool) -> dict:
    torch.cuda.reset_peak_memory_stats()
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = model
    arr.actor.strategy = "fsdp2"
    arr.actor.fsdp_config.param_offload = arr.actor.fsdp_config.optimizer_offload = offload
    arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu = 8, 4
    cfg.trainer.device = "cuda"
    worker = ActorRolloutRefWorker(cfg.resolve().actor_rollout_ref, role="actor_rollout", device="cuda")
    worker.init_model()
    seen = {}
    layer = worker.module.model.layers[0].mlp.up_proj
    hook = layer.register_forward_hook(lambda m, i, o: seen.setdefault("compute", o.dtype))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (8, 96), generator=gen)
    ones = torch.ones_like(ids)
    data = DataProto.from_dict({
        "input_ids": ids, "attention_mask": ones, "position_ids": torch.arange(96).expand(8, -1),
        "responses": ids[:, 64:], "response_mask": ones[:, 64:],
        "old_log_probs": torch.zeros(8, 32), "advantages": torch.randn(8, 32, generator=gen),
    })
    metrics = worker.update_actor(data).meta_info["metrics"]
    hook.remove()
    param = next(worker.module.parameters())
    return {
        "sharded": is_sharded(worker.module),
        "param_device": param.to_local().device.type,
        "master_dtype": str(param.dtype),
        "compute_dtype": str(seen["compute"]),
        "grad_norm": metrics["actor/grad_norm"][0],
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


plain, offloaded = run(False), run(True)
print("without offload:", plain)
print("with offload:   ", offloaded)
assert plain["sharded"] and offloaded["sharded"], "fsdp2 on one GPU must stay wrapped"
assert plain["master_dtype"] == "torch.float32" and plain["compute_dtype"] == "torch.bfloat16"
assert offloaded["param_device"] == "cpu" and plain["param_device"] == "cuda"
assert offloaded["peak_gpu_mib"] < 0.7 * plain["peak_gpu_mib"], "offload must lower the GPU peak"
assert torch.isfinite(torch.tensor([plain["grad_norm"], offloaded["grad_norm"]])).all()
print("OK: single-GPU FSDP2 keeps mixed precision and offload")
PY
