"""Replay buffer: every actor update also trains on past rollouts, sampled uniformly at first, then by
priority (mean |advantage|, re-scored after each replay) with a rising alpha.

Replayed rows keep the log-probs of the policy that generated them, so PPO's ratio accounts for the
policy having moved since; their importance-sampling weights scale their advantages.

    python examples/02_replay_buffer.py [OUT_DIR]
"""

from pathlib import Path

import numpy as np
from _setup import logged, run, tiny_config

from hybridflow.trainer import PPOTrainer
from hybridflow.trainer.replay import advantage_priorities

# until_step counts the steps done before an update: logged steps 1-2 sample uniformly, steps 3-4 by priority
# with alpha 0.4, later ones with the top-level strategy and alpha (priority, 0.8).
SCHEDULE = "[{until_step: 2, strategy: uniform}, {until_step: 4, strategy: priority, alpha: 0.4}]"


def main(out_dir: Path) -> dict:
    trainer = PPOTrainer(
        tiny_config(
            out_dir,
            "replay_buffer.enable=true",
            "replay_buffer.capacity=32",
            "replay_buffer.sample_size=4",
            f"replay_buffer.schedule={SCHEDULE}",
            "replay_buffer.strategy=priority",
            "replay_buffer.alpha=0.8",
            steps=6,
        )
    )
    trainer.fit()
    rows = logged(out_dir)
    for row in rows:
        kind = f"priority, alpha {row['replay/alpha']}" if row["replay/prioritized"] else "uniform"
        weight = f", mean IS weight {row['replay/is_weight_mean']:.2f}" if row["replay/rows"] else ""
        print(
            f"step {row['step']}: {row['replay/rows']} replayed rows ({kind}){weight}, "
            f"buffer {row['replay/buffer_size']}"
        )
    # A row that was never replayed still has its priority from when it was stored: mean |advantage|.
    buffer = trainer.replay.buffer
    stored = advantage_priorities(buffer.state_dict()["rows"])
    rescored = int(np.sum(~np.isclose(buffer.priorities, stored)))
    print(f"{rescored} of {len(buffer)} buffered rows were re-scored after being replayed")
    return {"rows": rows, "rescored": rescored, "buffer_size": len(buffer)}


if __name__ == "__main__":
    run(main)
