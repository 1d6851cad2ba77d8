"""What training teaches a tiny vision-language model on the visual task: SFT on blank pictures teaches the
answer's form (a colour word, then the end of the turn) without what the picture shows; GRPO on the real
pictures then raises the held-out reward, which only reading the picture can do."""

import json

import pytest

from hybridflow.config.offline import SFTConfig, load_offline_config
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.offline import OfflineTrainer

COLOURS = ["red", "blue"]


@pytest.mark.learning
def test_sft_teaches_the_form_then_grpo_raises_the_held_out_reward(tiny_vlm, tmp_path):
    prepare_data(
        [
            "shapes",
            str(tmp_path / "rl"),
            "--colours",
            ",".join(COLOURS),
            "--train-size",
            "160",
            "--test-size",
            "32",
        ]
    )
    # the form only: blank pictures, each answered with a random colour
    form = ["--format", "form", "--colours", ",".join(COLOURS), "--train-size", "32", "--test-size", "1"]
    prepare_data(["shapes", str(tmp_path / "sft"), *form])
    sft = load_offline_config(
        SFTConfig,
        [
            f"data.train_files={tmp_path / 'sft' / 'train.parquet'}",
            f"model.partial_pretrain={tiny_vlm('qwen2_vl')}",
            f"trainer.default_local_dir={tmp_path / 'sft_run'}",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=8",
            "data.max_length=64",
            "optim.lr=5e-3",
            "trainer.total_training_steps=32",
            "trainer.logger=[file]",
        ],
    )
    with OfflineTrainer(sft) as trainer:
        trainer.fit()
    grpo = load_config(
        [
            f"data.train_files={tmp_path / 'rl' / 'train.parquet'}",
            f"data.val_files={tmp_path / 'rl' / 'test.parquet'}",
            f"actor_rollout_ref.model.path={tmp_path / 'sft_run' / 'global_step_32' / 'actor' / 'huggingface'}",
            f"trainer.default_local_dir={tmp_path / 'grpo'}",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=8",
            "data.max_prompt_length=64",
            "data.max_response_length=3",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
            "actor_rollout_ref.actor.optim.lr=2e-3",
            "trainer.total_training_steps=60",
            "trainer.test_freq=60",
            "trainer.logger=[file]",
        ]
    )
    PPOTrainer(grpo).fit()
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    held_out = {r["step"]: r["val/shapes/reward/mean@1"] for r in rows if "val/shapes/reward/mean@1" in r}
    # measured (make test-portable): 0.5-0.57 before (greedy: one colour for every picture), 0.84-1.0 after 50
    # steps under the CPU's own, AVX2 and default kernels at 1 and 2 threads
    assert held_out[0] <= 0.75
    assert held_out[60] >= max(0.75, held_out[0] + 0.2), held_out
