"""Choosing a reward function: the built-in rule scorers by `data_source`, or a user's file."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.rewards import arithmetic, calculator, countdown, gsm8k, math_answer, shapes
from hybridflow.utils.errors import MissingInputError, UserError

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


def load_custom_reward_function(
    path: str | Path, name: str = "compute_score", key: str = "custom_reward_function"
) -> Callable[..., Score]:
    """The function `name` from the Python file `path`, called like `default_compute_score`; `key` is the
    config section that names it (errors name its `.path` and `.name`; the served agent loads its function
    the same way).

    The module is not added to `sys.modules`: cloudpickle then ships the function by value, so
    Ray workers that cannot import the user's file still get it.
    """
    path, what = Path(path), "reward file" if key == "custom_reward_function" else "file"
    if not path.is_file():
        raise MissingInputError(f"{key}.path: {what} not found: {path}")
    spec = importlib.util.spec_from_file_location(f"hybridflow_custom_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UserError(f"{key}.path: cannot load {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(f"{key}.name: {path} has no function {name!r}; it defines {defined}")
    if not callable(fn):
        raise UserError(f"{key}.name: {name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn
