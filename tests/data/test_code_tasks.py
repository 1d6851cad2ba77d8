"""prepare-data humaneval / code: rows the code scorer reads, whose reference solutions pass in the sandbox."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from hybridflow.config.schema import CodeRewardConfig
from hybridflow.data.code_tasks import function_solution, function_splits
from hybridflow.data.prepare import main
from hybridflow.rewards import CodeScorer, default_compute_score
from hybridflow.rewards.code_tests import parse_tests
from hybridflow.tools import sandbox
from hybridflow.tools.sandbox import SandboxUnavailable
from hybridflow.utils.errors import InputError


def read(path):
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def scorer() -> CodeScorer:
    try:
        sandbox.sandbox_mode()
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    return CodeScorer(CodeRewardConfig(sample_timeout_s=10.0, test_timeout_s=5.0))


def test_humaneval_comes_from_the_wheel_and_its_canonical_solutions_pass(tmp_path, scorer, capsys):
    assert main(["humaneval", str(tmp_path), "--test-size", "150"]) == 0
    assert "wrote 14 train and 150 test rows" in capsys.readouterr().out
    rows = read(tmp_path / "train.parquet") + read(tmp_path / "test.parquet")
    assert len(rows) == 164 and len({r["extra_info"]["task_id"] for r in rows}) == 164
    row = rows[0]
    truth = json.loads(row["reward_model"]["ground_truth"])
    assert row["data_source"] == "humaneval" and set(truth) == {"prompt", "test", "entry_point"}
    assert truth["prompt"] in row["prompt"][0]["content"]
    # the canonical solution as a bare completion of the prompt, and as a whole function in a fence
    items = [
        (r["extra_info"]["canonical_solution"], r["reward_model"]["ground_truth"], None) for r in rows[:6]
    ]
    whole = [
        (f"```python\n{json.loads(t)['prompt']}{s}```", t, None) for s, t, _ in items[:2]
    ]  # the prompt's own def
    assert [r["score"] for r in scorer.score_many(items + whole)] == [1.0] * 8
    broken = items[0][0].replace("return", "return not", 1)
    assert scorer.score(broken, items[0][1])["score"] == 0.0


def test_code_source_reads_mbpp_stdin_and_call_rows(tmp_path, scorer):
    source = tmp_path / "problems.jsonl"
    problems = [
        {"task_id": 1, "text": "Write a function add.", "test_list": ["assert add(1, 2) == 3"]},
        {"id": "p2", "question": "Print the sum of two numbers.", "inputs": ["1 2\n"], "outputs": ["3\n"]},
        {
            "question": "Return a+b.",
            "input_output": json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}),
        },
    ]
    source.write_text("".join(json.dumps(p) + "\n" for p in problems))
    assert main(["code", str(tmp_path / "out"), "--source", str(source), "--test-fraction", "0"]) == 0
    rows = sorted(read(tmp_path / "out" / "train.parquet"), key=lambda r: r["extra_info"]["format"])
    assert [r["extra_info"]["format"] for r in rows] == ["asserts", "call", "stdio"]
    assert "assert add(1, 2) == 3" in rows[0]["prompt"][0]["content"]  # the function's name is shown
    answers = ["def add(a, b):\n    return a + b\n"] * 2 + [
        "a, b = map(int, input().split())\nprint(a + b)\n"
    ]
    for row, answer in zip(rows, answers):
        assert (
            default_compute_score(row["data_source"], answer, row["reward_model"]["ground_truth"])["score"]
            == 1.0
        )
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x", "inputs": ["1"]}) + "\n")
    with pytest.raises(InputError, match=r"bad.jsonl: row 0: no code tests found"):
        main(["code", str(tmp_path / "out2"), "--source", str(tmp_path / "bad.jsonl")])


def test_the_generated_function_task_is_disjoint_and_its_references_pass(scorer):
    train, test = function_splits(120, 60, seed=0)
    key = lambda r: (r["extra_info"]["op"], r["extra_info"]["n"])  # noqa: E731
    assert len({key(r) for r in train + test}) == 180 and not {key(r) for r in train} & {key(r) for r in test}
    row = test[0]
    op, n = key(row)
    assert row["prompt"][1]["content"] == function_solution("times", 3)  # the one-shot answer
    tests = parse_tests(row["reward_model"]["ground_truth"])
    assert tests.kind == "asserts" and len(tests) == 5
    picked = train[:4]
    items = [(function_solution(*key(r)), r["reward_model"]["ground_truth"], None) for r in picked]
    assert [r["score"] for r in scorer.score_many(items)] == [1.0] * 4
    assert scorer.score(function_solution("times", 3), row["reward_model"]["ground_truth"])["score"] == 0.0
