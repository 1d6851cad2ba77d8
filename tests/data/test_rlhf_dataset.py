import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import PromptLoader, RLHFDataset, collate_fn
from hybridflow.data.dataset import left_pad
from hybridflow.models import make_tiny_tokenizer
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def row(question: str, answer: str, source: str = "arithmetic", **extra) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": extra or None,
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_left_pad_by_hand():
    out = left_pad([5, 6, 7], 5, pad_id=2)
    assert out["input_ids"].tolist() == [2, 2, 5, 6, 7]
    assert out["attention_mask"].tolist() == [0, 0, 1, 1, 1]
    assert out["position_ids"].tolist() == [0, 0, 0, 1, 2]
    assert out["input_ids"].dtype == torch.long


def test_parquet_and_jsonl_with_chat_template(tmp_path, tok):
    pq_file = write_parquet(
        tmp_path / "a.parquet", [row("Compute 1+2.", "3", a=1, b=2), row("Hi", "x", a=0, b=0)]
    )
    jl_file = write_jsonl(tmp_path / "b.jsonl", [row("Compute 3+4.", "7", "countdown")])
    ds = RLHFDataset([pq_file, jl_file], tok, max_prompt_length=32)
    assert len(ds) == 3
    item = ds[2]
    assert item["data_source"] == "countdown" and item["ground_truth"] == "7"
    assert item["raw_prompt"] == [{"role": "user", "content": "Compute 3+4."}]
    assert item["index"] == 2 and item["extra_info"] == {}
    first = ds[0]
    assert first["extra_info"] == {"a": 1, "b": 2} and first["index"] == 0
    expected = "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(expected, add_special_tokens=False)["input_ids"]
    n = len(ids)
    assert first["input_ids"].shape == (32,)
    assert first["input_ids"][-n:].tolist() == ids
    assert first["input_ids"][:-n].eq(tok.pad_token_id).all()
    assert first["attention_mask"].tolist() == [0] * (32 - n) + [1] * n
    assert first["position_ids"].tolist() == [0] * (32 - n) + list(range(n))
    assert tok.decode(first["input_ids"][-n:]) == expected
    assert "<|im_start|>assistant" in tok.decode(first["input_ids"])


def test_plain_string_prompt_and_no_chat_template(tmp_path, tok):
    f = write_jsonl(tmp_path / "s.jsonl", [{"data_source": "gsm8k", "prompt": "What is 2+2?"}])
    item = RLHFDataset(f, tok, max_prompt_length=32)[0]
    assert item["raw_prompt"] == [{"role": "user", "content": "What is 2+2?"}]
    assert item["ground_truth"] is None
    raw = RLHFDataset(f, tok, max_prompt_length=16, apply_chat_template=False)[0]
    n = int(raw["attention_mask"].sum())
    assert tok.decode(raw["input_ids"][-n:]) == "What is 2+2?"


