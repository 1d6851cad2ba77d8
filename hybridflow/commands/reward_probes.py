"""What ``hybridflow doctor``'s reward check sends the reward function for a data row: a right answer and a
wrong one.

The right answer is in the task's own form where the data source's rule scorer knows it (each builds it from
the row: ``reference_answer``), so a full score reads as a working reward and anything less as a problem:
the demo's data once printed ``ground-truth 0.5`` for a bare ``=<sum>``, which read as a broken reward. Where
no form is known (another scorer, a row without what the form needs), the ground truth goes in the usual answer
forms and the label says that less than full marks is expected.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards import RULE_SCORERS, arithmetic, calculator, countdown, gsm8k, math_answer, math_dapo

#: A reply each built-in rule scorer gives full marks, in its task's own form, built from the data row: the
#: reward check's right answer. Other scorers get the ground truth in ``GENERIC_FORMS``.
REFERENCE_ANSWERS: dict[Any, Any] = {
    arithmetic.compute_score: arithmetic.reference_answer,
    calculator.compute_score: calculator.reference_answer,
    countdown.compute_score: countdown.reference_answer,
    gsm8k.compute_score: gsm8k.reference_answer,
    gsm8k.strict: gsm8k.reference_answer,
    gsm8k.flexible: gsm8k.reference_answer,
    math_answer.compute_score: math_answer.reference_answer,
    math_dapo.rule: math_dapo.reference_answer,
}
GENERIC_FORMS = ("{}", "={}", "#### {}", "\\boxed{{{}}}", "<answer>{}</answer>")
WRONG_ANSWER = "I do not know."


def probes(row: Any, generic_too: bool) -> list[tuple[str, str, list[str]]]:
    """``(kind, label, responses)``: the right answer in the task's own form where the data source's rule
    scorer knows it (with the generic forms too for a custom function, which may want another one), else the
    ground truth in each generic form, labelled so that less than full marks reads as expected; then a wrong
    answer."""
    build = REFERENCE_ANSWERS.get(RULE_SCORERS.get(row.data_source))
    reference = build(row.ground_truth, row.extra_info) if build is not None else None
    generic = [form.format(row.ground_truth) for form in GENERIC_FORMS]
    wrong = ("wrong", f"wrong {WRONG_ANSWER!r}", [WRONG_ANSWER])
    if reference is None:
        label = (
            f"ground truth in {len(generic)} generic forms (no reply in this task's own form is known here: "
            "less than full marks is expected), best"
        )
        return [("ground-truth", label, generic), wrong]
    right = [reference, *generic] if generic_too else [reference]
    return [("right-answer", f"right answer {reference!r}", right), wrong]
