"""Callbacks: halve the learning rate whenever one update moves the policy too far (``actor/ppo_kl``).

A hook is ``fn(trainer, step, metrics, batch)`` on an event (on_fit_start, on_step_start, after_generate,
after_reward, after_advantage, on_step_end, on_validation_end, on_checkpoint, on_fit_end). It may act:
``trainer.adapt_lr(0.5)`` takes effect from the next update. A hook that raises stops the run with a
``HookError`` naming it.

    python examples/01_callbacks.py [OUT_DIR]
"""

from pathlib import Path

from _setup import logged, run, tiny_config

from hybridflow.trainer import PPOTrainer

KL_LIMIT = 0.005


def main(out_dir: Path) -> dict:
    # Two PPO epochs per step, so the second pass sees how far the first one moved the policy.
    trainer = PPOTrainer(tiny_config(out_dir, "actor_rollout_ref.actor.ppo_epochs=2", steps=5))
    halved_after: list[int] = []

    def halve_lr_when_kl_is_high(trainer, step, metrics, batch):
        kl = abs(metrics["actor/ppo_kl"])
        if kl > KL_LIMIT:
            new_lr = trainer.adapt_lr(0.5)
            halved_after.append(step)
            print(
                f"step {step}: |actor/ppo_kl| {kl:.3f} > {KL_LIMIT}: lr halved {metrics['actor/lr']:g} -> {new_lr:g}"
            )

    trainer.register_hook("on_step_end", halve_lr_when_kl_is_high)
    trainer.fit()
    lr_by_step = {row["step"]: row["actor/lr"] for row in logged(out_dir)}
    print("actor/lr by step:", lr_by_step)
    return {"halved_after": halved_after, "lr_by_step": lr_by_step}


if __name__ == "__main__":
    run(main)