def test_truncation_modes(tmp_path, tok):
    long_q = "one two three four five six seven eight nine ten " * 3
    f = write_jsonl(tmp_path / "long.jsonl", [row("short", "1"), row(long_q, "2")])
    full = tok(
        tok.apply_chat_template(
            [{"role": "user", "content": long_q}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )["input_ids"]
    assert len(full) > 20
    with pytest.raises(
        ValueError, match=r"long\.jsonl: row 1: prompt has \d+ tokens, more than max_prompt_length=20"
    ):
        RLHFDataset(f, tok, max_prompt_length=20, filter_overlong_prompts=False, truncation="error")
    left = RLHFDataset(f, tok, max_prompt_length=20, filter_overlong_prompts=False, truncation="left")
    right = RLHFDataset(f, tok, max_prompt_length=20, filter_overlong_prompts=False, truncation="right")
    assert left[1]["input_ids"].tolist() == full[-20:]
    assert right[1]["input_ids"].tolist() == full[:20]
    assert left[1]["attention_mask"].all() and left.num_filtered == 0
    with pytest.raises(ValueError, match="truncation='middle'"):
        RLHFDataset(f, tok, truncation="middle")


def test_filter_overlong_counts_and_logs(tmp_path, tok, caplog):
    long_q = "word " * 40
    f = write_parquet(
        tmp_path / "mix.parquet", [row("a", "1"), row(long_q, "2"), row("b", "3"), row(long_q, "4")]
    )
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLHFDataset(f, tok, max_prompt_length=24)
    assert ds.num_filtered == 2 and len(ds) == 2
    assert [ds[i]["ground_truth"] for i in range(2)] == ["1", "3"]
    assert [ds[i]["index"] for i in range(2)] == [0, 2]
    assert "dropped 2 of 4 prompts" in caplog.text and "mix.parquet:1" in caplog.text
    with pytest.raises(ValueError, match="all 4 are longer than 2 tokens"):
        RLHFDataset(f, tok, max_prompt_length=2)


@pytest.mark.parametrize(
    "bad, pattern",
    [
        ({"data_source": "x"}, r"row 1: field 'prompt' is missing"),
        ({"prompt": 7}, r"row 1: field 'prompt': must be a string or a non-empty list"),
        (
            {"prompt": [{"role": "user"}]},
            r"row 1: field 'prompt'\[0\]: a chat message needs string 'role' and 'content'",
        ),
        ({"prompt": "hi", "reward_model": "42"}, r"row 1: field 'reward_model' must be an object"),
        ({"prompt": "hi", "extra_info": [1]}, r"row 1: field 'extra_info' must be an object"),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, tok, bad, pattern):
    f = write_jsonl(tmp_path / "bad.jsonl", [row("fine", "1"), bad])
    with pytest.raises(ValueError, match=pattern) as err:
        RLHFDataset(f, tok)
    assert str(err.value).startswith(f"{f}: row 1")


def test_missing_and_unknown_files(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tok)
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="unknown data file type '.csv'"):
        RLHFDataset(str(tmp_path / "d.csv"), tok)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl: line 2 is not valid JSON"):
        RLHFDataset(str(tmp_path / "broken.jsonl"), tok)


def test_collate_builds_dataproto(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [row(f"q{i}", str(i), a=i) for i in range(3)])
    ds = RLHFDataset(f, tok, max_prompt_length=16)
    batch = collate_fn([ds[2], ds[0]])
    assert isinstance(batch, DataProto) and len(batch) == 2
    assert sorted(batch.batch.keys()) == ["attention_mask", "input_ids", "position_ids"]
    # padded to 16, but the batch keeps only as many columns as its longest prompt needs
    longest = max(int(ds[i]["attention_mask"].sum()) for i in (2, 0))
    assert longest < 16
    assert batch.batch["input_ids"].shape == (2, longest) and batch.batch["input_ids"].dtype == torch.long
    assert torch.equal(batch.batch["input_ids"][0], ds[2]["input_ids"][-longest:])
    assert batch.batch["attention_mask"].any(dim=0).all()  # no column is padding in every row
    assert torch.equal(batch.batch["position_ids"][1], ds[0]["position_ids"][-longest:])
    nt = batch.non_tensor_batch
    assert sorted(nt) == [
        "data_row",
        "data_source",
        "extra_info",
        "ground_truth",
        "index",
        "raw_prompt",
        "uid",
    ]
    assert nt["data_row"][0] == row("q2", "2", a=2)  # the row as the file holds it (a served agent's sample)
    assert all(v.dtype == object and v.shape == (2,) for v in nt.values())
    assert nt["ground_truth"].tolist() == ["2", "0"]
    assert nt["raw_prompt"][0] == [{"role": "user", "content": "q2"}]
    assert nt["extra_info"][1] == {"a": 0}
    assert len(set(nt["uid"])) == 2 and all(isinstance(u, str) and len(u) == 36 for u in nt["uid"])
    assert collate_fn([ds[0]]).non_tensor_batch["uid"][0] != nt["uid"][1]


def _indices(batch: DataProto) -> list[int]:
    return batch.non_tensor_batch["index"].tolist()


def test_prompt_loader_epochs_and_resume(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [row(f"q{i}", str(i)) for i in range(10)])
    ds = RLHFDataset(f, tok, max_prompt_length=16)
    loader = PromptLoader(ds, batch_size=3, seed=7)
    assert len(loader) == 3 and len(PromptLoader(ds, 3, drop_last=False)) == 4
    epoch0 = [_indices(b) for b in loader]
    epoch1 = [_indices(b) for b in loader]
    assert loader.epoch == 1
    flat0 = sum(epoch0, [])
    assert len(flat0) == 9 and len(set(flat0)) == 9 and flat0 != sorted(flat0)
    assert epoch0 != epoch1
    assert list(np.random.default_rng([7, 0]).permutation(10)[:9]) == flat0

    # A fresh loader replays epoch 0, then stops after the 2nd batch of epoch 1 and is saved.
    fresh = PromptLoader(ds, batch_size=3, seed=7)
    assert [_indices(b) for b in fresh] == epoch0
    it = iter(fresh)
    assert [_indices(next(it)), _indices(next(it))] == epoch1[:2]
    state = fresh.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    resumed = PromptLoader(ds, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert [_indices(b) for b in resumed] == epoch1[2:]
    assert [_indices(next(it))] == epoch1[2:]
    # Saved right after an epoch's last batch: both continue with the same next epoch.
    at_end = PromptLoader(ds, batch_size=3, seed=7)
    at_end.load_state_dict(fresh.state_dict())
    assert [_indices(b) for b in at_end] == [_indices(b) for b in fresh]
    assert at_end.epoch == fresh.epoch == 2


def test_prompt_loader_errors(tmp_path, tok):
    f = write_jsonl(tmp_path / "e.jsonl", [row(f"q{i}", str(i)) for i in range(4)])
    ds = RLHFDataset(f, tok, max_prompt_length=16)
    with pytest.raises(ValueError, match="4 rows, fewer than batch_size=5"):
        PromptLoader(ds, batch_size=5)
    state = PromptLoader(ds, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has seed=2"):
        PromptLoader(ds, batch_size=2, seed=2).load_state_dict(state)
    no_shuffle = PromptLoader(ds, batch_size=2, shuffle=False)
    assert [_indices(b) for b in no_shuffle] == [[0, 1], [2, 3]]
