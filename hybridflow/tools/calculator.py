"""``calculator``: evaluates an arithmetic expression without ``eval``.

Why a tree walk over ``ast``: the model's text is untrusted, and ``eval`` with empty builtins still
reaches attributes and dunders. Only numbers, + - * / // % ** and unary minus are allowed, and exponents
and operand sizes are bounded so ``9**9**9`` cannot take the trainer down.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from hybridflow.tools.base import BaseTool, ToolError, ToolOutput

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT, MAX_DIGITS, MAX_LENGTH = 100, 1000, 500


def _check_size(value: float | int) -> float | int:
    if isinstance(value, int) and abs(value).bit_length() > MAX_DIGITS * 3.33:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return value


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
    raise ToolError(
        f"unsupported element {ast.dump(node)[:60]!r}: use numbers, + - * / // % ** and parentheses"
    )


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (integers exactly, floats to 12 significant digits)."""
    if len(expression) > MAX_LENGTH:
        raise ToolError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorTool(BaseTool):
    """Arithmetic on numbers: ``{"expression": "123*456"}`` -> ``"56088"``."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12+3)*4"}},
        "required": ["expression"],
    }

    def execute(self, args: dict[str, Any], instance_id: str) -> ToolOutput:
        expression = args.get("expression")
        if not isinstance(expression, str):
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        return calculate(expression), 0.0, {}
