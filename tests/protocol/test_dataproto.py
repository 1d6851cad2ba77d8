import pickle

import numpy as np
import pytest
import torch

from hybridflow import DataProto, pad_dataproto_to_divisor, unpad_dataproto


def make(n: int = 4) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n * 2).view(n, 2), "y": torch.arange(n, dtype=torch.float32)},
        non_tensors={
            "uid": [f"u{i % 2}" for i in range(n)],
            "msgs": [[{"role": "user"}] * i for i in range(n)],
        },
        meta_info={"temperature": 1.0},
    )


def test_from_dict_keeps_list_values_as_single_elements():
    d = make(3)
    assert len(d) == 3
    assert d.non_tensor_batch["msgs"].shape == (3,)
    assert d.non_tensor_batch["msgs"][2] == [{"role": "user"}] * 2
    assert sorted(d.keys()) == ["msgs", "uid", "x", "y"]


def test_from_single_dict_sorts_tensors_from_lists():
    d = DataProto.from_single_dict({"a": torch.zeros(2, 3), "b": ["p", "q"], "c": np.array([1, 2])})
    assert list(d.batch.keys()) == ["a"]
    assert set(d.non_tensor_batch) == {"b", "c"}
    assert d.non_tensor_batch["c"].dtype == object


def test_mismatched_lengths_name_the_key():
    with pytest.raises(ValueError, match=r"'b'.*\{'a': 2, 'b': 3\}|sizes \{'a': 2, 'b': 3\}"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has length 3 but the batch has 2 rows"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"uid": ["a", "b", "c"]})


def test_item_and_row_selection():
    d = make(4)
    item = d[1]
    assert item.batch["x"].tolist() == [2, 3] and item.non_tensor_batch["uid"] == "u1"
    assert d[1:3].batch["y"].tolist() == [1.0, 2.0]
    assert d[[3, 0]].non_tensor_batch["uid"].tolist() == ["u1", "u0"]
    assert d[np.array([True, False, False, True])].batch["y"].tolist() == [0.0, 3.0]
    assert d[torch.tensor([2])].batch["x"].tolist() == [[4, 5]]
    assert d[-1].batch["y"].item() == 3.0
    with pytest.raises(IndexError, match="out of range"):
        d[4]
    with pytest.raises(IndexError, match="does not match DataProto of length 4"):
        d[np.array([True, False])]


def test_select_pop_and_unknown_keys():
    d = make(3)
    s = d.select(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(s.batch.keys()) == ["x"] and list(s.non_tensor_batch) == ["uid"] and s.meta_info == {}
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['z'\]; available: \['x', 'y'\]"):
        d.select(batch_keys=["z"])
    popped = d.pop(batch_keys=["y"], non_tensor_batch_keys=["msgs"], meta_info_keys=["temperature"])
    assert popped.batch["y"].tolist() == [0.0, 1.0, 2.0] and len(popped) == 3
    assert list(d.batch.keys()) == ["x"] and list(d.non_tensor_batch) == ["uid"] and d.meta_info == {}
    with pytest.raises(KeyError, match="non_tensor_batch has no key"):
        d.pop(non_tensor_batch_keys=["msgs"])


def test_union_merges_and_rejects_conflicts():
    d = make(2)
    other = DataProto.from_dict(
        {"z": torch.ones(2), "x": d.batch["x"].clone()}, {"uid": ["u0", "u1"]}, {"k": 1}
    )
    merged = d.union(other)
    assert merged is d and sorted(d.keys()) == ["msgs", "uid", "x", "y", "z"] and d.meta_info["k"] == 1
    with pytest.raises(ValueError, match="batch key 'x' exists in both with different values"):
        d.union(DataProto.from_dict({"x": torch.zeros(2, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid'"):
        d.union(DataProto.from_dict(non_tensors={"uid": ["a", "b"]}))
    with pytest.raises(ValueError, match=r"lengths differ \(2 vs 3\)"):
        d.union(make(3))


def test_concat_merges_metrics_from_every_part():
    a, b = make(2), make(3)
    a.meta_info["metrics"] = {"loss": 1.0, "n": [1, 2]}
    b.meta_info["metrics"] = {"loss": 3.0}
    c = DataProto.concat([a, b])
    assert len(c) == 5 and c.batch["y"].tolist() == [0, 1, 0, 1, 2]
    assert c.meta_info["metrics"] == {"loss": [1.0, 3.0], "n": [1, 2]}
    with pytest.raises(ValueError, match="different keys"):
        DataProto.concat([a, a.select(batch_keys=["x"])])


def test_chunk_split_and_non_dividing_length():
    d = make(6)
    assert [c.batch["y"].tolist() for c in d.chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [len(p) for p in d.split(4)] == [4, 2]
    # 6 rows in 4 chunks: the first two one longer, every row once, in order
    assert [c.batch["y"].tolist() for c in d.chunk(4)] == [[0, 1], [2, 3], [4], [5]]
    assert [c.non_tensor_batch["uid"].tolist() for c in d.chunk(4)] == [
        ["u0", "u1"],
        ["u0", "u1"],
        ["u0"],
        ["u1"],
    ]
    with pytest.raises(ValueError, match="number of chunks must be positive, got 0"):
        d.chunk(0)


def test_repeat_interleave_and_tile():
    d = make(2)
    assert d.repeat(3).batch["y"].tolist() == [0, 0, 0, 1, 1, 1]
    assert d.repeat(2, interleave=False).non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1"]


def test_reorder_and_to():
    d = make(3)
    d.reorder(torch.tensor([2, 0, 1]))
    assert d.batch["y"].tolist() == [2, 0, 1] and d.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1"]
    assert d.to("cpu").batch["x"].device.type == "cpu"


def test_group_by_and_merge_restore_order():
    d = make(5)
    groups = d.group_by("uid")
    assert list(groups) == ["u0", "u1"]
    assert groups["u1"][1].tolist() == [1, 3] and groups["u1"][0].batch["y"].tolist() == [1, 3]
    processed = []
    for label, (rows, idx) in groups.items():
        rows.batch["y"] = rows.batch["y"] * (10 if label == "u1" else -1)
        processed.append((rows, idx))
    merged = DataProto.merge_groups(processed)
    assert merged.batch["y"].tolist() == [0, 10, -2, 30, -4]
    by_fn = d.group_by(lambda data: (data.batch["y"] > 2).tolist())
    assert by_fn[True][1].tolist() == [3, 4]
    with pytest.raises(ValueError, match="every original row exactly once"):
        DataProto.merge_groups([processed[0]])
    with pytest.raises(KeyError, match="group_by: no column 'cat'"):
        d.group_by("cat")


def test_make_iterator_is_deterministic_for_a_seed():
    d = make(6)
    plain = [m.batch["y"].tolist() for m in d.make_iterator(2)]
    assert plain == [[0, 1], [2, 3], [4, 5]]
    first = [m.batch["y"].tolist() for m in d.make_iterator(3, epochs=2, shuffle=True, seed=7)]
    second = [m.batch["y"].tolist() for m in d.make_iterator(3, epochs=2, shuffle=True, seed=7)]
    assert first == second and len(first) == 4
    assert sorted(first[0] + first[1]) == [0, 1, 2, 3, 4, 5]
    assert first[:2] != first[2:]  # each epoch draws a fresh permutation


def test_pad_and_unpad():
    d = make(5)
    padded, pad = pad_dataproto_to_divisor(d, 4)
    assert pad == 3 and len(padded) == 8
    assert padded.batch["y"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert unpad_dataproto(padded, pad).batch["y"].tolist() == [0, 1, 2, 3, 4]
    same, zero = pad_dataproto_to_divisor(d, 5)
    assert zero == 0 and same is d
    tiny, pad = pad_dataproto_to_divisor(make(1), 4)
    assert pad == 3 and tiny.batch["y"].tolist() == [0, 0, 0, 0]


def test_pickle_carries_tensors_as_numpy(tmp_path):
    d = make(3)
    d.batch["h"] = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)
    state = d.__getstate__()
    assert all(isinstance(buffer, np.ndarray) for _, _, buffer in state["batch"][2].values())
    back = pickle.loads(pickle.dumps(d))
    assert torch.equal(back.batch["x"], d.batch["x"]) and back.batch["h"].dtype == torch.bfloat16
    assert back.batch["h"].tolist() == [1.5, 2.5, 3.5]
    assert back.non_tensor_batch["msgs"][1] == [{"role": "user"}]
    assert back.meta_info == {"temperature": 1.0}
    d.save_to_disk(tmp_path / "d.pkl")
    loaded = DataProto.load_from_disk(tmp_path / "d.pkl")
    assert torch.equal(loaded.batch["y"], d.batch["y"]) and loaded.non_tensor_batch["uid"].tolist() == [
        "u0",
        "u1",
        "u0",
    ]


def test_read_only_buffers_become_writable_tensors():
    d = make(2)
    state = d.__getstate__()
    for _, _, buffer in state["batch"][2].values():
        buffer.flags.writeable = False
    back = DataProto.__new__(DataProto)
    back.__setstate__(state)
    back.batch["y"] += 1  # would fail or corrupt a shared read-only buffer without the copy
    assert back.batch["y"].tolist() == [1.0, 2.0] and d.batch["y"].tolist() == [0.0, 1.0]
