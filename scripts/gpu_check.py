"""hybridflow's GPU paths in one command, within 10 minutes on one GPU, into one JSON: run it first on any machine
that has a GPU, so the README's GPU figures come from this code.

    python scripts/gpu_check.py [--out bench/results/gpu_check.json] [--budget-s 600] [--stages a,b,...]

From the repository root, in an environment with hybridflow and a CUDA build of torch (``pip install -e .``;
``pip install vllm`` as well for the vLLM stage, which is skipped when ``vllm`` does not import). The stages,
in order, each in a process of its own under a time limit, so one that fails or hangs costs only its own time:

- ``environment``: torch, CUDA and the GPUs.
- ``fsdp_single``: FSDP2 on one GPU stays wrapped, computes in bf16 over fp32 master weights, and with
  ``param_offload`` / ``optimizer_offload`` keeps them in host memory with a lower GPU peak.
- ``vllm``: ``tests/vllm_engine`` on the GPU at tensor parallel size 1 (greedy vLLM equals greedy ``generate``,
  the update reaching the engine, GRPO learning with vLLM, sleep mode).
- ``rollout``: ``bench/rollout.py`` on the GPU, 8 prompts x 4 samples x 16 tokens and 64 x 8 x 128.
- ``weight_sync``: ``bench/weight_sync.py`` over nccl with 2 GPUs or more (one rank per GPU: nccl refuses two on
  one); on one GPU the sender's share of a sync instead (the embedded model's weights cut into buckets and
  checksummed on the GPU, against a device memcpy of the same bytes).
- ``async``: ``bench/async.py``'s three modes, smaller than on CPU's full run (4 steps of 16 prompts x 4 samples,
  up to 128 tokens; on one GPU the asynchronous modes run as threads of one process, the local backend).

This replaces ``scripts/gpu_check_fsdp_single.sh``, ``bench/gpu_vllm_check.sh`` and
``bench/gpu_async_check.sh`` (they now run their stages of it). The JSON is rewritten after each stage, so a
killed run keeps what finished: per stage its status (``ok``, ``failed``, ``timeout``, ``skipped`` with why), its
seconds, the tail of its output and the results its bench wrote. Exit status 0 when no stage failed (1 on a
machine without CUDA, where every stage but the environment is skipped).

It has not run on a GPU yet: written and checked by reading; its argument parsing, time budget, stage runner
and JSON report are tested on CPU (``tests/scripts/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_CHARS = 4000
MIN_STAGE_S = 15  # a stage left less than this is skipped: it could not finish


@dataclass(frozen=True)
class Stage:
    """A stage: ``limit_s`` its share of the budget; ``command(ctx)`` the process to run, or a reason to
    skip (a string); ``results`` the JSON file it writes, read into the report."""

    name: str
    limit_s: int
    command: Callable[[dict], list[str] | str]
    results: str | None = None


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _vllm(ctx: dict) -> list[str] | str:
    if not ctx["vllm"]:
        return "vllm does not import here (pip install vllm)"
    return _python("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_engine", "--durations=5")


def _child(name: str, results: str | None = None) -> Callable[[dict], list[str]]:
    """A stage run by this script in a process of its own (``--child``), writing ``results`` in the work folder."""

    def command(ctx: dict) -> list[str]:
        return _python(
            __file__, "--child", name, "--child-out", str(ctx["work"] / (results or f"{name}.json"))
        )

    return command


def _weight_sync(ctx: dict) -> list[str]:
    out = str(ctx["work"] / "weight_sync.json")
    if ctx["gpus"] >= 2:
        return _python(
            "bench/weight_sync.py", "--device", "cuda", "--ranks", "1", "--random-model", "", "--out", out
        )
    return _child("weight_sync_one_gpu", "weight_sync.json")(ctx)


def _async(ctx: dict) -> list[str]:
    sets = [
        "trainer.device=cuda",
        "data.train_batch_size=16",
        "data.max_response_length=128",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
    ]
    backend = ["--async-backend", "ray"] if ctx["gpus"] >= 2 else ["--async-backend", "local"]
    if ctx["gpus"] >= 2:
        sets += ["trainer.backend=ray", "trainer.placement=split", "+trainer.role_pools.reward=actor"]
    return _python(
        "bench/async.py", "--steps", "4", "--samples-per-step", "64", "--test-size", "16", "--threads", "4,4",
        *backend, *[f"--set={s}" for s in sets], "--work", str(ctx["work"] / "async"),
        "--out", str(ctx["work"] / "async.json"),
    )  # fmt: skip


STAGES = [
    Stage("environment", 20, _child("environment"), "environment.json"),
    Stage("fsdp_single", 60, _child("fsdp_single"), "fsdp_single.json"),
    Stage("vllm", 170, _vllm),
    Stage("rollout", 90, _child("rollout"), "rollout.json"),
    Stage("weight_sync", 90, _weight_sync, "weight_sync.json"),
    Stage("async", 170, _async, "async.json"),
]
NAMES = [stage.name for stage in STAGES]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/results/gpu_check.json", help="the one JSON of results")
    parser.add_argument("--budget-s", type=float, default=600.0, help="seconds for every stage together")
    parser.add_argument("--stages", default=",".join(NAMES), help=f"comma-separated, of: {', '.join(NAMES)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one in-process check (a stage's process)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wanted = [name for name in args.stages.split(",") if name]
    unknown = [name for name in wanted if name not in NAMES]
    if unknown or not wanted:
        parser.error(
            f"--stages: unknown stage(s) {unknown or args.stages!r}; the stages are {', '.join(NAMES)}"
        )
    args.stages = [name for name in NAMES if name in wanted]  # always in the order they build on each other
    return args


def stage_timeout(limit_s: float, remaining_s: float) -> float | None:
    """The time a stage gets: its limit, or what is left of the budget if less; None when that is too little."""
    timeout = min(limit_s, remaining_s)
    return timeout if timeout >= MIN_STAGE_S else None


def run_stage(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run ``command`` from the repository root; its status, seconds, exit code and the tail of its output."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as expired:
        output = (
            (expired.stdout or b"").decode(errors="replace")
            if isinstance(expired.stdout, bytes)
            else (expired.stdout or "")
        )
        return {"status": "timeout", "seconds": time.perf_counter() - start, "tail": output[-TAIL_CHARS:]}
    output = done.stdout + done.stderr
    return {
        "status": "ok" if done.returncode == 0 else "failed",
        "seconds": time.perf_counter() - start,
        "returncode": done.returncode,
        "tail": output[-TAIL_CHARS:],
    }


def write_report(path: Path, report: dict) -> None:
    """The report as JSON, replaced whole (written beside it, then renamed: a kill never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=2, default=str))
    temporary.replace(path)


