"""What a code sample is tested with, the program taken from a response, and the trusted comparisons.

Test formats (``reward_model.ground_truth``: a dict or its JSON text), told apart by their keys:
- HumanEval: ``{"prompt", "test", "entry_point"}``: the function's prompt, a ``check(candidate)`` test; one
  test (``check`` asserts everything).
- assert lists (MBPP): ``{"test_list": [...]}`` (or sandbox-fusion's ``assert_case``), optional
  ``test_setup_code``; each assert is a test.
- stdin/stdout (verl's prime code, APPS, TACO, LiveCodeBench): ``{"inputs": [...], "outputs": [...]}``, each
  pair a test; with ``fn_name`` a call test instead: ``inputs[i]`` are the arguments of ``fn_name`` (a function,
  or a method of ``class Solution``) and ``outputs[i]`` its return value. APPS's ``input_output`` column (the
  same as JSON text) is read too.

The expected outputs of stdin/stdout and call tests stay on this side: the sandbox reports what the program
printed or returned, and ``output_matches`` / ``value_matches`` judge it here, where the program cannot reach.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.utils.errors import InputError

Kind = Literal["humaneval", "asserts", "call", "stdio"]
FORMATS = (
    "{prompt, test, entry_point} (HumanEval), {test_list: [asserts]} (MBPP), or {inputs, outputs[, fn_name]} "
    "(stdin/stdout or call tests)"
)
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.S)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n")
_PYTHON_TAGS = ("", "python", "python3", "py")


@dataclass
class CodeTests:
    """A sample's tests: ``sandbox`` is what the sandbox gets for each test, ``expected`` what this side
    compares with (None for assert tests, which pass by completing)."""

    kind: Kind
    sandbox: list[dict[str, Any]]
    expected: list[Any] = field(default_factory=list)
    setup: str = ""
    prompt: str = ""
    entry_point: str = ""

    def __len__(self) -> int:
        return len(self.sandbox)


def _strings(value: Any, what: str, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: {what} must be a non-empty list of strings, got {value!r:.120}")
    return value


def _text(value: Any) -> Any:
    """A stdin/stdout entry: text, or (as some datasets store them) a list of lines, joined; anything else as
    it is, for the caller to refuse."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value) + "\n"
    return value


def parse_tests(ground_truth: Any, where: str = "ground truth") -> CodeTests:
    """``ground_truth`` as ``CodeTests``; raises ``InputError`` naming ``where`` for anything malformed."""
    spec = ground_truth
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise InputError(
                f"{where}: code tests must be a dict or its JSON text ({err}); {FORMATS}"
            ) from None
    if not isinstance(spec, dict):
        raise InputError(f"{where}: code tests must be a dict, got {type(spec).__name__}; {FORMATS}")
    if "input_output" in spec and "inputs" not in spec:
        return parse_tests(spec["input_output"], where)
    if "test" in spec or "entry_point" in spec:
        return _humaneval(spec, where)
    if "test_list" in spec or "assert_case" in spec:
        asserts = _strings(spec.get("test_list", spec.get("assert_case")), "test_list", where)
        setup = spec.get("test_setup_code") or ""
        if not isinstance(setup, str):
            raise InputError(f"{where}: test_setup_code must be a string, got {type(setup).__name__}")
        return CodeTests("asserts", [{"code": a} for a in asserts], [None] * len(asserts), setup)
    if "inputs" in spec and "outputs" in spec:
        return _input_output(spec, where)
    raise InputError(f"{where}: no code tests found (keys {sorted(spec)}); expected {FORMATS}")


def _humaneval(spec: dict[str, Any], where: str) -> CodeTests:
    test, entry, prompt = spec.get("test"), spec.get("entry_point"), spec.get("prompt", "")
    if not isinstance(test, str) or "def check" not in test:
        raise InputError(f"{where}: a HumanEval test must be a string defining check(candidate)")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise InputError(f"{where}: entry_point must be the function's name, got {entry!r:.60}")
    if not isinstance(prompt, str):
        raise InputError(f"{where}: prompt must be the function's code prompt (a string)")
    return CodeTests(
        "humaneval", [{"code": test, "call": "check", "entry_point": entry}], [None], "", prompt, entry
    )


