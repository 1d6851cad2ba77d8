"""The classic RLHF pipeline: SFT, then a reward model trained on preference pairs, then GRPO against it.

1. SFT on demonstrations of the arithmetic task (``hybridflow prepare-data arithmetic --format sft``).
2. A reward model (``hybridflow rm``) on pairs "correct reply over a near miss" (``--format dpo``), started
   from the SFT model with a fresh score head; its held-out pair accuracy is ``val/rewards/accuracies``.
3. GRPO from the SFT model, rewarded by that reward model only (``reward_model.enable=true``,
   ``reward_model.model.path=<its checkpoint's reward_model/huggingface>``); the policy is judged on the
   held-out problems by the rule (``val/arithmetic/acc/mean@1``, greedy) before and after.
The command-line equivalent: ``hybridflow sft ...``, ``hybridflow rm model.partial_pretrain=<SFT folder> ...``,
``hybridflow train actor_rollout_ref.model.path=<SFT folder> reward_model.enable=true
reward_model.model.path=<RM folder> ...``.

    python examples/11_sft_rm_ppo.py [OUT_DIR] [--model tiny|default] [--rm-steps N] [--rm-lr LR] [--steps N]
        [--seed S]
"""

import argparse
import json
import sys
from pathlib import Path

from _setup import tiny_config

from hybridflow.config.offline import RMConfig, SFTConfig, load_offline_config
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer import PPOTrainer
from hybridflow.trainer.offline import OfflineTrainer

ACC = "val/arithmetic/acc/mean@1"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def offline(cls: type, out: Path, model: str | Path, steps: int, *overrides: str) -> tuple[Path, list[dict]]:
    """``steps`` steps of an offline trainer on the arithmetic data in its format; its model folder and rows."""
    kind = "dpo" if cls is RMConfig else cls.kind
    run_dir = out / f"run_{cls.kind}"
    config = load_offline_config(
        cls,
        [
            f"data.train_files={out / kind / 'train.parquet'}",
            f"data.val_files={out / kind / 'test.parquet'}",
            f"model.partial_pretrain={model}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.resume_mode=disable",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.logger=[file]",
            "data.max_length=256",
            *overrides,
        ],
    )
    with OfflineTrainer(config) as trainer:
        trainer.fit()
    folder = "reward_model" if cls is RMConfig else "actor"
    return run_dir / f"global_step_{steps}" / folder / "huggingface", rows(run_dir)


def main(
    out_dir: Path,
    model: str = "tiny",
    rm_steps: int = 4,
    steps: int = 2,
    seed: int = 0,
    rm_lr: float | None = None,
) -> dict:
    out, tiny = Path(out_dir), model == "tiny"
    sizes = (
        ["--train-size", "32", "--test-size", "8"] if tiny else ["--train-size", "512", "--test-size", "64"]
    )
    for kind in ("sft", "dpo"):
        if not (out / kind / "train.parquet").exists():
            prepare_data(["arithmetic", str(out / kind), "--format", kind, "--rejected", "rule", *sizes])
    if not (out / "rl" / "train.parquet").exists():
        prepare_data(["arithmetic", str(out / "rl"), *sizes])
    tiny_config(out)  # the tiny model (unused with --model default)
    start = out / "model" if tiny else "default"
    lr = ["optim.lr=2e-3"] if tiny else ["optim.lr=1e-5"]
    sft_model, sft_rows = offline(SFTConfig, out, start, 4, *lr, "data.train_batch_size=8")
    rm_lr = rm_lr or (1e-3 if tiny else 1e-5)
    rm_model, rm_rows = offline(
        RMConfig, out, sft_model, rm_steps, f"optim.lr={rm_lr}", "data.train_batch_size=8"
    )
    grpo = tiny_config(
        out,
        f"data.train_files={out / 'rl' / 'train.parquet'}",
        f"data.val_files={out / 'rl' / 'test.parquet'}",
        f"actor_rollout_ref.model.path={sft_model}",
        "custom_reward_function.path=null",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_model}",
        "trainer.val_before_train=true",
        f"trainer.test_freq={steps}",
        f"trainer.seed={seed}",
        "data.max_prompt_length=128",
        "data.max_response_length=16",
        *(
            []
            if tiny
            else [
                "data.train_batch_size=8",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.rollout.temperature=0.7",
                "actor_rollout_ref.rollout.top_k=50",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                "actor_rollout_ref.actor.optim.lr=1e-5",
                "reward_model.micro_batch_size_per_gpu=16",
            ]
        ),
        steps=steps,
    )
    with PPOTrainer(grpo) as trainer:
        trainer.fit()
    grpo_rows = rows(out / "run")
    accuracy = [(r["step"], r[ACC]) for r in grpo_rows if ACC in r]
    pair_accuracy = [r["val/rewards/accuracies"] for r in rm_rows if "val/rewards/accuracies" in r]
    print(
        f"reward model held-out pair accuracy {pair_accuracy[0]:.0%} -> {pair_accuracy[-1]:.0%}; policy held-out "
        f"accuracy by the rule {accuracy[0][1]:.0%} -> {accuracy[-1][1]:.0%} (GRPO against the reward model)"
    )
    return {"sft": sft_rows, "rm": rm_rows, "grpo": grpo_rows, "rm_model": rm_model, "accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--rm-steps", type=int, default=4)
    parser.add_argument(
        "--rm-lr", type=float, default=None, help="the reward model's lr (tiny 1e-3, default 1e-5)"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1 if args.model == "tiny" else 2)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="hybridflow-example-"))
    main(out, args.model, args.rm_steps, args.steps, args.seed, args.rm_lr)
    print(f"run folder: {out / 'run'}", file=sys.stderr)
