"""Rollout speed: hybridflow's HF rollout and the vLLM rollout against plain
``generate(num_return_sequences=n)`` on the same prompts, in the same run, and where the time goes.

    .venv/bin/python bench/rollout.py [--model default] [--prompts 8] [--n 4] [--new-tokens 16] [--out FILE]
    .venv-vllm/bin/python bench/rollout.py ...   # adds the vLLM rollout (vLLM's CPU build: make test-vllm)

The engines take turns call by call (a machine whose load changes hits all alike), after one untimed call
each (vLLM's first generation is slower). Tokens/s counts the tokens each engine really generated (up to and
including EOS). The breakdown times the parts of one rollout: the prompt pass as ``generate`` does it (every
prompt ``n`` times) and as hybridflow does it (the prefix all prompts share once, each prompt's remainder
once, the cache copied ``n`` times), and one decoding step at full batch.

Prints tables and writes JSON; compare the ratio, not the seconds (these machines are noisy).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.prepare import main as prepare_data
from hybridflow.rollout import EngineSpec, response_mask_from
from hybridflow.workers.modeling import load_model, load_tokenizer, model_location
from hybridflow.workers.rollout import HFRollout, build_rollout
from hybridflow.workers.rollout.hf_rollout import common_prefix_length


def alternate(engines: dict[str, Callable[[], int]], repeats: int) -> dict[str, tuple[float, int]]:
    """Median seconds and median generated tokens of each engine, calling them in turn."""
    for fn in engines.values():
        fn()  # warm-up
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            start = time.perf_counter()
            tokens = fn()
            runs[name].append((time.perf_counter() - start, tokens))
    return {
        name: (statistics.median(s for s, _ in r), int(statistics.median(t for _, t in r)))
        for name, r in runs.items()
    }


def breakdown(
    model,
    rollout: HFRollout,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    n: int,
    repeats: int,
) -> dict[str, float]:
    """Seconds of the parts of one rollout (median of ``repeats``)."""

    def median(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = len(ids) * n
    with torch.no_grad():
        every = median(
            lambda: rollout._forward(
                ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), positions.repeat_interleave(n, 0)
            )
        )
        shared = median(lambda: rollout._prefill(ids, mask, positions)[1].batch_repeat_interleave(n))
        _, cache, cache_mask = rollout._prefill(ids, mask, positions)
        cache.batch_repeat_interleave(n)
        step_mask = torch.cat(
            [cache_mask.repeat_interleave(n, 0), torch.ones(rows, 1, dtype=mask.dtype)], dim=1
        )
        tokens, step_pos = ids[:, -1:].repeat_interleave(n, 0), positions[:, -1:].repeat_interleave(n, 0) + 1

        def step() -> None:
            rollout._forward(tokens, step_mask, step_pos, cache)
            cache.crop(-1)  # drop the step: the same step each time

        decode = median(step)
    return {
        f"prompt pass, every prompt {n} times ({rows} rows, as generate does)": every,
        "prompt pass, shared prefix once + remainders, cache copied (hybridflow)": shared,
        f"one decoding step, {rows} rows": decode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="default", help="model folder, or 'default' for SmolLM2-135M-Instruct"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda on a GPU machine (bench/gpu_vllm_check.sh)"
    )
    parser.add_argument("--out", default="bench/results/rollout.json")
    args = parser.parse_args()

    data_dir = Path(args.out).parent / "rollout-data"
    prepare_data(["arithmetic", str(data_dir), "--train-size", str(args.prompts), "--test-size", "1"])
    tokenizer = load_tokenizer(args.model)
    device = torch.device(args.device)
    model = load_model(args.model, device).eval()
    dataset = RLHFDataset(str(data_dir / "train.parquet"), tokenizer, max_prompt_length=256)
    prompts = collate_fn([dataset[i] for i in range(args.prompts)])
    sampling = RolloutConfig(n=args.n, temperature=0.7)
    rollout = HFRollout(model, tokenizer, sampling, args.new_tokens)

    ids, mask, positions = (
        prompts.batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")
    )
    eos = torch.tensor(rollout.eos_token_ids)

    def plain() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=0.7,
                max_new_tokens=args.new_tokens,
                num_return_sequences=args.n,
                pad_token_id=tokenizer.pad_token_id,
            )
        return int(response_mask_from(out[:, ids.shape[1] :].cpu(), eos.tolist()).sum())

    engines = {
        "HF generate, num_return_sequences": plain,
        "hybridflow HFRollout": lambda: int(rollout.generate_sequences(prompts).batch["response_mask"].sum()),
    }
    width = ids.shape[1]
    if importlib.util.find_spec("vllm"):
        config = RolloutConfig(name="vllm", n=args.n, temperature=0.7, max_model_len=width + args.new_tokens)
        spec = EngineSpec(config, model, tokenizer, args.new_tokens, model_location(args.model), seed=0)
        engine = build_rollout(spec)
        engines["hybridflow VLLMRollout (vLLM CPU build)"] = lambda: int(
            engine.generate_sequences(prompts).batch["response_mask"].sum()
        )
    rows = [(name, seconds, tokens) for name, (seconds, tokens) in alternate(engines, args.repeats).items()]
    shared = common_prefix_length(ids, mask, positions)
    print(
        f"{args.prompts} prompts x {args.n} samples, prompt width {width} ({shared} tokens shared by all), "
        f"{args.new_tokens} new tokens, median of {args.repeats}, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"| {'engine':<40} | {'seconds':>8} | {'speed-up':>8} | {'tokens':>6} | {'tokens/s':>8} |\n"
        f"|{'-' * 42}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 10}|"
    )
    for name, seconds, tokens in rows:
        print(
            f"| {name:<40} | {seconds:8.2f} | {rows[0][1] / seconds:7.2f}x | {tokens:6d} | "
            f"{tokens / seconds:8.1f} |"
        )
    parts = breakdown(model, rollout, ids, mask, positions, args.n, args.repeats)
    print(f"\n| {'part of one rollout':<64} | {'seconds':>8} |\n|{'-' * 66}|{'-' * 10}|")
    for name, seconds in parts.items():
        print(f"| {name:<64} | {seconds:8.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "model": args.model,
                "device": args.device,
                "prompts": args.prompts,
                "n": args.n,
                "new_tokens": args.new_tokens,
                "prompt_width": width,
                "shared_prefix": shared,
                "load_average": os.getloadavg(),
                "results": [{"engine": n, "median_s": s, "tokens": t} for n, s, t in rows],
                "breakdown_s": parts,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
