"""verl's DataProto surface, as its docs and docstrings describe it, on our own cases (hand-computed values):
code written against ``verl.protocol`` runs with ``hybridflow.protocol`` and gives the same rows."""

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridflow.protocol import (
    DataProto,
    DataProtoConfig,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
)


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {"t": torch.arange(n) * 10}, {"name": [chr(ord("a") + i) for i in range(n)]}, {"step": 3}
    )


def test_chunk_splits_any_length_into_exactly_k_parts_first_ones_longer():
    parts = rows(7).chunk(3)
    assert [p.batch["t"].tolist() for p in parts] == [[0, 10, 20], [30, 40], [50, 60]]
    assert [p.non_tensor_batch["name"].tolist() for p in parts] == [["a", "b", "c"], ["d", "e"], ["f", "g"]]
    assert all(p.meta_info == {"step": 3} for p in parts)
    # more chunks than rows: empty tail chunks (torch.chunk would return fewer than asked)
    assert [len(p) for p in rows(2).chunk(3)] == [1, 1, 0]
    only_columns = DataProto.from_dict(non_tensors={"name": list("abcde")})
    assert [p.non_tensor_batch["name"].tolist() for p in only_columns.chunk(2)] == [
        ["a", "b", "c"],
        ["d", "e"],
    ]
    assert DataProto.concat(rows(7).chunk(3)).batch["t"].tolist() == rows(7).batch["t"].tolist()


def test_from_dict_keywords_and_none_non_tensor_batch():
    padded = DataProto.from_dict({"t": torch.zeros(3)}, meta_info={"k": 1}, auto_padding=True)
    assert padded.is_padding_enabled() and padded.meta_info["k"] == 1
    assert not DataProto.from_dict({"t": torch.zeros(3)}).is_padding_enabled()
    assert DataProto.from_single_dict({"t": torch.zeros(2)}, auto_padding=True).is_padding_enabled()
    with pytest.raises(ValueError, match="num_batch_dims=2, but a DataProto has exactly one batch dimension"):
        DataProto.from_dict({"t": torch.zeros(2, 3)}, num_batch_dims=2)
    # verl's check_consistency skipped None; ours did not
    built = DataProto(
        batch=TensorDict({"t": torch.arange(4)}, batch_size=[4]), non_tensor_batch=None, meta_info=None
    )
    assert len(built) == 4 and built.non_tensor_batch == {} and built.meta_info == {}
    assert len(built.chunk(2)[1]) == 2


def test_process_wide_auto_padding_switch(monkeypatch):
    data = rows(2)
    assert not data.is_padding_enabled()
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", False)
    DataProtoConfig.auto_padding = True
    assert data.is_padding_enabled() and DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert data.is_padding_enabled()
    with pytest.raises(TypeError, match="must be a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_sample_level_repeat_takes_a_count_per_row_in_any_sequence_type():
    data = rows(3)
    for counts in ([2, 0, 3], (2, 0, 3), torch.tensor([2, 0, 3]), np.array([2, 0, 3])):
        out = data.sample_level_repeat(counts)
        assert out.batch["t"].tolist() == [0, 0, 20, 20, 20]
        assert out.non_tensor_batch["name"].tolist() == ["a", "a", "c", "c", "c"]
        assert out.meta_info == {"step": 3}
    with pytest.raises(ValueError, match="must be 3 non-negative integers"):
        data.sample_level_repeat([1, 2])
    with pytest.raises(ValueError, match="must be 3 non-negative integers"):
        data.sample_level_repeat([1, -1, 1])


def test_to_and_from_tensordict_round_trip_nested_values():
    data = DataProto.from_dict(
        {"ids": torch.tensor([[1, 2], [3, 4]])},
        {"msgs": [[{"role": "user", "content": "hi"}], []], "scores": [[0.5, 0.8], None]},
        {"temperature": 0.7, "tags": ["a", "b"]},
    )
    td = data.to_tensordict()
    assert td.batch_size == torch.Size([2]) and td["ids"].tolist() == [[1, 2], [3, 4]]
    back = DataProto.from_tensordict(td)
    assert back.batch["ids"].tolist() == [[1, 2], [3, 4]]
    assert back.non_tensor_batch["msgs"].tolist() == [[{"role": "user", "content": "hi"}], []]
    assert back.non_tensor_batch["scores"][0] == [0.5, 0.8] and back.non_tensor_batch["scores"][1] is None
    assert back.meta_info == {"temperature": 0.7, "tags": ["a", "b"]}
    clash = DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"x": 1})
    with pytest.raises(ValueError, match=r"key\(s\) \['x'\] appear in more than one"):
        clash.to_tensordict()


