"""The demo task (two-digit addition, reply in the form `A+B=<sum>`).

`acc` is the task's accuracy: the integer right after the reply's first `=` is the sum. The
`score` also rewards the reply's form, because a reward that ignores what follows the answer teaches
the model to keep talking (seen in the demo's early runs): 1.0 for exactly `A+B=<sum>`, 0.5 for the right sum followed by
anything else, 0.0 otherwise.
"""

from __future__ import annotations

import re
from typing import Any

EXACT_SCORE, CHATTER_SCORE = 1.0, 0.5
_AFTER_EQUALS = re.compile(r"\s*(-?\d+)")


def compute_score(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """{"score": 1.0 / 0.5 / 0.0, "acc": 1.0 or 0.0}; `extra_info` {"a", "b"} pins the form's operands."""
    truth = str(ground_truth).strip()
    _, equals, rest = solution_str.partition("=")
    leading = _AFTER_EQUALS.match(rest) if equals else None
    correct = leading is not None and leading.group(1) == truth
    info = extra_info or {}
    a = re.escape(str(info["a"])) if "a" in info else r"\d+"
    b = re.escape(str(info["b"])) if "b" in info else r"\d+"
    exact = re.fullmatch(rf"{a}\+{b}={re.escape(truth)}", solution_str.strip()) is not None
    score = EXACT_SCORE if exact else CHATTER_SCORE if correct else 0.0
    return {"score": score, "acc": float(correct)}


def reference_answer(ground_truth: str, extra_info: dict[str, Any] | None = None) -> str | None:
    """The reply ``compute_score`` gives full marks (``A+B=<sum>``); None without the operands in ``extra_info``."""
    info = extra_info or {}
    return f"{info['a']}+{info['b']}={str(ground_truth).strip()}" if "a" in info and "b" in info else None
