"""Choosing a reward function: the built-in rule scorers by `data_source`, or a user's file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.rewards import arithmetic, calculator, countdown, gsm8k, math_answer, shapes
from hybridflow.utils.errors import UserError
from hybridflow.utils.user_code import load_user_function

Score = float | dict[str, Any]
RULE_SCORERS: dict[str, Callable[..., Score]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "math": math_answer.compute_score,
    "lighteval/MATH": math_answer.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_answer.compute_score,
    "arithmetic": arithmetic.compute_score,
    "countdown": countdown.compute_score,
    "calculator": calculator.compute_score,
    "shapes": shapes.compute_score,
}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Score:
    """Score one response with the rule scorer registered for its `data_source`."""
    scorer = RULE_SCORERS.get(data_source)
    if scorer is None:
        raise UserError(
            f"no rule reward for data_source {data_source!r}; known: {sorted(RULE_SCORERS)}. "
            "For other data set custom_reward_function.path (and .name) to your scoring function."
        )
    return scorer(solution_str, ground_truth, extra_info)


def load_custom_reward_function(path: str | Path, name: str = "compute_score") -> Callable[..., Score]:
    """The reward function ``name`` from the Python file ``path`` (``custom_reward_function.path`` and
    ``.name``), called like ``default_compute_score``."""
    return load_user_function(path, name, "custom_reward_function", what="reward file")
