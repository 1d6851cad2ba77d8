"""GRPO on code that runs: each response's program is tested in a sandbox of its own.

The task is ``hybridflow prepare-data code``: small one-argument functions (``f(x)`` that returns x plus 7, the
remainder of x divided by 4, the larger of x and 12...), one-shot, five assert tests each, ``data_source``
``code``. Nothing else to configure: the built-in rule scorer of the code sources extracts the fenced program,
runs it with its tests in the ``python`` tool's sandbox (``reward_model.code``: in parallel, per-test and
per-sample limits), and scores 1 when every test passes. Logged per step: ``reward_extra/pass_rate/mean``,
``reward_extra/syntax_error/mean``, ``reward_extra/timeout/mean``, ``reward_extra/sandbox_s/mean`` and
``perf/reward_share`` (the scoring stage's share of the step); held out: ``val/code/acc/mean@1``.

On the tiny model (default) it is first taught the answers to a few training prompts, so that some of its
programs pass; ``--model default`` trains the embedded SmolLM2-135M as it comes (the README's figures).

    python examples/10_code_rewards.py [OUT_DIR] [--model tiny|default] [--steps N] [--seed S]
"""

import argparse
import sys
from pathlib import Path

from _setup import logged, tiny_config

from hybridflow.data import RLHFDataset
from hybridflow.data.code_tasks import function_solution
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models.tiny import teach_conversations
from hybridflow.trainer import PPOTrainer

ACC = "val/code/acc/mean@1"


def main(out_dir: Path, model: str = "tiny", steps: int = 2, seed: int = 0) -> dict:
    out_dir, tiny = Path(out_dir), model == "tiny"
    data = out_dir / ("code_tiny" if tiny else "code")
    if not (data / "train.parquet").exists():  # the tiny run validates on 8 problems, the real one on 64
        held_out = "8" if tiny else "64"
        prepare_data(["code", str(data), "--train-size", "128", "--test-size", held_out, "--seed", "0"])
    config = tiny_config(
        out_dir,
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "custom_reward_function.path=null",  # the built-in scorer of data_source code: the sandbox
        "data.max_prompt_length=256",
        "data.max_response_length=48",
        f"trainer.seed={seed}",
        "trainer.val_before_train=true",
        f"trainer.test_freq={steps if tiny else max(steps // 3, 1)}",
        *(
            ["actor_rollout_ref.rollout.temperature=0.3"]
            if tiny
            else [
                "actor_rollout_ref.model.path=default",
                "actor_rollout_ref.rollout.temperature=0.7",
                "actor_rollout_ref.rollout.top_k=50",
                "data.train_batch_size=8",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
                "actor_rollout_ref.actor.optim.lr=1e-5",
            ]
        ),
        steps=steps,
    )
    if tiny:  # a random model writes no Python: teach it the answers to the first training prompts
        rows = RLHFDataset(config.data.train_files, _tokenizer(config)).rows[:2]
        chats = [[*r.messages, {"role": "assistant", "content": _answer(r)}] for r in rows]
        teach_conversations(config.actor_rollout_ref.model.path, chats)
        config.data.shuffle = False
    with PPOTrainer(config) as trainer:
        trainer.fit()
    rows = logged(out_dir)
    accuracy = _accuracy(out_dir)
    for row in rows:
        print(
            f"step {row['training/global_step']}: pass rate {row['reward_extra/pass_rate/mean']:.2f}, syntax errors "
            f"{row['reward_extra/syntax_error/mean']:.2f}, sandbox {row['reward_extra/sandbox_s/mean']:.2f} s a "
            f"sample, scoring {row['perf/reward_share']:.0%} of the step"
        )
    print("held-out pass rate (greedy): " + ", ".join(f"step {s}: {a:.0%}" for s, a in accuracy))
    return {"rows": rows, "accuracy": accuracy}


def _accuracy(out_dir: Path) -> list[tuple[int, float]]:
    import json

    lines = (out_dir / "run" / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row[ACC]) for row in map(json.loads, lines) if ACC in row]


def _tokenizer(config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)


def _answer(row) -> str:
    return function_solution(row.extra_info["op"], row.extra_info["n"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default=None)
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import tempfile

    import torch

    torch.set_num_threads(1 if args.model == "tiny" else 2)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="hybridflow-example-"))
    main(out, args.model, args.steps, args.seed)
    print(f"run folder: {out / 'run'}", file=sys.stderr)