def test_fold_groups_rows_and_unfold_restores_them_after_a_reorder():
    data = rows(3).repeat(2)  # a a b b c c
    folded = fold_batch_dim(data, new_batch_size=3)
    assert len(folded) == 3 and folded.batch["t"].tolist() == [[0, 0], [10, 10], [20, 20]]
    assert folded.non_tensor_batch["name"].tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]
    folded.reorder(torch.tensor([2, 0, 1]))  # the pairs move together
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert flat.batch["t"].tolist() == [20, 20, 0, 0, 10, 10]
    assert flat.non_tensor_batch["name"].tolist() == ["c", "c", "a", "a", "b", "b"]
    assert flat.meta_info == {"step": 3}
    with pytest.raises(ValueError, match="6 rows do not fold into 4 equal groups"):
        fold_batch_dim(data, 4)


def test_unfold_column_chunks_splits_the_named_columns_and_repeats_the_rest():
    pairs = DataProto.from_dict(
        {"pair": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "prompt": torch.tensor([100, 200])},
        meta_info={"k": 0},
    )
    pairs.non_tensor_batch["ids"] = np.array([["x1", "x2"], ["y1", "y2"]], dtype=object)
    out = pairs.unfold_column_chunks(2, split_keys=["pair", "ids"])
    assert out.batch["pair"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["prompt"].tolist() == [100, 100, 200, 200]
    assert out.non_tensor_batch["ids"].tolist() == [["x1"], ["x2"], ["y1"], ["y2"]]
    assert pairs.unfold_column_chunks(2).batch["pair"].shape == (4, 4)  # no split key: all repeated
    with pytest.raises(
        ValueError, match="column 'pair' of shape \\(2, 4\\) has no second dimension divisible by n_split=3"
    ):
        pairs.unfold_column_chunks(3, split_keys=["pair"])


def test_union_helpers_merge_and_name_the_conflicting_key():
    a = TensorDict({"x": torch.tensor([1.0, float("nan")])}, batch_size=[2])
    b = TensorDict({"x": torch.tensor([1.0, float("nan")]), "y": torch.ones(2)}, batch_size=[2])
    assert sorted(union_tensor_dict(a, b).keys()) == ["x", "y"]  # NaN in the same place: equal
    with pytest.raises(ValueError, match="batch key 'y' exists in both with different values"):
        union_tensor_dict(a, TensorDict({"y": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(ValueError, match=r"batch sizes differ \(\[2\] vs \[3\]\)"):
        union_tensor_dict(a, TensorDict({}, batch_size=[3]))
    left = {"s": np.array(["p", float("nan")], dtype=object)}
    merged = union_numpy_dict(left, {"s": np.array(["p", float("nan")], dtype=object), "t": np.array([1, 2])})
    assert merged is left and sorted(merged) == ["s", "t"]
    with pytest.raises(ValueError, match="non_tensor_batch key 's' exists in both with different values"):
        union_numpy_dict(left, {"s": np.array(["p", "q"], dtype=object)})
    assert list_of_dict_to_dict_of_list([{"a": 1}, {"a": 2, "b": 3}]) == {"a": [1, 2], "b": [3]}


def test_union_of_dataprotos_checks_meta_info_too():
    data = rows(2)
    with pytest.raises(
        ValueError, match="meta_info key 'step' exists in both with different values \\(3 vs 4\\)"
    ):
        data.union(DataProto.from_dict({"u": torch.zeros(2)}, meta_info={"step": 4}))
    assert "u" not in data.batch.keys()  # nothing half-merged before the error


def test_serialisation_helpers_round_trip_every_dtype_and_nested_tensors():
    for tensor in (
        torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.arange(6).view(2, 3),
    ):
        dtype, shape, buffer = serialize_single_tensor(tensor)
        assert buffer.dtype == np.uint8 and shape == tuple(tensor.shape)
        back = deserialize_single_tensor((dtype, shape, buffer))
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    jagged = torch.nested.as_nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    batch = TensorDict({"j": jagged, "d": torch.tensor([7, 8])}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(batch))
    assert [t.tolist() for t in back["j"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
    assert back["d"].tolist() == [7, 8] and back.batch_size == torch.Size([2])
    empty = DataProto(batch=TensorDict({}, batch_size=[3]))
    assert len(pickle.loads(pickle.dumps(empty))) == 3


def test_concat_merges_workers_metrics_into_one_dict_of_lists():
    parts = [rows(1), rows(1), rows(1)]
    parts[0].meta_info["metrics"] = [{"loss": 0.5, "acc": 0.9}]  # verl's workers: a list of dicts
    parts[1].meta_info["metrics"] = {"loss": 0.7}  # or one dict
    parts[2].meta_info["metrics"] = {"loss": [0.1, 0.3], "grad": 2.0}  # a value per micro-batch
    merged = DataProto.concat(parts)
    assert merged.meta_info["metrics"] == {"loss": [0.5, 0.7, 0.1, 0.3], "acc": [0.9], "grad": [2.0]}
    first_without = [rows(1), rows(1)]
    first_without[1].meta_info["metrics"] = {"loss": 0.6}
    assert DataProto.concat(first_without).meta_info == {"step": 3, "metrics": {"loss": [0.6]}}


def test_concat_merges_other_meta_info_keys_and_refuses_conflicts():
    a, b = rows(1), rows(1)
    a.meta_info["only_a"], b.meta_info["only_b"] = "A", "B"
    assert DataProto.concat([a, b]).meta_info == {"step": 3, "only_a": "A", "only_b": "B"}
    b.meta_info["step"] = 4
    with pytest.raises(
        ValueError, match="concat: meta_info key 'step' exists in both with different values \\(3 vs 4\\)"
    ):
        DataProto.concat([a, b])


def test_select_idxs_slice_rename_padding_and_indexing_types():
    data = rows(4)
    assert data.select_idxs([3, 1]).batch["t"].tolist() == [30, 10]
    assert data.select_idxs(np.array([True, False, True, False])).non_tensor_batch["name"].tolist() == [
        "a",
        "c",
    ]
    assert data.slice(1, None, 2).batch["t"].tolist() == [10, 30]
    deep = data.select(non_tensor_batch_keys=["name"], deepcopy=True)
    deep.non_tensor_batch["name"][0] = "z"
    assert data.non_tensor_batch["name"][0] == "a"
    assert data.rename("t", "tokens") is data and list(data.batch.keys()) == ["tokens"]
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['t'\]"):
        data.rename(["t"], ["u"])
    first = rows(3)
    first.padding(2, "first")
    assert first.batch["t"].tolist() == [0, 10, 20, 0, 0]
    last = rows(3)
    last.padding(1)
    assert last.non_tensor_batch["name"].tolist() == ["a", "b", "c", "c"]
    assert rows(2).repeat().batch["t"].tolist() == [0, 0, 10, 10]  # repeat_times defaults to 2
    with pytest.raises(TypeError, match="not str"):
        rows(2)["t"]


def test_make_iterator_takes_verls_seed_and_dataloader_kwargs():
    data = rows(6)
    generator = torch.Generator().manual_seed(5)
    expected = [(torch.randperm(6, generator=generator) * 10).tolist() for _ in range(2)]
    got = [m.batch["t"].tolist() for m in data.make_iterator(3, 2, 5, {"shuffle": True})]
    assert got == [expected[0][:3], expected[0][3:], expected[1][:3], expected[1][3:]]
    assert [m.batch["t"].tolist() for m in data.make_iterator(2, 1, 5)] == [[0, 10], [20, 30], [40, 50]]
    assert [len(m) for m in data.make_iterator(4, dataloader_kwargs={"drop_last": True})] == [4]
    with pytest.raises(ValueError, match=r"dataloader_kwargs \['num_workers'\] are not supported"):
        next(data.make_iterator(2, dataloader_kwargs={"num_workers": 2}))


def test_size_and_data_info_reports():
    data = DataProto.from_dict(
        {"ids": torch.zeros(2, 3, dtype=torch.int64)}, {"s": ["a", "b"]}, {"n": 2, "tags": ["x"]}
    )
    info = data.get_data_info().splitlines()
    assert info == [
        "batch",
        "  ids: (2, 3) (torch.int64) cpu",
        "non_tensor_batch",
        "  s: ndarray(2,) (object)",
        "meta_info",
        "  n: int",
        "  tags: list[str]",
    ]


def test_subclasses_survive_building_and_reshaping():
    class MyProto(DataProto):
        pass

    data = MyProto.from_single_dict({"t": torch.arange(4)})
    assert type(data) is MyProto
    assert type(data[1:3]) is type(data.chunk(2)[0]) is type(DataProto.concat([data, data])) is MyProto
