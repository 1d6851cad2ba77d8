"""DataProto: the one batch type that flows between the driver and the workers.

Every worker-group call takes and returns a ``DataProto``: named tensors (a ``TensorDict`` whose batch size
is ``[N]``), named non-tensor columns (numpy object arrays of length ``N``: raw prompts, ground truths,
group ids) and free-form ``meta_info`` (sampling settings, metrics).  Everything indexes along one batch
axis, so a batch can be split across data-parallel ranks, repeated for ``n`` samples per prompt, routed
by category and merged back without any field drifting out of step with the others.

Pickling (which is what Ray does to cross process boundaries) carries tensors as numpy buffers: Ray passes
numpy zero-copy through its object store, while torch tensors go through a slow copying path
(measured on a 2-core machine: 0.2 s against 3.5-6.8 s for a 302 MB round trip).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"]

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _object_array(values: Iterable[Any]) -> np.ndarray:
    """1-D object array of the given values; element by element, so lists stay single elements."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
        return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.flat, b.flat))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return a is b


def _merge_metrics(parts: Sequence[dict]) -> dict[str, list]:
    """Metrics from several workers or chunks: each key keeps every part's values, flattened into a list."""
    merged: dict[str, list] = {}
    for metrics in parts:
        for key, value in metrics.items():
            merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return merged


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` has no batch dimension, non-tensor values are plain objects."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: dict


@dataclass
class DataProto:
    """A batch of ``N`` rows: ``batch`` (TensorDict, batch size ``[N]``), ``non_tensor_batch``
    (numpy object arrays of length ``N``) and ``meta_info`` (not indexed)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Build from named tensors (all with the same first dimension) and non-tensor columns."""
        tensors, non_tensors = tensors or {}, non_tensors or {}
        batch = None
        if tensors:
            sizes = {k: (v.shape[0] if v.dim() else None) for k, v in tensors.items()}
            if len(set(sizes.values())) != 1 or None in sizes.values():
                raise ValueError(f"DataProto tensors must share their first dimension; got sizes {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        columns = {k: v if _is_object_column(v) else _object_array(v) for k, v in non_tensors.items()}
        return cls(batch=batch, non_tensor_batch=columns, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Build from one dict: torch tensors go to ``batch``, lists and numpy arrays to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        bad = [k for k, v in others.items() if not isinstance(v, list | tuple | np.ndarray)]
        if bad:
            raise ValueError(f"from_single_dict: values must be tensors, lists or numpy arrays; not {bad}")
        return cls.from_dict(tensors, others, meta_info)

    def check_consistency(self) -> None:
        """Every tensor and non-tensor column has the same length ``N``; raises naming the culprit."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(
                f"DataProto.batch must have one batch dimension, got {list(self.batch.batch_size)}"
            )
        n = self.batch.batch_size[0] if self.batch is not None else None
        for key, value in self.non_tensor_batch.items():
            if not _is_object_column(value):
                raise ValueError(
                    f"non_tensor_batch[{key!r}] must be a 1-D numpy object array, got {type(value)}"
                )
            if n is None:
                n = len(value)
            elif len(value) != n:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has length {len(value)} but the batch has {n} rows"
                )

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def keys(self) -> list[str]:
        """Names of every tensor and non-tensor column (handy for seeing what flows through a dataflow)."""
        return list(self.batch.keys() if self.batch is not None else []) + list(self.non_tensor_batch)

    def __repr__(self) -> str:
        tensors = {k: tuple(v.shape) for k, v in self.batch.items()} if self.batch is not None else {}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensor_batch)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def __getitem__(self, item: Index) -> DataProtoItem | DataProto:
        if isinstance(item, int | np.integer):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} out of range for DataProto of length {n}")
            return DataProtoItem(
                batch=self.batch[int(item)] if self.batch is not None else None,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        idx = self._as_indices(item)
        return DataProto(
            batch=self.batch[torch.from_numpy(idx)] if self.batch is not None else None,
            non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def _as_indices(self, item: Index) -> np.ndarray:
        """Any row selector (slice, index list, bool mask, LongTensor) as an int64 numpy index array."""
        n = len(self)
        if isinstance(item, slice):
            return np.arange(n)[item]
        idx = item.cpu().numpy() if isinstance(item, torch.Tensor) else np.asarray(item)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean mask of shape {idx.shape} does not match DataProto of length {n}")
            return np.flatnonzero(idx)
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"DataProto rows are indexed by int, slice, bool mask or ints, not {idx.dtype}")
        idx = idx.astype(np.int64).reshape(-1)
        if idx.size and (idx.max() >= n or idx.min() < -n):
            raise IndexError(
                f"index {int(idx.max() if idx.max() >= n else idx.min())} out of range for length {n}"
            )
        return idx

    # ------------------------------------------------------------------ reshaping by keys
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A DataProto holding only the named keys (``None`` keeps every key of that kind)."""
        batch, non_tensors, meta = self._split_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        return DataProto(
            batch=self.batch.select(*batch) if self.batch is not None and batch is not None else self.batch,
            non_tensor_batch={k: self.non_tensor_batch[k] for k in non_tensors},
            meta_info={k: self.meta_info[k] for k in meta},
        )

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one."""
        batch, non_tensors, meta = self._split_keys(
            batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or []
        )
        tensors = {k: self.batch.pop(k) for k in batch} if self.batch is not None else {}
        popped = DataProto(
            batch=TensorDict(tensors, batch_size=[len(self)]) if tensors else None,
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in non_tensors},
            meta_info={k: self.meta_info.pop(k) for k in meta},
        )
        return popped

    def _split_keys(self, batch_keys, non_tensor_keys, meta_keys) -> tuple[list | None, list, list]:
        available = list(self.batch.keys()) if self.batch is not None else []
        batch = None if batch_keys is None else list(batch_keys)
        for kind, wanted, have in (
            ("batch", batch, available),
            ("non_tensor_batch", non_tensor_keys, self.non_tensor_batch),
            ("meta_info", meta_keys, self.meta_info),
        ):
            missing = [k for k in (wanted or []) if k not in have]
            if missing:
                raise KeyError(f"{kind} has no key(s) {missing}; available: {sorted(have)}")
        non_tensors = list(self.non_tensor_batch) if non_tensor_keys is None else list(non_tensor_keys)
        meta = list(self.meta_info) if meta_keys is None else list(meta_keys)
        return batch, non_tensors, meta

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s keys to this DataProto (in place, returned for chaining).

        A key present in both must hold equal values: silently keeping one of two different
        ``old_log_probs`` would corrupt training, so that is an error naming the key."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union: lengths differ ({len(self)} vs {len(other)})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.clone(recurse=False)
            else:
                for key, value in other.batch.items():
                    if key in self.batch.keys() and not torch.equal(self.batch[key], value):
                        raise ValueError(f"union: batch key {key!r} exists in both with different values")
                    self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _values_equal(self.non_tensor_batch[key], value):
                raise ValueError(f"union: non_tensor_batch key {key!r} exists in both with different values")
            self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info and not _values_equal(self.meta_info[key], value):
                raise ValueError(f"union: meta_info key {key!r} exists in both with different values")
            self.meta_info[key] = value
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ reshaping by rows
    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Rows of every part, in order. ``meta_info`` comes from the first part, except ``metrics``,
        which merges every part's metrics into lists (so per-worker metrics are never dropped)."""
        if not parts:
            raise ValueError("DataProto.concat needs at least one DataProto")
        key_sets = {
            (tuple(sorted(p.batch.keys())) if p.batch is not None else (), tuple(sorted(p.non_tensor_batch)))
            for p in parts
        }
        if len(key_sets) != 1:
            raise ValueError(f"DataProto.concat: parts have different keys: {sorted(key_sets)}")
        batch = torch.cat([p.batch for p in parts], dim=0) if parts[0].batch is not None else None
        non_tensors = {
            k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch
        }
        meta = dict(parts[0].meta_info)
        metrics = [p.meta_info["metrics"] for p in parts if isinstance(p.meta_info.get("metrics"), dict)]
        if metrics:
            meta["metrics"] = _merge_metrics(metrics)
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` equal parts; the length must divide (pad with ``pad_dataproto_to_divisor`` first)."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(
                f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; "
                "pad it first with pad_dataproto_to_divisor"
            )
        return self.split(len(self) // chunks) if len(self) else [self[0:0] for _ in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` when ``interleave`` (n samples per prompt), else ``abab``."""
        n = len(self)
        idx = np.repeat(np.arange(n), repeat_times) if interleave else np.tile(np.arange(n), repeat_times)
        return self[idx]

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Permute the rows in place (``new[i] = old[indices[i]]``); returns self."""
        reordered = self[indices]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensors to ``device`` (in place; returns self)."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def group_by(
        self, key: str | Callable[[DataProto], Sequence[Hashable]]
    ) -> dict[Hashable, tuple[DataProto, np.ndarray]]:
        """Split rows by a label: a non-tensor column name, or a function of this DataProto returning one
        label per row. Returns ``label -> (rows, their original indices)`` in order of first appearance;
        ``DataProto.merge_groups`` puts processed groups back in the original order."""
        if callable(key):
            labels = list(key(self))
        elif key in self.non_tensor_batch:
            labels = list(self.non_tensor_batch[key])
        elif self.batch is not None and key in self.batch.keys():
            labels = self.batch[key].tolist()
        else:
            raise KeyError(f"group_by: no column {key!r}; available: {self.keys()}")
        if len(labels) != len(self):
            raise ValueError(f"group_by: got {len(labels)} labels for {len(self)} rows")
        groups: dict[Hashable, list[int]] = {}
        for i, label in enumerate(labels):
            groups.setdefault(label, []).append(i)
        return {label: (self[np.asarray(rows)], np.asarray(rows)) for label, rows in groups.items()}

    @staticmethod
    def merge_groups(parts: Iterable[tuple[DataProto, np.ndarray]]) -> DataProto:
        """Inverse of ``group_by``: concatenate ``(rows, original indices)`` parts and restore the order."""
        parts = list(parts)
        indices = np.concatenate([np.asarray(idx, dtype=np.int64) for _, idx in parts])
        if not np.array_equal(np.sort(indices), np.arange(len(indices))):
            raise ValueError("merge_groups: the indices do not cover every original row exactly once")
        merged = DataProto.concat([p for p, _ in parts])
        return merged.reorder(np.argsort(indices, kind="stable"))

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = False, seed: int | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes; with ``shuffle`` each pass is a fresh permutation drawn from
        ``seed`` (the same seed gives the same order)."""
        if mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be positive, got {mini_batch_size}")
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
            yield from self[order].split(mini_batch_size)

    # ------------------------------------------------------------------ persistence
    def __getstate__(self) -> dict:
        tensors = None
        if self.batch is not None:
            tensors = {k: _tensor_to_numpy(v) for k, v in self.batch.items()}
        return {
            "tensors": tensors,
            "batch_size": len(self),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        tensors = state["tensors"]
        self.batch = None
        if tensors is not None:
            self.batch = TensorDict(
                {k: _tensor_from_numpy(*v) for k, v in tensors.items()}, batch_size=[state["batch_size"]]
            )
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def save_to_disk(self, path: str | Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(path: str | Path) -> DataProto:
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise ValueError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data


def _is_object_column(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 1


def _tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype]:
    """numpy has no bfloat16 (and friends): carry such tensors as raw bytes of the same width."""
    t = t.detach().cpu().contiguous()
    try:
        return t.numpy(), t.dtype
    except TypeError:
        return t.view(torch.int16 if t.element_size() == 2 else torch.uint8).numpy(), t.dtype


def _tensor_from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # Arrays that come zero-copy out of Ray's object store are read-only; torch needs writable memory.
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


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
