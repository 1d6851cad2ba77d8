"""A GRPO step with image rows against the same rows without their images, and where the time goes.

    .venv/bin/python bench/vision.py [--family qwen2_vl] [--hidden 256] [--layers 4] [--image-size 224]
        [--prompts 8] [--n 4] [--new-tokens 16] [--steps 4] [--repeats 2]

Both variants train a tiny random vision-language model of ``--family`` (``make_tiny_vlm``, widened to
``--hidden`` and ``--layers``) with GRPO on the ``shapes`` task (``--image-size`` pixels a side: 224 is 256
patches of 14 pixels, 64 image tokens after Qwen's 2x2 merge); the text variant is the same rows with the
``<image>`` placeholder and the images column removed. Each variant runs in a process of its own (its peak
memory is its own), alternating so that machine load hits them alike; the first step of each run is a
warm-up and left out. Prints the median seconds per step and per stage: the vision encoder's forward (in
every pass: rollout, log-probs, update), the rollout's prefill and decode, the old log-probs and the update;
tokens per step, and the peak resident memory. Writes JSON. Compare ratios, not seconds, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

VARIANTS = ("images", "text only")
STAGES = ("step", "gen", "prefill", "decode", "vision", "old_log_prob", "update_actor")


def _timed(cls: type, name: str, totals: dict[str, float], key: str) -> None:
    """Add the seconds every call of ``cls.name`` takes to ``totals[key]``."""
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(cls, name, wrapper)


def _vision_tower_class(folder: str) -> type:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    family = next(m for name, m in model.named_modules() if name.endswith(("visual", "vision_tower")))
    return type(family)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's run in this process: per-step stage seconds (warm-up step dropped) and peak memory."""
    from hybridflow.trainer import PPOTrainer, load_config
    from hybridflow.workers.rollout import HFRollout

    per_step: list[dict[str, float]] = []
    totals: dict[str, float] = {}
    _timed(HFRollout, "_prefill", totals, "prefill")
    _timed(_vision_tower_class(args.model_dir), "forward", totals, "vision")
    data = Path(args.data_dir) / ("images" if args.child == "images" else "text")
    config = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"actor_rollout_ref.model.path={args.model_dir}",
            f"trainer.default_local_dir={Path(args.data_dir) / 'runs' / args.child.replace(' ', '_')}",
            "algorithm.adv_estimator=grpo",
            f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"data.max_response_length={args.new_tokens}",
            "data.max_prompt_length=512",
            f"trainer.total_training_steps={args.steps}",
            "trainer.save_freq=-1",
            "trainer.logger=[file]",
            "trainer.resume_mode=disable",
        ]
    )
    trainer = PPOTrainer(config)
    trainer.register_hook("on_step_end", lambda *_, **__: per_step.append(dict(totals)) or totals.clear())
    trainer.fit()
    metrics = [
        json.loads(line)
        for line in (Path(config.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [m for m in metrics if "timing_s/step" in m][1:]
    hooks = per_step[1:]
    row: dict[str, Any] = {}
    for stage in ("step", "gen", "old_log_prob", "update_actor"):
        row[stage] = statistics.median(m.get(f"timing_s/{stage}", 0.0) for m in steps)
    for stage in ("prefill", "vision"):
        row[stage] = statistics.median(h.get(stage, 0.0) for h in hooks)
    row["decode"] = row["gen"] - row["prefill"]
    row["tokens"] = statistics.median(m["perf/total_num_tokens"] for m in steps)
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def prepare(args: argparse.Namespace, root: Path) -> tuple[str, Path]:
    """The widened tiny model and both variants' data."""
    from hybridflow.data.prepare import main as prepare_data
    from hybridflow.models.tiny import make_tiny_vlm

    model = make_tiny_vlm(root / "model", args.family, args.hidden, args.layers)
    _widen_image_processor(Path(model), args.image_size)
    prepare_data(
        ["shapes", str(root / "images"), "--train-size", str(args.prompts * args.steps), "--test-size", "1"]
        + ["--image-size", str(args.image_size)]
    )
    rows = pq.read_table(root / "images" / "train.parquet").to_pylist()
    for row in rows:
        row["prompt"] = [{**m, "content": m["content"].replace("<image>", "")} for m in row["prompt"]]
        row.pop("images")
    (root / "text").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "text" / "train.parquet")
    return model, root


def _widen_image_processor(folder: Path, size: int) -> None:
    """Let the tiny model's image processor keep pictures up to ``size`` pixels a side (its default caps
    them at 112)."""
    path = folder / "preprocessor_config.json"
    config = json.loads(path.read_text())
    if "longest_edge" in config.get("size", {}):  # Qwen's: a pixel budget
        config["size"]["longest_edge"] = size * size
    path.write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench/results/vision.json")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    root = Path(args.out).parent / "vision-bench"
    model, data = prepare(args, root)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            shape = [
                "--prompts",
                args.prompts,
                "--n",
                args.n,
                "--new-tokens",
                args.new_tokens,
                "--steps",
                args.steps,
            ]
            cmd = [sys.executable, __file__, *map(str, shape), "--child", variant]
            cmd += ["--model-dir", model, "--data-dir", str(data)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    print(f"{'variant':<10} " + " ".join(f"{s:>12}" for s in STAGES) + f" {'tokens':>8} {'peak MB':>8}")
    for variant, row in table.items():
        cells = " ".join(f"{row[s]:>12.3f}" for s in STAGES)
        print(f"{variant:<10} {cells} {row['tokens']:>8.0f} {row['peak_rss_mb']:>8.0f}")
    ratio = table["images"]["step"] / max(table["text only"]["step"], 1e-9)
    print(f"a step with images takes {ratio:.2f}x the text-only step")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs, "median": table}, indent=2))


if __name__ == "__main__":
    main()
