"""Functions that change how many rows a DataProto has: padding to a divisor and back (what worker-group
dispatch does), and folding groups of rows into one row and back (verl's ``fold_batch_dim``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from tensordict import TensorDict

from hybridflow.protocol.dataproto import DataProto


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append copies of the first rows (cycling) so the length divides ``size_divisor``.
    Returns ``(padded, pad_size)``; ``unpad_dataproto`` removes them again."""
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be positive, got {size_divisor}")
    pad_size = -len(data) % size_divisor
    if pad_size == 0:
        return data, 0
    if len(data) == 0:
        raise ValueError("cannot pad an empty DataProto")
    return DataProto.concat([data, data[np.arange(pad_size) % len(data)]]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the ``pad_size`` rows that ``pad_dataproto_to_divisor`` appended."""
    return data[: len(data) - pad_size] if pad_size else data


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``[bsz, ...] -> [new_batch_size, bsz // new_batch_size, ...]`` for every tensor and non-tensor array:
    consecutive rows become one row (e.g. a prompt's ``n`` responses), so shuffling or reordering moves
    them together. ``unfold_batch_dim`` undoes it."""
    if new_batch_size <= 0 or len(data) % new_batch_size:
        raise ValueError(f"fold_batch_dim: {len(data)} rows do not fold into {new_batch_size} equal groups")

    return _reshaped(data, new_batch_size, lambda v: v.reshape(new_batch_size, -1, *v.shape[1:]))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Merge the first ``batch_dims`` dimensions of every tensor and array into the batch dimension
    (the inverse of ``fold_batch_dim`` with ``batch_dims=2``); they must agree across columns."""
    values = {**(dict(data.batch.items()) if data.batch is not None else {}), **data.non_tensor_batch}
    leading = {k: tuple(v.shape[:batch_dims]) for k, v in values.items()}
    if len(set(leading.values())) > 1 or any(len(s) < batch_dims for s in leading.values()):
        raise ValueError(
            f"unfold_batch_dim: the first {batch_dims} dimensions differ between columns: {leading}"
        )
    rows = math.prod(next(iter(leading.values()))) if leading else 0

    return _reshaped(data, rows, lambda v: v.reshape(rows, *v.shape[batch_dims:]))


def _reshaped(data: DataProto, rows: int, reshape: Callable[[Any], Any]) -> DataProto:
    """A DataProto of ``rows`` rows holding ``reshape`` of every tensor and array of ``data``."""
    batch = None
    if data.batch is not None:
        tensors = {k: reshape(v) for k, v in data.batch.items()}
        batch = TensorDict(tensors, batch_size=[rows], device=data.batch.device)
    columns = {k: reshape(v) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=columns, meta_info=data.meta_info)
