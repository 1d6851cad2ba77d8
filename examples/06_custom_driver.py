"""A custom driver: PPO with a critic, written out as a plain loop over the public worker-group calls.

``PPOTrainer.fit()`` is this loop plus logging, validation, hooks and checkpoints. Every line below is
yours to change: another advantage estimator, a filter on the samples, a second reward, a different
update order. The worker groups are the same whether they run in this process or on Ray workers.

    python examples/06_custom_driver.py [OUT_DIR]
"""

import math
from pathlib import Path

from _setup import digit_share, run, tiny_config
from transformers import AutoTokenizer

from hybridflow.algorithms import compute_advantage
from hybridflow.data import PromptLoader, RLHFDataset
from hybridflow.rewards import RewardManager
from hybridflow.trainer.metrics import reduce_metrics
from hybridflow.trainer.worker_groups import build_worker_groups


def main(out_dir: Path, steps: int = 2) -> dict:
    config = tiny_config(out_dir, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    workers = build_worker_groups(config)  # actor + rollout (one model), reference, critic
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    dataset = RLHFDataset(config.data.train_files, tokenizer, max_prompt_length=config.data.max_prompt_length)
    prompts = PromptLoader(dataset, config.data.train_batch_size, seed=0)
    reward = RewardManager(tokenizer, digit_share)
    history = []
    for step, batch in zip(range(1, steps + 1), prompts):
        batch.meta_info["n"] = config.actor_rollout_ref.rollout.n  # samples per prompt
        batch = workers.actor_rollout.generate_sequences(batch)  # prompts + responses, (bs * n, P + L)
        batch.batch["token_level_rewards"] = reward(batch)  # each score on its response's last token
        batch = batch.union(workers.ref.compute_ref_log_prob(batch))  # ref_log_prob, for the KL loss
        batch = batch.union(workers.critic.compute_values(batch))  # values (bs * n, L)
        batch = compute_advantage(batch, "gae", gamma=1.0, lam=0.95)  # advantages and returns
        metrics = reduce_metrics(workers.critic.update_critic(batch).meta_info["metrics"])
        metrics.update(reduce_metrics(workers.actor_rollout.update_actor(batch).meta_info["metrics"]))
        metrics["reward/mean"] = batch.batch["token_level_rewards"].sum(-1).mean().item()
        print(
            f"step {step}: reward {metrics['reward/mean']:.3f}, actor grad norm {metrics['actor/grad_norm']:.3f}, "
            f"kl_loss {metrics['actor/kl_loss']:.5f}, vf_loss {metrics['critic/vf_loss']:.4f}"
        )
        history.append(metrics)
    finite = all(math.isfinite(v) for metrics in history for v in metrics.values())
    return {"history": history, "finite": finite}


if __name__ == "__main__":
    run(main)