def _context(work: Path) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "cuda": cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "vllm": importlib.util.find_spec("vllm") is not None,
        "work": work,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return CHILDREN[args.child](args.child_out)
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="hf-gpu-check-"))
    ctx = _context(work)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget_s, "stages": {}}
    report.update({key: value for key, value in ctx.items() if key != "work"})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDFLOW_TEST_VLLM_TP": "1"}
    deadline = time.monotonic() + args.budget_s
    for stage in (s for s in STAGES if s.name in args.stages):
        result = _run(stage, ctx, deadline, env)
        if stage.results and (work / stage.results).exists():
            result["results"] = json.loads((work / stage.results).read_text())
        report["stages"][stage.name] = result
        write_report(out, report)
        print(
            f"{stage.name}: {result['status']} ({result.get('seconds', 0):.0f} s) {result.get('why', '')}",
            flush=True,
        )
    report["seconds"] = args.budget_s - max(0.0, deadline - time.monotonic())
    write_report(out, report)
    print(f"wrote {out}")
    if not ctx["cuda"]:
        print("no CUDA device here: nothing but the environment was checked")
        return 1
    return 1 if any(r["status"] in ("failed", "timeout") for r in report["stages"].values()) else 0


def _run(stage: Stage, ctx: dict, deadline: float, env: dict[str, str]) -> dict:
    if not ctx["cuda"] and stage.name != "environment":
        return {"status": "skipped", "why": "no CUDA device (torch.cuda.is_available() is false)"}
    timeout = stage_timeout(stage.limit_s, deadline - time.monotonic())
    if timeout is None:
        return {"status": "skipped", "why": "out of time: the budget is spent"}
    command = stage.command(ctx)
    if isinstance(command, str):
        return {"status": "skipped", "why": command}
    return run_stage(command, timeout, env)


