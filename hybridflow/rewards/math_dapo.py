"""DAPO-style math answers (verl's ``math``, ``math_dapo``, ``math_dapo_reasoning`` and ``aime*`` data
sources): the reply ends with a line ``Answer: <answer>``; right scores +1, wrong -1, and the result also
says ``acc`` (right or not) and ``pred`` (the answer read), as verl's does.

The answer and the ground truth are normalised with ``math_answer``'s rules (the part after the last
``=``, a ``\\boxed{}`` unwrapped, LaTeX spacing, ``\\dfrac``, ``\\text{}``, ``$``) and compared as exact
numbers when both are numbers, else as strings; verl uses the Minerva normaliser (which also drops a list
of unit words), so a few unit-laden answers grade differently.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.rewards.math_answer import as_number, last_boxed, normalize

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL = 300  # the longest MATH-500 answer has 159 characters; the final line comes last


def normalize_final_answer(answer: str) -> str:
    """The comparable form of an answer: after the last ``=``, unboxed, normalised."""
    answer = answer.split("=")[-1].strip()
    return normalize(last_boxed(answer) or answer).strip()


def _equal(predicted: str, truth: str) -> bool:
    a, b = as_number(predicted), as_number(truth)
    return a == b if a is not None and b is not None else predicted == truth


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict[str, Any]:
    """``{"score": 1.0 or -1.0, "acc": bool, "pred": str}`` for the last ``Answer:`` line of the reply's last
    300 characters (``"[INVALID]"`` when there is none); ``strict_box_verify`` instead compares the last
    ``\\boxed{}`` of the reply's last 100 characters with the ground truth, character for character."""
    if strict_box_verify:
        pred = last_boxed(solution_str[-100:])
        right = pred == str(ground_truth)
    else:
        lines = _ANSWER_LINE.findall(solution_str[-_TAIL:])
        pred = normalize_final_answer(lines[-1]) if lines else "[INVALID]"
        right = bool(lines) and _equal(pred, normalize_final_answer(str(ground_truth)))
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}


def rule(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The data-source rule: ``compute_score`` with verl's defaults."""
    return compute_score(solution_str, ground_truth)


def reference_answer(ground_truth: str, extra_info: dict[str, Any] | None = None) -> str:
    """A reply ``rule`` gives full marks: the ground truth on an ``Answer:`` line."""
    return f"Answer: {ground_truth}"
