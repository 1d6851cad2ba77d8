"""Choosing a reward function: the built-in rule scorers by `data_source`, or a user's file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.rewards import arithmetic, calculator, countdown, gsm8k, math_answer, math_dapo, shapes
from hybridflow.utils.errors import UserError
from hybridflow.utils.user_code import load_user_function

Score = float | dict[str, Any]
#: data_source -> rule; verl's names score as verl's default_compute_score does (README, "Coming from verl")
RULE_SCORERS: dict[str, Callable[..., Score]] = {
    "openai/gsm8k": gsm8k.strict,
    "gsm8k": gsm8k.flexible,
    **dict.fromkeys(
        ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"],
        math_answer.compute_score,
    ),
    # verl grades these with prime_math's sympy grader; here the boxed answer (math_verify when installed)
    **dict.fromkeys(
        [
            "numina_aops_forum",
            "numina_synthetic_math",
            "numina_amc_aime",
            "numina_synthetic_amc",
            "numina_cn_k12",
            "numina_olympiads",
        ],
        math_answer.compute_score,
    ),
    **dict.fromkeys(["math", "math_dapo", "math_dapo_reasoning"], math_dapo.rule),
    "arithmetic": arithmetic.compute_score,
    "countdown": countdown.compute_score,
    "calculator": calculator.compute_score,
    "shapes": shapes.compute_score,
}
#: data_source prefix -> rule, for the names verl matches by prefix (aime24, aime2025, ...)
RULE_PREFIXES: dict[str, Callable[..., Score]] = {"aime": math_dapo.rule}


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Score:
    """Score one response with the rule scorer registered for its `data_source` (or its prefix)."""
    scorer = RULE_SCORERS.get(data_source) or next(
        (rule for prefix, rule in RULE_PREFIXES.items() if data_source.startswith(prefix)), None
    )
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
