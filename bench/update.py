"""The actor update alone at the demo's shape, row by row, padding-free (``use_remove_padding``), with the
shared-prompt forward and with token-budget micro-batches, on the same rollout batch, alternating variants so
machine load hits them alike.

    .venv/bin/python bench/update.py [--model default] [--prompts 8] [--n 4] [--new-tokens 16] [--repeats 2]

Each variant runs ``update_actor`` (GRPO loss, AdamW step) over one batch of ``prompts x n`` sampled rows
with the demo's 8-row micro-batches; prints the median seconds and the speed-up over the row-by-row path,
and writes JSON. Compare ratios, not seconds, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hybridflow.algorithms import compute_advantage
from hybridflow.commands.demo import DEMO_SETTINGS
from hybridflow.config.schema import load_config
from hybridflow.data import RLHFDataset, collate_fn
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import resolve_model_path
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.row_layouts import RowLayout

# name -> (share_prompt_prefix, use_remove_padding, use_dynamic_bsz)
VARIANTS = {
    "row by row (before)": (False, False, False),
    "padding-free rows": (False, True, False),
    "shared prompt": (True, False, False),
    "shared prompt + token budget": (True, False, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--reverse", action="store_true", help="run the variants in reverse order")
    parser.add_argument("--max-token-len", type=int, default=4096, help="token budget of the last variant")
    parser.add_argument("--out", default="bench/results/update.json")
    args = parser.parse_args()

    data_dir = Path(args.out).parent / "update-data"
    prepare_data(["arithmetic", str(data_dir), "--train-size", str(args.prompts), "--test-size", "1"])
    cfg = load_config(
        [
            *DEMO_SETTINGS,
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={resolve_model_path(args.model)}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"data.max_response_length={args.new_tokens}",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_token_len}",
            f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        ]
    )
    arr = cfg.resolve().actor_rollout_ref
    group = LocalWorkerGroup(
        ClassWithInitArgs(ActorRolloutRefWorker, arr, role="actor_rollout", response_length=args.new_tokens)
    )
    group.init_model()
    worker = group.workers[0]
    dataset = RLHFDataset(str(data_dir / "train.parquet"), worker.tokenizer, max_prompt_length=256)
    prompts = collate_fn([dataset[i] for i in range(args.prompts)])
    prompts.meta_info["n"] = args.n
    batch = group.generate_sequences(prompts)
    batch.batch["token_level_rewards"] = torch.zeros_like(batch.batch["rollout_log_probs"])
    batch.batch["token_level_rewards"][:, 0] = torch.rand(
        len(batch), generator=torch.Generator().manual_seed(0)
    )
    batch = compute_advantage(batch, "grpo")

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, (share, flat, dynamic) in (reversed if args.reverse else list)(VARIANTS.items()):
            arr.model.share_prompt_prefix, arr.actor.use_dynamic_bsz = share, dynamic
            worker.rows = RowLayout.of(worker.policy, share, flat, "actor_rollout_ref.model")
            start = time.perf_counter()
            group.update_actor(batch)
            times[name].append(time.perf_counter() - start)
            print(f"{name}: {times[name][-1]:.1f} s", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["row by row (before)"]
    width = batch.batch["input_ids"].shape[1] - args.new_tokens
    print(
        f"update_actor on {len(batch)} rows ({args.prompts} prompts x {args.n}), prompt width {width}, "
        f"{args.new_tokens} new tokens, micro-batch {arr.actor.ppo_micro_batch_size_per_gpu} rows, median of "
        f"{args.repeats}, torch threads {torch.get_num_threads()}"
    )
    print(f"| {'variant':<30} | {'seconds':>8} | {'speed-up':>8} |\n|{'-' * 32}|{'-' * 10}|{'-' * 10}|")
    for name, seconds in medians.items():
        print(f"| {name:<30} | {seconds:8.2f} | {base / seconds:7.2f}x |")
    Path(args.out).write_text(
        json.dumps(
            {
                "rows": len(batch),
                "prompt_width": width,
                "new_tokens": args.new_tokens,
                "times_s": times,
                "median_s": medians,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
