"""Rollout speed: hybridflow's HF rollout (each prompt's KV cache computed once, shared by its n samples)
against plain ``generate(num_return_sequences=n)`` on the same prompts, in the same run.

    .venv/bin/python bench/rollout.py [--model default] [--prompts 8] [--n 4] [--new-tokens 16] [--out FILE]

Prints a table and writes JSON; compare the ratio, not the seconds (these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer.config import RolloutConfig
from hybridflow.workers.modeling import load_model, load_tokenizer
from hybridflow.workers.rollout import HFRollout


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model folder, or 'default' for SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/rollout.json")
    args = parser.parse_args()

    data_dir = Path(args.out).parent / "rollout-data"
    prepare_data(["arithmetic", str(data_dir), "--train-size", str(args.prompts), "--test-size", "1"])
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, torch.device("cpu")).eval()
    dataset = RLHFDataset(str(data_dir / "train.parquet"), tokenizer, max_prompt_length=256)
    prompts = collate_fn([dataset[i] for i in range(args.prompts)])
    sampling = RolloutConfig(n=args.n, temperature=0.7)
    rollout = HFRollout(model, tokenizer, sampling, args.new_tokens)

    def plain() -> None:
        with torch.no_grad():
            model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                           do_sample=True, temperature=0.7, max_new_tokens=args.new_tokens,
                           num_return_sequences=args.n, pad_token_id=tokenizer.pad_token_id)

    rows = [("HF generate, num_return_sequences", timed(plain, args.repeats)),
            ("hybridflow HFRollout (shared prompt cache)", timed(lambda: rollout.generate_sequences(prompts),
                                                               args.repeats))]
    width = prompts.batch["input_ids"].shape[1]
    print(f"{args.prompts} prompts x {args.n} samples, prompt width {width}, {args.new_tokens} new tokens, "
          f"median of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"| {'engine':<44} | {'seconds':>8} | {'speed-up':>8} |\n|{'-' * 46}|{'-' * 10}|{'-' * 10}|")
    for name, seconds in rows:
        print(f"| {name:<44} | {seconds:8.2f} | {rows[0][1] / seconds:7.2f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "model": args.model, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
        "prompt_width": width, "results": [{"engine": n, "median_s": s} for n, s in rows]}, indent=2))


if __name__ == "__main__":
    main()
