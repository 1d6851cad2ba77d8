"""The visual `shapes` task (`hybridflow prepare-data shapes`): a one-word answer (a colour or a number).

`acc`: the reply's first word (case and a trailing full stop ignored) is the answer. `score` credits the
form too, as the arithmetic task does: 1.0 for the answer alone, 0.5 for the right first word followed by
anything else, 0.0 otherwise.
"""

from __future__ import annotations

from typing import Any

EXACT_SCORE, CHATTER_SCORE = 1.0, 0.5


def compute_score(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """{"score": 1.0 / 0.5 / 0.0, "acc": 1.0 or 0.0}."""
    truth = str(ground_truth).strip().lower()
    words = solution_str.strip().lower().split()
    first = words[0].rstrip(".!,") if words else ""
    correct = first == truth
    exact = correct and len(words) == 1
    return {"score": EXACT_SCORE if exact else CHATTER_SCORE if correct else 0.0, "acc": float(correct)}
