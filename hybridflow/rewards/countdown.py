"""Countdown: an equation in `<answer>...</answer>` that uses each given number once and hits the target.

The equation is parsed with `ast` and evaluated by walking the tree with exact fractions; only
numbers and + - * / are accepted, so no text from the model is ever executed. Score: 1.0 when it
uses exactly the given numbers and equals the target, 0.1 when it is a well-formed equation that
does not (wrong numbers, wrong value, division by zero), 0.0 when there is no parsable equation.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction
from typing import Any

CORRECT_SCORE, FORMAT_SCORE = 1.0, 0.1
MAX_EQUATION_CHARS = 500
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {
    ast.Add: Fraction.__add__,
    ast.Sub: Fraction.__sub__,
    ast.Mult: Fraction.__mul__,
    ast.Div: Fraction.__truediv__,
}


def extract_equation(solution_str: str) -> str | None:
    """The last `<answer>` block's text, without a trailing `= result` the model may add."""
    blocks = _ANSWER.findall(solution_str)
    return blocks[-1].split("=", 1)[0].strip() if blocks else None


def _numbers(node: ast.AST) -> list[int]:
    """The integer literals of an arithmetic tree; ValueError on anything but numbers and + - * /."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _numbers(node.left) + _numbers(node.right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    raise ValueError(f"not allowed in an equation: {ast.dump(node)[:80]}")


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of a tree `_numbers` accepted; ZeroDivisionError on division by zero."""
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    raise ValueError(f"not a number: {ast.dump(node)[:80]}")  # _numbers refuses it first


def parse_equation(equation: str) -> ast.AST | None:
    """The expression tree when `equation` is numbers combined with + - * / (and parentheses), else None."""
    if len(equation) > MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(equation, mode="eval").body
        _numbers(tree)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return tree


def compute_score(
    solution_str: str, ground_truth: str | dict[str, Any], extra_info: dict[str, Any] | None = None
) -> float:
    """`ground_truth`: {"target": int, "numbers": [int, ...]} or its JSON string."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    equation = extract_equation(solution_str)
    tree = parse_equation(equation) if equation is not None else None
    if tree is None:
        return 0.0
    if Counter(_numbers(tree)) != Counter(truth["numbers"]):
        return FORMAT_SCORE
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        return FORMAT_SCORE
    return CORRECT_SCORE if value == truth["target"] else FORMAT_SCORE


def reference_answer(
    ground_truth: str | dict[str, Any], extra_info: dict[str, Any] | None = None
) -> str | None:
    """A reply ``compute_score`` gives full marks: the known solution (``prepare-data countdown`` keeps it in
    ``extra_info["solution"]``) in ``<answer>`` tags; None without one."""
    solution = (extra_info or {}).get("solution")
    return f"<answer>{solution}</answer>" if solution else None
