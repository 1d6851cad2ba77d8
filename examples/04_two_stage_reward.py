"""Two-stage reward: a cheap check scores every sample; only the best 30 % of each prompt's samples go
to the expensive judge (a reward model, a sandbox, an API call); the rest keep the cheap score, scaled.

Logged per step: ``reward/stage1_calls``, ``reward/stage2_calls``, ``reward/stage2_fraction``. The
config route does the same with the rule scorer and the reward model worker:
``reward_model.enable=true reward_model.two_stage.enable=true reward_model.two_stage.top_k_ratio=0.3``.

    python examples/04_two_stage_reward.py [OUT_DIR]
"""

from collections import Counter
from pathlib import Path

from _setup import digit_share, logged, run, tiny_config
from transformers import AutoTokenizer

from hybridflow.dataflow import TwoStageReward
from hybridflow.rewards import RewardManager
from hybridflow.trainer import PPOTrainer
from hybridflow.trainer.two_stage_reward import TwoStageRewardFn, sequence_scores

calls: Counter = Counter()


def quick_check(data_source, text, ground_truth, extra_info=None) -> float:
    calls["cheap"] += 1
    return digit_share(data_source, text, ground_truth)


def careful_judge(data_source, text, ground_truth, extra_info=None) -> float:
    calls["expensive"] += (
        1  # stands in for something slow and stricter: the reply should start with the number
    )
    return 0.5 * digit_share(data_source, text, ground_truth) + 0.5 * float(text[:1].isdigit())


def main(out_dir: Path) -> dict:
    calls.clear()
    config = tiny_config(
        out_dir,
        "actor_rollout_ref.rollout.n=10",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20",
        steps=3,
    )
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    two_stage = TwoStageReward(
        sequence_scores(RewardManager(tokenizer, quick_check)),
        sequence_scores(RewardManager(tokenizer, careful_judge)),
        top_k_ratio=0.3,
        unselected="scale",
        unselected_scale=0.5,
    )  # unjudged: half the cheap score
    trainer = PPOTrainer(config, reward_fn=TwoStageRewardFn(two_stage))
    scored = []
    trainer.register_hook("after_reward", lambda trainer, step, metrics, batch: scored.append(batch))
    trainer.fit()
    group = scored[0][:10]  # the first prompt's 10 samples at step 1
    print("step 1, first prompt: cheap score -> final score")
    for cheap, final, judged in zip(
        group.non_tensor_batch["reward_extra/stage1_score"],
        group.batch["token_level_scores"].sum(-1).tolist(),
        group.non_tensor_batch["reward_extra/stage2_selected"],
    ):
        print(f"  {cheap:.2f} -> {final:.2f}" + ("  (judged)" if judged else ""))
    stage2 = sum(row["reward/stage2_calls"] for row in logged(out_dir))
    print(
        f"cheap check: {calls['cheap']} calls; expensive judge: {calls['expensive']} calls instead of "
        f"{calls['cheap']} ({1 - calls['expensive'] / calls['cheap']:.0%} fewer); logged stage-2 calls {stage2}"
    )
    return {"calls": dict(calls), "logged_stage2_calls": stage2, "batches": scored, "tokenizer": tokenizer}


if __name__ == "__main__":
    run(main)
