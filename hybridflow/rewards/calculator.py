"""The calculator task (3-digit products with a calculator tool, multi-turn; `prepare-data calculator`).

The final answer is the last assistant message of the conversation (`extra_info["messages"]`, which the
reward manager adds for multi-turn rollouts), else the whole reply. `score`: 1.0 for exactly
`A*B=<product>`, 0.5 for the right product in another form (the number after the first `=`, or the
first number when there is no `=`), 0.1 for a
wrong answer after a well-formed calculator call (a small push towards using the tool), else 0.
`acc` is whether the product is right; `tool_call_ok` whether a well-formed calculator call was made.
"""

from __future__ import annotations

import re
from typing import Any

_AFTER_EQUALS = re.compile(r"\s*(-?\d+)")
_NUMBER = re.compile(r"(-?\d+)")
TOOL_SCORE = 0.1


def _final_answer(solution_str: str, info: dict[str, Any]) -> str:
    answers = [m["content"] for m in info.get("messages") or [] if m["role"] == "assistant"]
    return answers[-1] if answers else solution_str


def _called_calculator(info: dict[str, Any]) -> bool:
    return any(
        call["name"] == "calculator" and call["error"] is None
        for turn in info.get("tool_calls") or []
        for call in turn["calls"]
    )


def compute_score(
    solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """{"score", "acc", "tool_call_ok"}; `extra_info` {"a", "b"} pins the answer's form."""
    info, truth = extra_info or {}, str(ground_truth).strip()
    answer = _final_answer(solution_str, info).strip()
    _, equals, rest = answer.partition("=")
    number = _AFTER_EQUALS.match(rest) if equals else _NUMBER.search(answer)
    correct = number is not None and number.group(1) == truth
    form = re.escape(f"{info['a']}*{info['b']}") if "a" in info and "b" in info else r"\d+\*\d+"
    exact = re.fullmatch(rf"{form}={re.escape(truth)}", answer) is not None
    tool_ok = _called_calculator(info)
    score = 1.0 if exact else 0.5 if correct else TOOL_SCORE if tool_ok else 0.0
    return {"score": score, "acc": float(correct), "tool_call_ok": float(tool_ok)}


def reference_answer(ground_truth: str, extra_info: dict[str, Any] | None = None) -> str | None:
    """The reply ``compute_score`` gives full marks (``A*B=<product>``); None without the factors in ``extra_info``."""
    info = extra_info or {}
    return f"{info['a']}*{info['b']}={str(ground_truth).strip()}" if "a" in info and "b" in info else None
