"""Choosing a reward function: the built-in rule scorers by `data_source`, or a user's file.

A scorer is a function ``(data_source, solution_str, ground_truth, extra_info) -> Score``; one that also
scores a whole batch at once (``BatchScorer``: the code scorer runs its samples' sandboxes in parallel) gets
the batch. ``RuleScorers`` is the default: every built-in rule by ``data_source``, code sources included.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hybridflow.rewards import arithmetic, calculator, countdown, gsm8k, math_answer
from hybridflow.rewards.code import CODE_SOURCES, CodeScorer
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
}
_CODE = CodeScorer()  # the default limits, for the function form below
RULE_SCORERS.update({source: _CODE.score for source in CODE_SOURCES})


@runtime_checkable
class BatchScorer(Protocol):
    """A scorer that also takes a whole batch (the reward manager then calls ``score_batch`` once)."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> Score: ...

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None],
    ) -> list[Score]: ...


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


class RuleScorers:
    """The built-in rules by ``data_source`` (``default_compute_score``), with ``code``'s settings: the code
    rows of a batch are scored in parallel sandboxes, the others one by one."""

    def __init__(self, code: CodeScorer | None = None) -> None:
        self.code = code or CodeScorer()

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> Score:
        if data_source in CODE_SOURCES:
            return self.code.score(solution_str, ground_truth, extra_info)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None],
    ) -> list[Score]:
        rows = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        code = [i for i, row in enumerate(rows) if row[0] in CODE_SOURCES]
        results: list[Score | None] = [None] * len(rows)
        for i, result in zip(code, self.code.score_many([rows[i][1:] for i in code])):
            results[i] = result
        for i, row in enumerate(rows):
            if results[i] is None:
                try:
                    results[i] = default_compute_score(*row)
                except UserError as e:  # e.g. no rule scorer for this data_source
                    raise UserError(f"sample {i} (data_source {row[0]!r}): {e}") from e
        return results

    def check_rows(self, rows: Iterable[tuple[str, str, Any]]) -> int:
        """Read every code row's tests and check the sandbox, before a run (``CodeScorer.check_ground_truths``);
        ``rows``: ``(where, data_source, ground_truth)``. Returns how many code rows there were."""
        return self.code.check_ground_truths(
            (where, truth) for where, source, truth in rows if source in CODE_SOURCES
        )


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