def _input_output(spec: dict[str, Any], where: str) -> CodeTests:
    inputs, outputs, fn_name = spec["inputs"], spec["outputs"], spec.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        raise InputError(f"{where}: inputs and outputs must be non-empty lists")
    if len(inputs) != len(outputs):
        raise InputError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    if fn_name:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise InputError(f"{where}: fn_name must be a function name, got {fn_name!r:.60}")
        args = [a if isinstance(a, list) else [a] for a in inputs]
        return CodeTests(
            "call", [{"fn_name": fn_name, "args": a} for a in args], list(outputs), entry_point=fn_name
        )
    stdin, stdout = [_text(v) for v in inputs], [_text(v) for v in outputs]
    if not all(isinstance(v, str) for v in stdin + stdout):
        raise InputError(
            f"{where}: stdin/stdout tests need text inputs and outputs (or fn_name for call tests)"
        )
    return CodeTests("stdio", [{"stdin": s} for s in stdin], stdout)


def output_cap(expected: Any) -> int:
    """Bytes of stdout kept per test: twice the expected output and 1 KiB more (a stdin/stdout program that
    prints far more than expected is wrong anyway, and the whole report must fit the sandbox's output cap)."""
    return 2 * len(expected.encode()) + 1024 if isinstance(expected, str) else 1024


# ------------------------------------------------------------------------------------- the program
def _blocks(response: str) -> list[str]:
    """Fenced Python blocks (untagged ones too), in order; an unclosed last fence (a reply cut at the token
    limit) counts with what follows it."""
    blocks = [code for tag, code in _FENCE.findall(response) if tag.lower() in _PYTHON_TAGS]
    if not blocks:
        opened = list(_OPEN_FENCE.finditer(response))
        if opened:
            blocks = [response[opened[-1].end() :]]
    return blocks


def _imports(prompt: str) -> str:
    return "".join(line + "\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))


def extract_program(response: str, tests: CodeTests) -> str:
    """The program a response holds: the last fenced Python block that defines a function (else the last
    block; else the whole response, taken as code). HumanEval: a block that defines the entry point is the
    whole program (after the prompt's imports); anything else completes the prompt's function."""
    blocks = _blocks(response)
    defining = [b for b in blocks if re.search(r"^\s*(def|class)\s", b, re.M)]
    found = defining or blocks
    code = found[-1] if found else None
    if tests.kind != "humaneval":
        return response if code is None else code
    if code is not None and re.search(rf"^\s*def\s+{re.escape(tests.entry_point)}\s*\(", code, re.M):
        return _imports(tests.prompt) + code
    return tests.prompt + (response if code is None else code)


# ------------------------------------------------------------------------------------- comparisons
def _close(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def output_matches(actual: str, expected: str) -> bool:
    """A stdin/stdout test's verdict: the same lines (trailing spaces and blank lines aside), else the same
    whitespace-separated tokens with numbers equal to 1e-6 (``1.5000`` for ``1.5``)."""
    lines = [line.rstrip() for line in actual.strip().splitlines()]
    if lines == [line.rstrip() for line in expected.strip().splitlines()]:
        return True
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(g == w or _close(g, w) for g, w in zip(got, want))


def value_matches(returned: str, expected: Any) -> bool:
    """A call test's verdict: the returned value (JSON, tuples as lists) equals ``expected``, or its only
    element (APPS wraps return values in a list)."""
    try:
        value = json.loads(returned)
    except json.JSONDecodeError:
        return False
    wrapped = isinstance(expected, list) and len(expected) == 1 and value == expected[0]
    return value == expected or wrapped
