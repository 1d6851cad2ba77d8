"""What the type checker found in DataProto: keys given as any iterable, the typed ``tensors`` accessor, a
batch without tensors."""

import pytest
import torch
from tensordict import TensorDict

from hybridflow import DataProto
from hybridflow.protocol.columns import tensor_items


def make() -> DataProto:
    return DataProto.from_dict(
        {"a": torch.arange(2), "b": torch.ones(2)}, {"x": [1, 2], "y": [3, 4]}, {"m": 1, "k": 2}
    )


def test_select_takes_keys_from_a_generator():
    # the keys were checked and then listed from the same iterable: a generator came out empty
    picked = make().select(
        batch_keys=(k for k in ["a"]),
        non_tensor_batch_keys=(k for k in ["x"]),
        meta_info_keys=(k for k in ["m"]),
    )
    assert picked.keys() == ["a", "x"]
    assert picked.meta_info == {"m": 1}


def test_pop_takes_keys_from_a_generator():
    data = make()
    popped = data.pop(non_tensor_batch_keys=(k for k in ["y"]), meta_info_keys=iter(["k"]))
    assert list(popped.non_tensor_batch) == ["y"] and popped.meta_info == {"k": 2}
    assert list(data.non_tensor_batch) == ["x"] and data.meta_info == {"m": 1}


def test_rename_nothing_on_a_batch_without_tensors():
    data = DataProto.from_dict(non_tensors={"x": [1, 2]})
    assert data.rename([], []) is data  # was AttributeError: None has no rename_key_
    with pytest.raises(KeyError, match="batch has no key"):
        data.rename("a", "b")


def test_tensors_is_the_batch_or_an_error_naming_the_columns():
    data = make()
    assert data.tensors is data.batch
    data.tensors["c"] = torch.zeros(2)
    assert "c" in data.batch.keys()
    with pytest.raises(ValueError, match=r"holds no tensors \(batch is None\); its columns: \['x'\]"):
        _ = DataProto.from_dict(non_tensors={"x": [1, 2]}).tensors


def test_tensor_items_refuses_a_nested_tensordict():
    batch = TensorDict({"a": torch.zeros(2), "inner": TensorDict({"b": torch.ones(2)}, [2])}, [2])
    with pytest.raises(TypeError, match=r"batch\['inner'\] is a TensorDict"):
        tensor_items(batch)
    assert [k for k, _ in tensor_items(batch.exclude("inner"))] == ["a"]
