"""The arithmetic task as data for the offline trainers: demonstrations, preference pairs, KTO rows.

Built from the RL rows of ``prepare.arithmetic_splits`` (same seed, same split), so an SFT/DPO/KTO run's
held-out rows are the RL task's held-out prompts and greedy accuracy before and after is comparable with
the GRPO demo. The correct reply is the task's exact form ``A+B=<sum>``. A wrong reply comes either from a
rule (``rule``: the sum off by 1 or 10, deterministic and instant) or from the base model's own samples
(``model``: what the model actually gets wrong, which is what preference optimisation should push down;
sampling the embedded model takes minutes on a CPU).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hybridflow.rewards import arithmetic

Row = dict[str, Any]


def _operands(row: Row) -> tuple[int, int]:
    return row["extra_info"]["a"], row["extra_info"]["b"]


def correct_reply(row: Row) -> str:
    a, b = _operands(row)
    return f"{a}+{b}={a + b}"


def rule_wrong_reply(row: Row, rng: random.Random) -> str:
    """``A+B=<sum +- 1 or 10>``: the near misses a small model makes."""
    a, b = _operands(row)
    return f"{a}+{b}={a + b + rng.choice([-10, -1, 1, 10])}"


def _keep(row: Row, **fields: Any) -> Row:
    """An offline row that keeps the RL row's prompt, source and ground truth (for evaluation)."""
    return {
        "prompt": row["prompt"],
        "data_source": row["data_source"],
        "reward_model": row["reward_model"],
        "extra_info": row["extra_info"],
        **fields,
    }


def sft_rows(rows: list[Row]) -> list[Row]:
    """``{prompt, response}`` demonstrations of the correct reply."""
    return [_keep(row, response=correct_reply(row)) for row in rows]


def preference_rows(rows: list[Row], wrong: list[str]) -> list[Row]:
    """``{prompt, chosen, rejected}``: the correct reply over ``wrong[i]``."""
    return [_keep(row, chosen=correct_reply(row), rejected=bad) for row, bad in zip(rows, wrong, strict=True)]


def kto_rows(rows: list[Row], wrong: list[str]) -> list[Row]:
    """``{prompt, completion, label}``: each prompt once with the correct reply (true), once with ``wrong[i]``."""
    out = []
    for row, bad in zip(rows, wrong, strict=True):
        out += [
            _keep(row, completion=correct_reply(row), label=True),
            _keep(row, completion=bad, label=False),
        ]
    return out


def rule_wrong_replies(rows: list[Row], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rule_wrong_reply(row, rng) for row in rows]


@torch.no_grad()
def model_wrong_replies(
    rows: list[Row],
    model_path: str,
    samples: int = 4,
    temperature: float = 0.7,
    max_new_tokens: int = 16,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[list[str], float]:
    """For each row, a wrong reply the model itself sampled (the first of ``samples``; a rule's near miss
    when all were right), and the share of samples that were correct (the model's sampled accuracy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hybridflow.models import resolve_model_path

    hf_logging.disable_progress_bar()
    path = resolve_model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    wrong, correct = [], 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in chunk
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **inputs,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
        )
        replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for i, row in enumerate(chunk):
            mine = [r.strip() for r in replies[i * samples : (i + 1) * samples]]
            graded = [
                arithmetic.compute_score(r, row["reward_model"]["ground_truth"], row["extra_info"])["acc"]
                for r in mine
            ]
            correct += int(sum(graded))
            bad = [r for r, acc in zip(mine, graded) if not acc and r]
            wrong.append(bad[0] if bad else rule_wrong_reply(row, rng))
    return wrong, correct / max(len(rows) * samples, 1)