# ---------------------------------------------------------------------------- checks run in a stage's process
def _environment(out: str) -> int:
    import torch

    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    result = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [{"name": g.name, "memory_gib": round(g.total_memory / 2**30, 1)} for g in gpus],
    }
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


def _rollout(out: str) -> int:
    """``bench/rollout.py`` on the GPU at two shapes (prompts, samples, new tokens), its results merged."""
    results = {}
    for prompts, n, tokens in (("8", "4", "16"), ("64", "8", "128")):
        path = Path(out).with_name(f"rollout-{prompts}x{n}x{tokens}.json")
        command = [
            "bench/rollout.py",
            "--device",
            "cuda",
            "--prompts",
            prompts,
            "--n",
            n,
            "--new-tokens",
            tokens,
        ]
        subprocess.run(_python(*command, "--repeats", "2", "--out", str(path)), cwd=ROOT, check=True)
        results[f"{prompts}x{n}x{tokens}"] = json.loads(path.read_text())
    Path(out).write_text(json.dumps(results, indent=2))
    return 0


def _fsdp_single(out: str) -> int:
    """An fsdp2 actor on one GPU: wrapped, bf16 compute over fp32 master weights, offload lowering the peak."""
    import torch

    from hybridflow.config.schema import PPOConfig
    from hybridflow.models import make_tiny_model
    from hybridflow.protocol import DataProto
    from hybridflow.workers import ActorRolloutRefWorker
    from hybridflow.workers.sharding import is_sharded

    model = make_tiny_model(
        tempfile.mkdtemp() + "/m", vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
        intermediate_size=3072,
    )  # fmt: skip

    def run(offload: bool) -> dict:
        torch.cuda.reset_peak_memory_stats()
        cfg = PPOConfig()
        arr = cfg.actor_rollout_ref
        arr.model.path, arr.actor.strategy = model, "fsdp2"
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
        })  # fmt: skip
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
    Path(out).write_text(json.dumps({"without_offload": plain, "with_offload": offloaded}, indent=2))
    print(json.dumps({"without_offload": plain, "with_offload": offloaded}))
    assert plain["sharded"] and offloaded["sharded"], "fsdp2 on one GPU must stay wrapped"
    assert plain["master_dtype"] == "torch.float32" and plain["compute_dtype"] == "torch.bfloat16"
    assert offloaded["param_device"] == "cpu" and plain["param_device"] == "cuda"
    assert offloaded["peak_gpu_mib"] < 0.7 * plain["peak_gpu_mib"], "offload must lower the GPU peak"
    assert torch.isfinite(torch.tensor([plain["grad_norm"], offloaded["grad_norm"]])).all()
    return 0


def _weight_sync_one_gpu(out: str, device: str = "cuda", model_path: str = "default") -> int:
    """The sender's share of a sync on one GPU: the embedded model's weights copied into 64 MB buckets and
    checksummed (what ``WeightLink.send`` does before a bucket travels), against a device memcpy of the same
    bytes. ``device`` and ``model_path`` let a test run it on the CPU with a tiny model."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "bench"))
    from weight_sync import memcpy_floor

    from hybridflow.models import resolve_model_path
    from hybridflow.workers.weight_link import _buckets
    from hybridflow.workers.weight_sync import policy_weights

    path = resolve_model_path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)

    def new_bucket(index: int, dtype: torch.dtype, count: int) -> torch.Tensor:  # as a link over nccl fills
        return torch.empty(count, dtype=dtype, device=device)

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times, nbytes = [], 0
    for _ in range(3):
        synchronize()
        start, nbytes = time.perf_counter(), 0
        for bucket in _buckets(policy_weights(model), 64 * 2**20, new_bucket):  # copied and checksummed
            nbytes += bucket.flat.numel() * bucket.flat.element_size()
        synchronize()
        times.append(time.perf_counter() - start)
    floor = memcpy_floor(nbytes, 5, device)
    result = {"mb": nbytes / 2**20, "bucket_and_checksum_s": min(times), "memcpy_s": floor}
    result["vs_memcpy"] = result["bucket_and_checksum_s"] / floor
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


CHILDREN = {
    "environment": _environment,
    "fsdp_single": _fsdp_single,
    "rollout": _rollout,
    "weight_sync_one_gpu": _weight_sync_one_gpu,
}


if __name__ == "__main__":
    sys.exit(main())
