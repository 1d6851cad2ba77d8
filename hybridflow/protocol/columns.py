"""What DataProto does to its columns, as functions verl users know: merging two sets of columns under the
one conflict rule, comparing values, merging workers' metrics, and turning tensors into bytes and back.

The conflict rule (``union_tensor_dict``, ``union_numpy_dict``, ``DataProto.union`` and ``DataProto.concat``'s
``meta_info``): a key present on both sides must hold equal values, NaN equal to NaN; anything else is a
ValueError naming the key, because silently keeping one of two different ``old_log_probs`` would corrupt
training without a trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "list_of_dict_to_dict_of_list",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
    "values_equal",
]


def object_array(values: Any) -> np.ndarray:
    """1-D object array of the given values; element by element, so lists stay single elements."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN equal to NaN at the same places."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def values_equal(a: Any, b: Any) -> bool:
    """Deep equality for column and meta values: tensors, numpy arrays (object ones element by element),
    lists, dicts and scalars; NaN equals NaN (a float column with a missing value equals itself)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        return a.shape == b.shape and all(values_equal(x, y) for x, y in zip(a.flat, b.flat, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return a is b


def _first_conflict(dict1: Any, dict2: Any, equal: Callable[[Any, Any], bool]) -> str | None:
    """The first key of ``dict2`` that ``dict1`` holds with a value ``equal`` does not accept, else None."""
    return next((k for k in dict2.keys() if k in dict1.keys() and not equal(dict1[k], dict2[k])), None)


def check_union(
    kind: str, dict1: Any, dict2: Any, what: str = "union", equal: Callable[[Any, Any], bool] = values_equal
) -> None:
    """Raise ValueError naming the first key of ``dict2`` whose value in ``dict1`` differs."""
    key = _first_conflict(dict1, dict2, equal)
    if key is None:
        return
    values = (dict1[key], dict2[key])
    shown = (
        ""
        if any(isinstance(v, torch.Tensor | np.ndarray) for v in values)
        else " ({!r:.60} vs {!r:.60})".format(*values)
    )
    raise ValueError(f"{what}: {kind} key {key!r} exists in both with different values{shown}")


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` (in place; returned). Both need the same batch size;
    a key in both must hold equal tensors, else ValueError naming it (and nothing is added)."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"union_tensor_dict: batch sizes differ ({list(tensor_dict1.batch_size)} vs "
            f"{list(tensor_dict2.batch_size)})"
        )
    check_union("batch", tensor_dict1, tensor_dict2, equal=tensors_equal)
    for key, value in tensor_dict2.items():
        tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``dict2``'s arrays to ``dict1`` (in place; returned); a key in both must hold equal arrays
    (``values_equal``: element by element, NaN equal), else ValueError naming it (and nothing is added)."""
    check_union("non_tensor_batch", dict1, dict2)
    dict1.update(dict2)
    return dict1


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{"a": 1}, {"a": 2, "b": 3}] -> {"a": [1, 2], "b": [3]}``: every key of every dict, in order of
    first appearance (verl's version fails on a key the first dict lacks)."""
    out: dict[str, list[Any]] = {}
    for entry in list_of_dict:
        for key, value in entry.items():
            out.setdefault(key, []).append(value)
    return out


def merge_metrics(parts: Sequence[Any]) -> dict[str, list[Any]]:
    """Workers' ``meta_info["metrics"]`` (each a dict, or a list of dicts as verl's workers give) as one dict
    of lists: each key keeps every part's values in order; a value that is itself a list (one per
    micro-batch) is spliced in, so ranks with different micro-batch counts still average correctly."""
    entries: list[dict[str, Any]] = []
    for metrics in parts:
        if isinstance(metrics, dict):
            entries.append(metrics)
        elif isinstance(metrics, list | tuple):
            entries.extend(metrics)
    merged: dict[str, list[Any]] = {}
    for key, values in list_of_dict_to_dict_of_list(entries).items():
        merged[key] = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return merged


def top_keys(batch: TensorDict) -> list[str]:
    """``batch``'s top-level keys as strings: tensordict types a key as a nested key (``str | tuple``), which
    ``keys()`` without ``include_nested`` never yields."""
    return [cast(str, key) for key in batch.keys()]


def tensor_items(batch: TensorDict) -> list[tuple[str, torch.Tensor]]:
    """``batch``'s ``(key, tensor)`` pairs; a TypeError naming the key where a value is not a tensor (a
    DataProto's columns are tensors, while tensordict allows nested TensorDicts too)."""
    items = []
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"batch[{key!r}] is a {type(value).__name__}; a DataProto's tensors are torch tensors"
            )
        items.append((key, value))
    return items


# ------------------------------------------------------------------ tensors as bytes
SerializedTensor = tuple[str, tuple[int, ...], np.ndarray]


def serialize_single_tensor(tensor: torch.Tensor) -> SerializedTensor:
    """``(dtype name, shape, uint8 numpy buffer)``: numpy has no bfloat16, bytes carry every dtype; Ray
    passes the buffer zero-copy through its object store (a torch tensor takes a slow copying path)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy()


def deserialize_single_tensor(encoded: SerializedTensor) -> torch.Tensor:
    """Inverse of ``serialize_single_tensor``; a read-only buffer (straight out of Ray's object store) is
    copied first, since torch needs writable memory."""
    dtype_name, shape, buffer = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"deserialize_single_tensor: {dtype_name!r} is not a torch dtype")
    buffer = np.asarray(buffer, dtype=np.uint8)
    raw = torch.from_numpy(buffer if buffer.flags.writeable else buffer.copy())
    return raw.view(dtype).reshape(shape)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, Any]]:
    """``(batch size, device, {key: encoded})``; a nested (jagged) tensor is encoded as
    ``(layout, [each component encoded])``."""
    items: dict[str, Any] = {}
    for key, value in tensor_items(batch):
        if value.is_nested:
            items[key] = (
                str(value.layout).removeprefix("torch."),
                [serialize_single_tensor(t) for t in value.unbind()],
            )
        else:
            items[key] = serialize_single_tensor(value)
    device = str(batch.device) if batch.device is not None else None
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(encoded: tuple[tuple[int, ...], str | None, dict[str, Any]]) -> TensorDict:
    """Inverse of ``serialize_tensordict``."""
    batch_size, device, items = encoded
    decoded = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(p) for p in parts], layout=getattr(torch, layout)
            )
        else:
            raise ValueError(f"deserialize_tensordict: key {key!r} has {len(value)} fields, not 2 or 3")
    return TensorDict(decoded, batch_size=list(batch_size), device=device)


def is_object_column(value: Any) -> bool:
    """A 1-D numpy array of Python objects: a non-tensor column as DataProto stores it."""
    return isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 1


def type_info(value: Any) -> str:
    """``list[int]``, ``dict[str: float]``, ``ndarray(3,) (int64)``: the shape of a meta value for a log line."""
    if isinstance(value, list):
        return f"list[{'|'.join(sorted({type_info(v) for v in value[:3]})) or '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, item = next(iter(value.items()))
        return f"dict[{type_info(key)}: {type_info(item)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__
