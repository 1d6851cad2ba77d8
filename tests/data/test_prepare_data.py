import json
import runpy
import sys

import pyarrow.parquet as pq
import pytest

from hybridflow.data import RLHFDataset
from hybridflow.data.prepare import arithmetic_splits, countdown_splits, main
from hybridflow.models import make_tiny_tokenizer
from hybridflow.rewards import default_compute_score


def read(path):
    return pq.read_table(path).to_pylist()


def operand_pairs(rows):
    return {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}


def countdown_problems(rows):
    truths = [json.loads(r["reward_model"]["ground_truth"]) for r in rows]
    return {(tuple(sorted(t["numbers"])), t["target"]) for t in truths}


def test_arithmetic_parquet_loads_and_splits_are_disjoint(tmp_path, capsys):
    assert main(["arithmetic", str(tmp_path), "--train-size", "300", "--test-size", "50", "--seed", "3"]) == 0
    assert "wrote 300 train and 50 test rows" in capsys.readouterr().out
    train, test = read(tmp_path / "train.parquet"), read(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (300, 50)
    assert len(operand_pairs(train)) == 300 and not operand_pairs(train) & operand_pairs(test)
    r = test[0]
    a, b = r["extra_info"]["a"], r["extra_info"]["b"]
    assert 10 <= a <= 99 and 10 <= b <= 99
    assert r["data_source"] == "arithmetic" and r["reward_model"]["ground_truth"] == str(a + b)
    assert r["prompt"] == [
        {"role": "user", "content": "Compute 14+27. Reply in the form 14+27=<answer>."},
        {"role": "assistant", "content": "14+27=41"},
        {"role": "user", "content": f"Compute {a}+{b}. Reply in the form {a}+{b}=<answer>."},
    ]
    assert r["extra_info"]["split"] == "test" and r["extra_info"]["index"] == 0

    ds = RLHFDataset(str(tmp_path / "test.parquet"), make_tiny_tokenizer(), max_prompt_length=128)
    assert len(ds) == 50 and ds.num_filtered == 0
    assert ds[0]["ground_truth"] == str(a + b) and ds[0]["raw_prompt"] == r["prompt"]


def test_generation_is_deterministic_per_seed():
    assert arithmetic_splits(20, 5, seed=1) == arithmetic_splits(20, 5, seed=1)
    assert arithmetic_splits(20, 5, seed=1) != arithmetic_splits(20, 5, seed=2)
    assert countdown_splits(20, 5, seed=1) == countdown_splits(20, 5, seed=1)
    with pytest.raises(ValueError, match=r"asked for 5\+1 addition problems .* but only 4 distinct"):
        arithmetic_splits(5, 1, seed=0, min_operand=1, max_operand=2)


def test_countdown_targets_are_reachable_and_splits_disjoint():
    train, test = countdown_splits(200, 40, seed=0)
    assert not countdown_problems(train) & countdown_problems(test)
    for r in train + test:
        truth = json.loads(r["reward_model"]["ground_truth"])
        assert len(truth["numbers"]) == 3 and 1 <= truth["target"] <= 100
        assert (
            f"Using the numbers {truth['numbers']}, create an equation that equals {truth['target']}."
            in (r["prompt"][0]["content"])
        )
        # The generator's own solution must earn full marks from the countdown scorer.
        solution = f"<answer>{r['extra_info']['solution']}</answer>"
        assert default_compute_score("countdown", solution, r["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_from_local_jsonl(tmp_path):
    src = tmp_path / "gsm.jsonl"
    src.write_text(
        "".join(
            json.dumps({"question": f"Q{i}?", "answer": f"work\n#### {1000 + i:,}"}) + "\n" for i in range(10)
        )
    )
    assert main(["gsm8k", str(tmp_path / "out"), "--source", str(src), "--test-fraction", "0.2"]) == 0
    train, test = read(tmp_path / "out" / "train.parquet"), read(tmp_path / "out" / "test.parquet")
    assert (len(train), len(test)) == (8, 2)
    questions = [r["extra_info"]["question"] for r in train + test]
    assert sorted(questions) == sorted(f"Q{i}?" for i in range(10))
    r = next(r for r in train + test if r["extra_info"]["question"] == "Q3?")
    assert r["reward_model"]["ground_truth"] == "1003" and r["data_source"] == "openai/gsm8k"
    assert r["prompt"][0]["content"].startswith("Q3? ") and "####" in r["prompt"][0]["content"]

    assert (
        main(
            [
                "gsm8k",
                str(tmp_path / "two"),
                "--source",
                str(src),
                "--test-source",
                str(src),
                "--train-size",
                "4",
            ]
        )
        == 0
    )
    assert len(read(tmp_path / "two" / "train.parquet")) == 4
    assert len(read(tmp_path / "two" / "test.parquet")) == 10

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 0: .*'#### N'"):
        main(["gsm8k", str(tmp_path / "x"), "--source", str(bad)])


@pytest.mark.filterwarnings("ignore:'hybridflow.data.prepare' found in sys.modules:RuntimeWarning")
def test_module_entry_point(tmp_path, monkeypatch, capsys):
    argv = ["prepare", "countdown", str(tmp_path), "--train-size", "8", "--test-size", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_module("hybridflow.data.prepare", run_name="__main__")
    assert done.value.code == 0
    assert "wrote 8 train and 2 test rows" in capsys.readouterr().out
    assert len(read(tmp_path / "train.parquet")) == 8
