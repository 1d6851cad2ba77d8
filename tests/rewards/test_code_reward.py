"""Code rewards: programs run against their tests in real sandboxes (one per sample), the formats, the limits,
and programs that try to get a score they did not earn."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hybridflow.config.schema import CodeRewardConfig
from hybridflow.protocol import DataProto
from hybridflow.rewards import CodeScorer, RewardManager, RuleScorers
from hybridflow.rewards.code_harness import RESULT_MARKER
from hybridflow.rewards.code_tests import extract_program, output_matches, parse_tests, value_matches
from hybridflow.tools import sandbox
from hybridflow.tools.sandbox import SandboxUnavailable
from hybridflow.utils.errors import InputError

FAST = CodeRewardConfig(sample_timeout_s=6.0, test_timeout_s=1.5)
HUMANEVAL = {
    "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
    "entry_point": "total",
}
MBPP = {"test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
ONE = {"test_list": ["assert add(1, 2) == 3"]}
STDIO = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
CALL = {"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"}
ADD = "def add(a, b):\n    return a + b\n"
READ_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(code: str) -> str:
    return f"Here is the solution:\n```python\n{code}```\nIt adds."


@pytest.fixture(scope="module")
def scorer() -> CodeScorer:
    try:
        sandbox.sandbox_mode()
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    return CodeScorer(FAST)


# ------------------------------------------------------------------------------ formats, no sandbox
def test_each_format_is_read_from_a_dict_or_its_json_text():
    assert parse_tests(HUMANEVAL).kind == "humaneval" and len(parse_tests(HUMANEVAL)) == 1
    assert parse_tests(json.dumps(MBPP)).kind == "asserts" and len(parse_tests(MBPP)) == 3
    stdio = parse_tests(STDIO)
    assert stdio.kind == "stdio" and stdio.expected == ["3\n", "12\n"]
    assert [t["stdin"] for t in stdio.sandbox] == ["1 2\n", "5 7\n"]  # the outputs never go to the sandbox
    call = parse_tests({"input_output": json.dumps(CALL)})  # APPS's column
    assert call.kind == "call" and call.sandbox[1] == {"fn_name": "add", "args": [3, 4]}


@pytest.mark.parametrize(
    "truth, message",
    [
        ("not json", "must be a dict or its JSON text"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"test_list": []}, "test_list must be a non-empty list of strings"),
        ({"test": "assert 1", "entry_point": "f"}, "check(candidate)"),
        ({"question": "x"}, "no code tests found (keys ['question'])"),
    ],
)
def test_malformed_tests_are_refused_naming_the_row(truth, message):
    with pytest.raises(InputError) as refused:
        parse_tests(truth, "train.parquet: row 7")
    assert message in str(refused.value) and str(refused.value).startswith("train.parquet: row 7")


def test_the_program_is_the_last_fenced_block_that_defines_something():
    tests = parse_tests(MBPP)
    response = f"```python\n{ADD}```\nusage:\n```python\nprint(add(1, 2))\n```"
    assert extract_program(response, tests) == ADD
    assert extract_program(ADD, tests) == ADD  # no fence: the reply is the code
    assert extract_program(f"```python\n{ADD}", tests) == ADD  # cut at the token limit: an unclosed fence
    he = parse_tests(HUMANEVAL)
    body = "    return sum(xs)\n"
    assert extract_program(body, he) == HUMANEVAL["prompt"] + body  # completes the prompt's function
    whole = extract_program(fenced("def total(xs):\n    return sum(xs)\n"), he)
    assert whole == "from typing import List\ndef total(xs):\n    return sum(xs)\n"  # the prompt's imports


def test_outputs_compare_by_lines_then_by_tokens_and_values_unwrap_apps_lists():
    assert output_matches("3  \n\n", "3\n") and output_matches("1.50000 2", "1.5 2")
    assert not output_matches("3\n4", "3\n") and not output_matches("1.6", "1.5")
    assert value_matches("[1, 2]", [1, 2]) and value_matches("3", [3]) and not value_matches("3", [4])
    assert not value_matches("not json", 3)


# ------------------------------------------------------------------------------ real sandboxes
@pytest.mark.parametrize(
    "truth, right",
    [
        (HUMANEVAL, "def total(xs):\n    return sum(xs)\n"),
        (MBPP, ADD),
        (STDIO, READ_ADD),
        (CALL, ADD),
        (CALL, "class Solution:\n    def add(self, a, b):\n        return a + b\n"),
        (
            {"inputs": [[True], [None]], "outputs": [False, True], "fn_name": "neg"},
            "def neg(x):\n    return not x\n",
        ),
    ],
)
def test_a_right_program_scores_1_and_a_wrong_one_0(scorer, truth, right):
    good = scorer.score(fenced(right), truth)
    assert good["score"] == 1.0 and good["acc"] == 1.0 and good["pass_rate"] == 1.0
    assert good["syntax_error"] == 0.0 and good["timeout"] == 0.0 and good["sandbox_s"] > 0
    wrong = right.replace("a + b", "a * b").replace("sum(xs)", "len(xs)").replace("not x", "x")
    bad = scorer.score(fenced(wrong), truth)
    assert bad["score"] == 0.0 and bad["acc"] == 0.0 and bad["pass_rate"] < 1.0


def test_the_fraction_mode_scores_the_share_of_tests_passed(scorer):
    half_right = "def add(a, b):\n    return 3 if a == 1 else a + b + 1\n"  # passes test 1 of 3
    fraction = CodeScorer(CodeRewardConfig(sample_timeout_s=6.0, test_timeout_s=1.5, score="fraction"))
    assert fraction.score(fenced(half_right), MBPP)["score"] == pytest.approx(1 / 3)
    assert scorer.score(fenced(half_right), MBPP)["score"] == 0.0
    assert scorer.score(fenced(half_right), MBPP)["pass_rate"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "program, truth, flag",
    [
        ("def add(a, b) return a + b\n", MBPP, "syntax_error"),
        ("def add(a, b):\n    raise ValueError('no')\n", MBPP, None),
        ("import sys\nsys.setrecursionlimit(10**6)\ndef add(a, b):\n    return add(a, b)\n", ONE, None),
        ("def add(a, b):\n    while True:\n        pass\n", ONE, "timeout"),
        ("import time\ndef add(a, b):\n    time.sleep(60)\n", ONE, "timeout"),
        ("while True:\n    print('x' * 1000)\n", STDIO, None),  # floods its output
        ("print(input())\nimport os\nos.kill(os.getpid(), 11)\n", STDIO, None),  # a segfault
    ],
)
def test_wrong_crashing_and_looping_programs_score_0_within_their_limits(scorer, program, truth, flag):
    start = time.monotonic()
    result = scorer.score(fenced(program), truth)
    assert result["score"] == 0.0 and result["pass_rate"] == 0.0
    if flag:
        assert result[flag] == 1.0
    # every test stops at its own limit: 3 tests x 1.5 s, well inside the sample's 6 s budget
    assert time.monotonic() - start < FAST.sample_timeout_s + 1.5 + 2.0


HOSTILE = {
    "exits 0 before the asserts run": "import os\nos._exit(0)\n",
    "raises SystemExit(0)": "raise SystemExit(0)\n",
    "prints a forged report": f'print({RESULT_MARKER!r} + \'{{"tests": [{{"status": "done"}}]}}\')\n'
    "def add(a, b):\n    return -99\n",
    "kills its tester": "import os\nos.kill(os.getppid(), 9)\n",
    "forks its way out": "import os\nfor _ in range(64):\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "writes to its tester's output": "import os, json\n"
    f"line = {RESULT_MARKER!r} + json.dumps({{'tests': [{{'status': 'done'}}] * 3}}) + '\\n'\n"
    "try:\n    os.write(os.open(f'/proc/{os.getppid()}/fd/1', os.O_WRONLY), line.encode())\n"
    "except OSError:\n    pass\n",
    "returns an object equal to everything": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Any()\n",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_programs_score_0(scorer, name):
    """Each tries to pass without adding; the call format compares outside the program's process, so even
    an object that equals everything fails there (the assert format cannot stop that one: see below)."""
    truth = CALL if "equal to everything" in name else MBPP
    result = scorer.score(fenced(HOSTILE[name]), truth)
    assert result["score"] == 0.0 and result["pass_rate"] == 0.0, result
    assert scorer.score(fenced(ADD), MBPP)["score"] == 1.0  # and the next sample's sandbox is clean


def test_stdout_tests_cannot_be_passed_by_printing_a_report(scorer):
    forged = f'print({RESULT_MARKER!r} + \'{{"tests": [{{"status": "done", "stdout": "3"}}]}}\')\n'
    assert scorer.score(fenced(forged), STDIO)["score"] == 0.0


def test_samples_run_in_parallel_sandboxes_and_keep_their_order(scorer):
    items = [(fenced(ADD if i % 2 == 0 else ADD.replace("+", "-")), MBPP, None) for i in range(6)]
    parallel = CodeScorer(CodeRewardConfig(sample_timeout_s=6.0, test_timeout_s=1.5, max_concurrent=3))
    assert [r["score"] for r in parallel.score_many(items)] == [1.0, 0.0] * 3


def test_the_reward_manager_scores_code_and_rule_rows_of_one_batch(scorer, tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    texts = [fenced(ADD), fenced("def add(a, b):\n    return a\n"), "14+27=41", fenced(READ_ADD)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    data = DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        non_tensors={
            "data_source": ["mbpp", "code", "arithmetic", "apps"],
            "ground_truth": [MBPP, MBPP, "41", json.dumps(STDIO)],
            "extra_info": [None, None, {"a": 14, "b": 27}, None],
        },
    )
    manager = RewardManager(tokenizer, RuleScorers(CodeScorer(FAST)))
    out = manager(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out["reward_extra_info"]["pass_rate"][:2] == [1.0, 0.0]
    assert out["reward_extra_info"]["pass_rate"][2] is None  # the arithmetic row reports no such key


def test_a_run_with_malformed_tests_or_no_sandbox_fails_at_the_start(scorer, monkeypatch):
    rules = RuleScorers(CodeScorer(FAST))
    rows = [("f.parquet: row 0", "code", MBPP), ("f.parquet: row 1", "code", {"inputs": ["1"]})]
    with pytest.raises(InputError, match="f.parquet: row 1: no code tests found"):
        rules.check_rows(rows)
    assert rules.check_rows([("row 0", "arithmetic", "3")]) == 0  # no code rows: no sandbox needed
    monkeypatch.setattr(sandbox, "MODES", ("bwrap",))  # as root the sandbox does not use bubblewrap
    with pytest.raises(SandboxUnavailable, match="cannot isolate code"):
        rules.check_rows(rows[:1])


def test_a_test_cannot_write_into_the_report(scorer):
    """The reporting process is not dumpable: the program (same user id) cannot open its stdout via /proc."""
    from hybridflow.tools import run_python

    attack = (
        "import os\ntry:\n    os.write(os.open(f'/proc/{os.getppid()}/fd/1', os.O_WRONLY), b'PWNED\\n')\n"
    )
    program = attack + "except OSError:\n    pass\n" + ADD
    tests = parse_tests(MBPP)
    result = run_python(scorer.sandbox_code(program, tests), scorer.limits(tests))
    assert RESULT_MARKER in result.stdout and "PWNED" not in result.stdout


def test_the_trainer_refuses_a_malformed_code_row_before_training(tmp_path, tiny_model_path):
    from hybridflow.config import load_config
    from hybridflow.data.prepare import make_row, write_parquet
    from hybridflow.trainer import PPOTrainer

    rows = [make_row("code", [{"role": "user", "content": "Write add."}], "code", json.dumps(MBPP), {"i": 0})]
    rows.append(
        make_row("humaneval", [{"role": "user", "content": "Write f."}], "code", '{"test": "x"}', {"i": 1})
    )
    write_parquet(rows, tmp_path / "train.parquet")
    config = load_config(
        [
            f"data.train_files={tmp_path / 'train.parquet'}",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "algorithm.adv_estimator=grpo",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(
        InputError, match=r"train.parquet: row 1: a HumanEval test must be a string defining check"
    ):
        PPOTrainer(config)
