"""GSM8K, scored as verl scores it: the answer is the number after the last ``#### `` in the reply's last 300
characters (``method="strict"``, what ``openai/gsm8k`` uses: the model must learn the format), or the reply's
last number (``method="flexible"``, what the ``gsm8k`` data source uses). A right answer scores ``score``
(1.0), a wrong one ``format_score`` (0.0), no answer 0.

One deliberate difference: answers are compared as numbers, so ``#### 1,250.`` and ``#### 72.0`` are right
for 1250 and 72 (verl compares strings and gives them 0).
"""

from __future__ import annotations

import re
from typing import Any, Literal

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_STRICT = re.compile(r"#### \$?(-?[0-9.,]+)")
_TAIL = 300  # verl looks only here: the final answer comes last, and regexes on long replies are slow


def parse_number(text: str) -> float | None:
    """`text` as a number, ignoring thousands separators, a leading `$` and a trailing `.`; else None."""
    cleaned = text.strip().lstrip("$").rstrip(".").replace(",", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_solution(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer in the reply's last 300 characters: after the last ``#### `` (strict) or its last
    number (flexible); None when there is none."""
    tail = solution_str[-_TAIL:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1] if found else None
    if method == "flexible":
        numbers = _NUMBER.findall(tail)
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's signature: ``score`` when the extracted answer equals ``ground_truth`` as a number (1,000 ==
    1000.0), ``format_score`` when an answer is there but wrong, 0 when there is none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    got, expected = parse_number(answer), parse_number(str(ground_truth))
    right = got is not None and expected is not None and abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    return score if right else format_score


def strict(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """The ``openai/gsm8k`` rule: ``compute_score`` with verl's defaults."""
    return compute_score(solution_str, ground_truth)


def flexible(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """The ``gsm8k`` rule: the reply's last number counts, with or without ``####``."""
    return compute_score(solution_str, ground_truth, method="flexible")


def reference_answer(ground_truth: str, extra_info: dict[str, Any] | None = None) -> str:
    """A reply ``compute_score`` gives full marks: the answer after ``####``."""
    return f"#### {ground_truth}"
