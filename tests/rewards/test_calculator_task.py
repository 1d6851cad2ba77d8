"""The calculator task: its rows (one-shot tool call in the prompt) and its reward on whole conversations,
as the reward manager hands them over for multi-turn rollouts."""

import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data.prepare import calculator_splits, main
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager
from hybridflow.rewards.calculator import compute_score
from hybridflow.tools import parse_tool_calls


def conversation(answer: str, call_error: str | None = None) -> dict:
    calls = [
        {
            "turn": 1,
            "calls": [{"name": "calculator", "arguments": {"expression": "123*456"}, "error": call_error}],
        }
    ]
    messages = [
        {"role": "user", "content": "Compute 123*456."},
        {"role": "assistant", "content": "<tool_call>..."},
        {"role": "tool", "content": "56088"},
        {"role": "assistant", "content": answer},
    ]
    return {"a": 123, "b": 456, "messages": messages, "tool_calls": calls}


@pytest.mark.parametrize(
    ("answer", "call_error", "expected"),
    [
        ("123*456=56088", None, {"score": 1.0, "acc": 1.0, "tool_call_ok": 1.0}),
        ("56088", None, {"score": 0.5, "acc": 1.0, "tool_call_ok": 1.0}),
        ("123*456 = 56088, done", None, {"score": 0.5, "acc": 1.0, "tool_call_ok": 1.0}),
        ("123*456=56000", None, {"score": 0.1, "acc": 0.0, "tool_call_ok": 1.0}),
        ("123*456=56000", "not valid JSON", {"score": 0.0, "acc": 0.0, "tool_call_ok": 0.0}),
    ],
)
def test_score_reads_the_final_answer_and_the_tool_calls(answer, call_error, expected):
    assert (
        compute_score("ignored when messages are given", "56088", conversation(answer, call_error))
        == expected
    )


def test_single_turn_reply_is_scored_without_a_conversation():
    assert compute_score("123*456=56088", "56088", {"a": 123, "b": 456}) == {
        "score": 1.0,
        "acc": 1.0,
        "tool_call_ok": 0.0,
    }


def test_rows_hold_a_one_shot_tool_call_and_distinct_products(tmp_path):
    train, test = calculator_splits(50, 10, seed=1)
    pairs = [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in train + test]
    assert len(set(pairs)) == 60 and all(100 <= a <= 999 and 100 <= b <= 999 for a, b in pairs)
    row = test[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["reward_model"]["ground_truth"] == str(a * b) and row["data_source"] == "calculator"
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert (
        "<tool_call>" in row["prompt"][0]["content"] and row["prompt"][-1]["content"] == f"Compute {a}*{b}."
    )
    (call,) = parse_tool_calls(row["prompt"][2]["content"])
    assert call.arguments == {"expression": "314*271"} and row["prompt"][3]["content"] == "85094"
    assert main(["calculator", str(tmp_path), "--train-size", "5", "--test-size", "2"]) == 0
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 2


def test_reward_manager_hands_the_conversation_to_the_scorer():
    seen = []

    def scorer(data_source, solution_str, ground_truth, extra_info):
        seen.append(extra_info)
        return 1.0

    columns = {
        "data_source": ["calculator"],
        "ground_truth": ["1"],
        "extra_info": [{"a": 1}],
        "messages": [[{"role": "tool", "content": "1"}]],
        "tool_calls": [[]],
        "tool_rewards": [0.5],
    }
    batch = DataProto.from_dict(
        {"responses": torch.tensor([[5, 6]]), "response_mask": torch.tensor([[1, 0]])}, columns
    )
    RewardManager(_Tokenizer(), scorer)(batch)
    assert seen == [
        {"a": 1, "messages": [{"role": "tool", "content": "1"}], "tool_calls": [], "tool_rewards": 0.5}
    ]
    assert columns["extra_info"] == [{"a": 1}]  # the row's own extra_info is not changed


class _Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]
