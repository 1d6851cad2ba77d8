"""Conditional routing: each sample's reward goes down the path of its prompt's category, then every
row comes back in its original order: creative prompts get a bonus, factual ones a checker's verdict,
all others pass through with the plain score. A category with no path and no default is an error
naming it. Inside your own driver the same split is ``batch.group_by(key)`` plus ``DataProto.merge_groups``.

    python examples/05_routing.py [OUT_DIR]
"""

import json
from pathlib import Path

import torch
from _setup import digit_share, logged, run, tiny_config
from transformers import AutoTokenizer

from hybridflow.dataflow import DataFlow, Router, sequence_to_token_scores
from hybridflow.rewards import RewardManager
from hybridflow.trainer import PPOTrainer

PROMPTS = [
    ("creative", "Write a poem about the sea.", ""),
    ("factual", "What is the capital of France?", "Paris"),
    ("chat", "Hello, how are you?", ""),
    ("creative", "Tell a story about a fox.", ""),
    ("factual", "How many days are in a week?", "7"),
    ("chat", "What is your name?", ""),
]
BONUS = 0.5


def write_prompts(path: Path) -> None:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "data_source": "chat",
                    "prompt": text,
                    "reward_model": {"ground_truth": truth},
                    "extra_info": {"category": category},
                }
            )
            + "\n"
            for category, text, truth in PROMPTS * 2
        )
    )


def make_flow(tokenizer) -> DataFlow:
    plain, checker = RewardManager(tokenizer, digit_share), RewardManager(tokenizer, fact_check)

    def score(data):  # every row: the plain score on its last token
        data.batch["token_level_scores"] = plain(data)
        return data

    def creative_bonus(data):
        bonus = sequence_to_token_scores(torch.full((len(data),), BONUS), data.batch["response_mask"])
        data.batch["token_level_scores"] = data.batch["token_level_scores"] + bonus
        return data

    def check_facts(data):
        data.batch["token_level_scores"] = checker(data)
        return data

    flow = (
        DataFlow()
        .add_node("score", score)
        .add_node("category", Router(lambda row: row["extra_info"]["category"]))
    )
    flow.add_node("creative_bonus", creative_bonus).add_node("check_facts", check_facts).add_edge(
        "score", "category"
    )
    flow.add_edge("category", "creative_bonus", route="creative").add_edge(
        "category", "check_facts", route="factual"
    )
    return flow.add_edge("category", DataFlow.OUTPUT, route="default")


def fact_check(data_source, text, ground_truth, extra_info=None) -> float:
    return 1.0 if ground_truth in text else -1.0


def main(out_dir: Path) -> dict:
    prompts = Path(out_dir) / "prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    write_prompts(prompts)
    config = tiny_config(out_dir, f"data.train_files=[{prompts}]", steps=3)
    flow = make_flow(AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path))

    def routed_reward(batch, return_dict=False):
        out = flow.run(batch)
        scores = out.batch["token_level_scores"]
        return (
            {"reward_tensor": scores, "reward_extra_info": {}, "metrics": out.meta_info["metrics"]}
            if return_dict
            else scores
        )

    trainer = PPOTrainer(config, reward_fn=routed_reward)
    scored = []
    trainer.register_hook("after_reward", lambda trainer, step, metrics, batch: scored.append(batch))
    trainer.fit()
    first = scored[0]
    print(
        "step 1, final score per sample:",
        ", ".join(
            f"{extra['category']} {score:+.2f}"
            for extra, score in zip(
                first.non_tensor_batch["extra_info"], first.batch["token_level_scores"].sum(-1).tolist()
            )
        ),
    )
    for row in logged(out_dir):
        counts = {k.split("/")[2]: v for k, v in row.items() if k.startswith("route/category/")}
        print(f"step {row['step']}: rows per category {counts}")
    return {"batches": scored, "rows": logged(out_dir)}


if __name__ == "__main__":
    run(main)
