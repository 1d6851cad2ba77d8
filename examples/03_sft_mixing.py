"""SFT data mixed into RL: every 2nd actor update adds a supervised loss on demonstrations.

The demonstrations are (prompt, response) pairs; the actor adds ``loss_coef`` x their negative
log-likelihood, masked to the response tokens, to the PPO loss of the same optimiser steps, and logs it
as ``actor/sft_loss``. Nothing is faked: no made-up rewards or log-probs, just one more loss term.

    python examples/03_sft_mixing.py [OUT_DIR]
"""

import json
from pathlib import Path

from _setup import logged, run, tiny_config

from hybridflow.trainer import PPOTrainer

PAIRS = [(12, 34), (25, 51), (40, 17), (63, 22)]


def main(out_dir: Path) -> dict:
    demos = Path(out_dir) / "demos.jsonl"
    demos.parent.mkdir(parents=True, exist_ok=True)
    demos.write_text(
        "".join(
            json.dumps({"prompt": f"Compute {a}+{b}.", "response": f"{a}+{b}={a + b}"}) + "\n"
            for a, b in PAIRS
        )
    )
    trainer = PPOTrainer(
        tiny_config(
            out_dir,
            f"data.sft.files=[{demos}]",
            "data.sft.every_n_steps=2",
            "data.sft.batch_size=4",
            "data.sft.loss_coef=1.0",
            steps=6,
        )
    )
    trainer.fit()
    sft_loss = {row["step"]: row["actor/sft_loss"] for row in logged(out_dir) if "actor/sft_loss" in row}
    print(
        "actor/sft_loss at the steps that mixed in demonstrations:",
        ", ".join(f"step {step}: {loss:.3f}" for step, loss in sft_loss.items()),
    )
    return {"sft_loss": sft_loss, "steps": [row["step"] for row in logged(out_dir)]}


if __name__ == "__main__":
    run(main)
