"""MATH-style answers: the content of the reply's last `\\boxed{...}` against the ground truth.

`math_verify` (symbolic equivalence) is used when installed; otherwise both sides are normalised
(LaTeX spacing, `\\dfrac`, `\\text{}`, degrees, percent, `$`) and compared as numbers when both are
numbers (`0.5`, `1/2`, `\\frac{1}{2}`), else as strings.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}", "\\%", "%", "$", " ")
_FRAC = re.compile(r"^(-?)\\frac\{(\d+)\}\{(\d+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1 : i]
    return None


def normalize(answer: str) -> str:
    s = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    for token in _DROP:
        s = s.replace(token, "")
    return s.rstrip(".")


def as_number(answer: str) -> Fraction | None:
    """A normalised answer as an exact number (`-3`, `0.25`, `1/4`, `\\frac{1}{4}`), else None."""
    frac = _FRAC.match(answer)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    try:
        return Fraction(answer.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(parse, verify) from math_verify when it is installed, else None; looked up once."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def compute_score(solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when the last boxed answer equals the ground truth (itself boxed or plain), else 0.0."""
    predicted = last_boxed(solution_str)
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    if predicted is None:
        return 0.0
    checker = _math_verify()
    if checker is not None:
        parse, verify = checker
        return float(verify(parse(f"\\boxed{{{truth}}}"), parse(f"\\boxed{{{predicted}}}")))
    predicted, truth = normalize(predicted), normalize(truth)
    a, b = as_number(predicted), as_number(truth)
    if a is not None and b is not None:
        return float(a == b)
    return float(predicted == truth)


def reference_answer(ground_truth: str, extra_info: dict[str, Any] | None = None) -> str:
    """A reply ``compute_score`` gives full marks: the answer in ``\\boxed{}``."""
    truth = str(ground_truth)
    return f"\\boxed{{{last_boxed(truth) or truth}}}"
