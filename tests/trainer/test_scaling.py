"""Scaling up through the trainer: a LoRA + FSDP2 run on 2 Ray workers (the reference being the adapter-off
actor) checkpoints in a form that resumes on 1 local worker. (LoRA learning: test_ppo_trainer.)"""

import math

import pytest
from test_ppo_trainer import config, logged
from transformers import AutoModelForCausalLM

from hybridflow.trainer import PPOTrainer

# Varies with every character, so the random tiny model's samples get different rewards (GRPO signal).
TEXT_HASH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 7 / 6
"""


def test_fsdp2_lora_run_on_two_ray_workers_resumes_on_one(data_dir, tiny_model_path, tmp_path, ray_session):  # noqa: F811
    (tmp_path / "reward.py").write_text(TEXT_HASH_REWARD)
    common = [
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
    ]
    cfg = config(
        data_dir, tiny_model_path, tmp_path / "two", *common, "trainer.backend=ray", "trainer.n_workers=2"
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    two = [row for row in logged(tmp_path / "two") if "timing_s/step" in row]
    assert [row["step"] for row in two] == [1, 2, 3]
    assert two[2]["actor/kl_loss"] > 0  # the adapter moved the policy away from the (adapter-off) reference
    step2 = tmp_path / "two" / "global_step_2" / "actor"
    assert (step2 / "lora_adapter" / "adapter_model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(step2 / "huggingface")  # merged, consolidated from both ranks

    cfg = config(
        data_dir,
        tiny_model_path,
        tmp_path / "one",
        *common,
        "trainer.n_workers=1",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={step2.parent}",
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    one = [row for row in logged(tmp_path / "one") if "timing_s/step" in row]
    assert [row["step"] for row in one] == [3]
    assert all(math.isfinite(v) for v in one[0].values())
    assert one[0]["actor/lr"] == two[2]["actor/lr"]
    # another rollout on another worker count, from the same weights: the same scale of KL and gradient
    for key in ("actor/kl_loss", "actor/grad_norm"):
        assert one[0][key] == pytest.approx(two[2][key], rel=0.5), key
