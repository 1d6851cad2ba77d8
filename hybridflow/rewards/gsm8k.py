"""GSM8K: the number after the last `####`, else the last number in the reply, compared numerically."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    """`text` as a number, ignoring thousands separators, a leading `$` and a trailing `.`; else None."""
    cleaned = text.strip().lstrip("$").rstrip(".").replace(",", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_answer(solution_str: str) -> str | None:
    """The first number after the last `####`; if there is none, the reply's last number (flexible format)."""
    if "####" in solution_str:
        found = _NUMBER.search(solution_str.rsplit("####", 1)[1])
        if found:
            return found.group()
    numbers = _NUMBER.findall(solution_str)
    return numbers[-1] if numbers else None


def compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the reply's answer equals `ground_truth` as a number (1,000 == 1000.0), else 0.0."""
    answer = extract_answer(solution_str)
    expected = parse_number(str(ground_truth))
    if answer is None or expected is None:
        return 0.0
    got = parse_number(answer)
    return float(got is not None and abs(got - expected) <= 1e-6 * max(1.0, abs(expected)))


def reference_answer(ground_truth: str, extra_info: dict | None = None) -> str:
    """A reply ``compute_score`` gives full marks: the answer after ``####``."""
    return f"#### {ground_truth}"
