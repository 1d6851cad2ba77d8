"""Choosing a reward function: the built-in rule scorers by `data_source`, or a user's file.

A scorer is a function ``(data_source, solution_str, ground_truth, extra_info) -> Score``; one that also
scores a whole batch at once (``BatchScorer``: the code scorer runs its samples' sandboxes in parallel) gets
the batch. ``RuleScorers`` is the default: every built-in rule by ``data_source``, code sources included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hybridflow.rewards import arithmetic, calculator, countdown, gsm8k, math_answer, math_dapo, shapes
from hybridflow.rewards.code import CODE_SOURCES, CodeScorer
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

_CODE = CodeScorer()  # the default limits, for the function form below
RULE_SCORERS.update({source: _CODE.score for source in CODE_SOURCES})


@runtime_checkable
class BatchScorer(Protocol):
    """A scorer that also takes a whole batch (the reward manager then calls ``score_batch`` once)."""

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> Score: ...

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[Score]: ...


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
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


class RuleScorers:
    """The built-in rules by ``data_source`` (``default_compute_score``), with ``code``'s settings: the code
    rows of a batch are scored in parallel sandboxes, the others one by one."""

    def __init__(self, code: CodeScorer | None = None) -> None:
        self.code = code or CodeScorer()

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> Score:
        if data_source in CODE_SOURCES:
            return self.code.score(solution_str, ground_truth, extra_info)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None],
    ) -> list[Score]:
        rows = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
        code = [i for i, row in enumerate(rows) if row[0] in CODE_SOURCES]
        results: list[Score | None] = [None] * len(rows)
        for i, result in zip(code, self.code.score_many([rows[i][1:] for i in code])):
            results[i] = result
        scored: list[Score] = []
        for i, row in enumerate(rows):
            score = results[i]
            if score is None:
                try:
                    score = default_compute_score(*row)
                except UserError as e:  # e.g. no rule scorer for this data_source
                    raise UserError(f"sample {i} (data_source {row[0]!r}): {e}") from e
            scored.append(score)
        return scored

    def check_rows(self, rows: Iterable[tuple[str, str, Any]]) -> int:
        """Read every code row's tests and check the sandbox, before a run (``CodeScorer.check_ground_truths``);
        ``rows``: ``(where, data_source, ground_truth)``. Returns how many code rows there were."""
        return self.code.check_ground_truths(
            (where, truth) for where, source, truth in rows if source in CODE_SOURCES
        )


def load_custom_reward_function(path: str | Path, name: str = "compute_score") -> Callable[..., Score]:
    """The reward function ``name`` from the Python file ``path`` (``custom_reward_function.path`` and
    ``.name``), called like ``default_compute_score``."""
    return load_user_function(path, name, "custom_reward_function", what="reward file")
