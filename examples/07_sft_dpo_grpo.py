"""A typical post-training pipeline: SFT, then DPO, then GRPO, each starting from the previous checkpoint.

1. SFT on demonstrations of the arithmetic task (``hybridflow prepare-data arithmetic --format sft``).
2. DPO on pairs "correct reply over a near miss" (``--format dpo``), from the SFT checkpoint; the reference
   policy is that same SFT model, so the first step's loss is ln 2.
3. GRPO on the prompts, from the DPO checkpoint.
Every checkpoint's ``actor/huggingface`` folder is a plain Hugging Face model, so it is simply the next
stage's ``model.partial_pretrain`` (offline trainers) or ``actor_rollout_ref.model.path`` (PPO/GRPO).
The command-line equivalent is ``hybridflow sft ...``, ``hybridflow dpo model.partial_pretrain=...``, then
``hybridflow train actor_rollout_ref.model.path=...``.

    python examples/07_sft_dpo_grpo.py [OUT_DIR]
"""

import json
from pathlib import Path

from _setup import logged, run, tiny_config

from hybridflow.config.offline import DPOConfig, SFTConfig, load_offline_config
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer import PPOTrainer
from hybridflow.trainer.offline import OfflineTrainer


def offline_stage(cls: type, out: Path, model: str | Path, steps: int) -> tuple[Path, list[dict]]:
    """Train ``steps`` steps of an offline trainer from ``model``; returns its checkpoint's model folder and
    the logged rows (the first is the validation before training)."""
    kind = cls.kind
    if not (out / kind / "train.parquet").exists():
        prepare_data(
            ["arithmetic", str(out / kind), "--format", kind, "--train-size", "16", "--test-size", "4"]
        )
    run_dir = out / f"run_{kind}"
    config = load_offline_config(
        cls,
        [
            f"data.train_files={out / kind / 'train.parquet'}",
            f"data.val_files={out / kind / 'train.parquet'}",
            f"model.partial_pretrain={model}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.resume_mode=disable",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=4",
            "data.max_length=128",
            "optim.lr=2e-3",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[file]",
        ],
    )
    with OfflineTrainer(config) as trainer:
        trainer.fit()
    return run_dir / f"global_step_{steps}" / "actor" / "huggingface", [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def main(out_dir: Path) -> dict:
    out = Path(out_dir)
    tiny_config(out)  # makes the tiny model and the prompts in out_dir
    sft_model, sft_rows = offline_stage(SFTConfig, out, out / "model", steps=4)
    dpo_model, dpo_rows = offline_stage(DPOConfig, out, sft_model, steps=4)
    grpo = tiny_config(out, f"actor_rollout_ref.model.path={dpo_model}", steps=2)
    with PPOTrainer(grpo) as trainer:
        trainer.fit()
    print(
        f"SFT validation loss {sft_rows[0]['val/loss']:.3f} -> {sft_rows[-1]['val/loss']:.3f}; "
        f"DPO loss {dpo_rows[0]['val/loss']:.4f} -> {dpo_rows[-1]['val/loss']:.4f} "
        f"(reward margin {dpo_rows[-1]['val/rewards/margins']:.3f}); GRPO from {dpo_model}"
    )
    return {
        "sft": sft_rows,
        "dpo": dpo_rows,
        "sft_model": sft_model,
        "dpo_model": dpo_model,
        "grpo_model_path": grpo.actor_rollout_ref.model.path,
        "grpo": logged(out),
    }


if __name__ == "__main__":
    run(main)
