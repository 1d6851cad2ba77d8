"""DataProto: the one batch type that flows between the driver and the workers.

Every worker-group call takes and returns a ``DataProto``: named tensors (a ``TensorDict`` whose batch size
is ``[N]``), named non-tensor columns (numpy arrays whose first dimension is ``N``: raw prompts, ground
truths, group ids) and free-form ``meta_info`` (sampling settings, metrics). Everything indexes along one
batch axis, so a batch can be split across data-parallel ranks, repeated for ``n`` samples per prompt,
routed by category and merged back without any field drifting out of step with the others.

The methods are verl's (``verl.protocol.DataProto``), with the same names, arguments and results; where
verl asserts, these raise one error naming the culprit (README, "Coming from verl", lists the few
deliberate differences).

Pickling (which is what Ray does to cross process boundaries) carries tensors as numpy byte buffers
(``serialize_tensordict``): Ray passes numpy zero-copy through its object store, while torch tensors go
through a slow copying path (measured on a 2-core machine: 0.2 s against 3.5-6.8 s for a 302 MB round trip).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import tensordict
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.protocol.auto_padding import AUTO_PADDING_KEY, DataProtoConfig
from hybridflow.protocol.columns import (
    check_union,
    deserialize_tensordict,
    is_object_column,
    merge_metrics,
    object_array,
    serialize_tensordict,
    tensor_items,
    tensors_equal,
    top_keys,
    type_info,
    union_numpy_dict,
    union_tensor_dict,
)

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor
_ITERATOR_OPTIONS = {"shuffle", "drop_last"}


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` has no batch dimension, non-tensor values are plain objects."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of ``N`` rows: ``batch`` (TensorDict, batch size ``[N]``), ``non_tensor_batch`` (numpy
    arrays of first dimension ``N``; ``None`` means none) and ``meta_info`` (not indexed)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from named tensors (all with the same first dimension) and non-tensor columns (lists are
        stored one element per row, even lists of equal-length lists). ``auto_padding`` marks the batch as
        verl does (``is_padding_enabled``). ``num_batch_dims`` other than 1 is refused, as verl's own
        consistency check refuses it: fold rows with ``fold_batch_dim`` instead."""
        if num_batch_dims != 1:
            raise ValueError(
                f"from_dict: num_batch_dims={num_batch_dims}, but a DataProto has exactly one batch dimension "
                "(verl refuses it too); use fold_batch_dim to group rows"
            )
        tensors, non_tensors = tensors or {}, non_tensors or {}
        batch = None
        if tensors:
            sizes = {k: (v.shape[0] if v.dim() else None) for k, v in tensors.items()}
            if len(set(sizes.values())) != 1 or None in sizes.values():
                raise ValueError(f"DataProto tensors must share their first dimension; got sizes {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[len(next(iter(tensors.values())))])
        columns = {k: v if is_object_column(v) else object_array(v) for k, v in non_tensors.items()}
        meta = dict(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=columns, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict: torch tensors go to ``batch``, lists and numpy arrays to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        bad = [k for k, v in others.items() if not isinstance(v, list | tuple | np.ndarray)]
        if bad:
            raise ValueError(f"from_single_dict: values must be tensors, lists or numpy arrays; not {bad}")
        return cls.from_dict(tensors, others, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict[str, Any] | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Inverse of ``to_tensordict``: tensors -> ``batch``, ``NonTensorStack`` entries -> non-tensor columns,
        ``NonTensorData`` entries -> ``meta_info``."""
        if num_batch_dims != 1:
            raise ValueError(
                f"from_tensordict: num_batch_dims={num_batch_dims}; a DataProto has one batch dimension"
            )
        tensors: dict[str, torch.Tensor] = {}
        columns: dict[str, np.ndarray] = {}
        meta = dict(meta_info or {})
        for key in top_keys(tensor_dict):
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                columns[key] = object_array(item.data for item in value)
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            else:
                tensors[key] = value
        return cls.from_dict(tensors, columns, meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: the tensors, each non-tensor column as a ``NonTensorStack`` (any Python values,
        nested lists and dicts included) and each ``meta_info`` entry as ``NonTensorData``."""
        tensors = dict(self.batch.items()) if self.batch is not None else {}
        clash = sorted(
            (set(tensors) & set(self.non_tensor_batch))
            | (set(tensors) | set(self.non_tensor_batch)) & set(self.meta_info)
        )
        if clash:
            raise ValueError(
                f"to_tensordict: key(s) {clash} appear in more than one of batch, non_tensor_batch, meta_info"
            )
        out = TensorDict(tensors, batch_size=[len(self)])
        for key, column in self.non_tensor_batch.items():
            values: list[Any] = [NonTensorData(v) for v in column]  # from_list takes any values
            out[key] = NonTensorStack.from_list(values)
        for key, value in self.meta_info.items():
            out[key] = NonTensorData(value)
        return out

    def check_consistency(self) -> None:
        """Every tensor and non-tensor column has the same length ``N``; raises naming the culprit."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise ValueError(f"DataProto.batch must be a TensorDict, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise ValueError(
                    f"DataProto.batch must have one batch dimension, got {list(self.batch.batch_size)}"
                )
        n = self.batch.batch_size[0] if self.batch is not None else None
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] must be a numpy array with a batch dimension, got {type(value)}"
                )
            if n is None:
                n = len(value)
            elif len(value) != n:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has length {len(value)} but the batch has {n} rows"
                )

    # ------------------------------------------------------------------ reading
    @property
    def tensors(self) -> TensorDict:
        """``batch`` where the tensors must be there (a generation, training or scoring batch): the
        ``TensorDict`` itself (``data.tensors["x"] = t`` sets a column), never None; a ValueError listing the
        columns this DataProto holds when it has no tensors. Code that accepts a batch without tensors tests
        ``batch is None`` instead."""
        if self.batch is None:
            raise ValueError(f"this DataProto holds no tensors (batch is None); its columns: {self.keys()}")
        return self.batch

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def keys(self) -> list[str]:
        """Names of every tensor and non-tensor column (handy for seeing what flows through a dataflow)."""
        return (top_keys(self.batch) if self.batch is not None else []) + list(self.non_tensor_batch)

    def __repr__(self) -> str:
        tensors = {k: tuple(v.shape) for k, v in self.batch.items()} if self.batch is not None else {}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensor_batch)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def print_size(self, prefix: str = "") -> None:
        """Print the GiB held by the tensors and by the non-tensor arrays (object arrays count pointers)."""
        tensors = tensor_items(self.batch) if self.batch is not None else []
        tensor_bytes = sum(t.element_size() * t.numel() for _, t in tensors)
        numpy_bytes = sum(a.nbytes for a in self.non_tensor_batch.values())
        message = f"Size of tensordict: {tensor_bytes / 2**30} GB, size of non_tensor_batch: {numpy_bytes / 2**30} GB"
        print(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """One line per key: tensors with shape, dtype and device; arrays with shape and dtype; meta types."""
        lines = ["batch"]
        for key, tensor in self.batch.items() if self.batch is not None else []:
            lines.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
        lines.append("non_tensor_batch")
        lines += [f"  {k}: ndarray{a.shape} ({a.dtype})" for k, a in self.non_tensor_batch.items()]
        lines.append("meta_info")
        lines += [f"  {k}: {type_info(v)}" for k, v in self.meta_info.items()]
        return "\n".join(lines)

    @overload
    def __getitem__(self, item: int | np.integer[Any]) -> DataProtoItem: ...

    @overload
    def __getitem__(self, item: slice | Sequence[int] | np.ndarray | torch.Tensor) -> DataProto: ...

    def __getitem__(self, item: Index | np.integer[Any]) -> DataProtoItem | DataProto:
        """An int gives one row (``DataProtoItem``); a slice, index list, bool mask or index tensor gives a
        DataProto of those rows."""
        if isinstance(item, int | np.integer):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} out of range for DataProto of length {n}")
            return DataProtoItem(
                batch=self.batch[int(item)] if self.batch is not None else None,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if not isinstance(item, slice | list | tuple | np.ndarray | torch.Tensor):
            raise TypeError(
                f"DataProto rows are indexed by int, slice, list, numpy array or tensor, not {type(item).__name__}"
            )
        return self.select_idxs(item)

    def select_idxs(self, idxs: Index) -> DataProto:
        """The rows ``idxs`` (indices, a bool mask or a slice) as a new DataProto."""
        idx = self._as_indices(idxs)
        return type(self)(
            batch=self.batch[torch.from_numpy(idx)] if self.batch is not None else None,
            non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """``self[start:end:step]`` as a DataProto."""
        return self.select_idxs(slice(start, end, step))

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
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto holding only the named keys (``None`` keeps every key of that kind); tensors are
        shared, non-tensor columns and meta values too unless ``deepcopy``."""
        batch, non_tensors, meta = self._split_keys(batch_keys, non_tensor_batch_keys, meta_info_keys)
        columns = {k: self.non_tensor_batch[k] for k in non_tensors}
        meta_info = {k: self.meta_info[k] for k in meta}
        return type(self)(
            batch=self.batch.select(*batch) if self.batch is not None and batch is not None else self.batch,
            non_tensor_batch=copy.deepcopy(columns) if deepcopy else columns,
            meta_info=copy.deepcopy(meta_info) if deepcopy else meta_info,
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
        tensors = {k: self.batch.pop(k) for k in batch or []} if self.batch is not None else {}
        return DataProto(
            batch=TensorDict(tensors, batch_size=[len(self)]) if tensors else None,
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in non_tensors},
            meta_info={k: self.meta_info.pop(k) for k in meta},
        )

    def rename(self, old_keys: str | list[str], new_keys: str | list[str]) -> DataProto:
        """Rename tensors of ``batch`` in place (returns self); non-tensor and meta keys are not touched."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys")
        self._split_keys(old, [], [])
        if self.batch is not None:  # no tensors: nothing (and, checked above, no key) to rename
            self.batch.rename_key_(tuple(old), tuple(new))
        return self

    def _split_keys(
        self,
        batch_keys: Iterable[str] | None,
        non_tensor_keys: Iterable[str] | None,
        meta_keys: Iterable[str] | None,
    ) -> tuple[list[str] | None, list[str], list[str]]:
        # each kind listed once: a generator of keys would be used up by the check below
        available = top_keys(self.batch) if self.batch is not None else []
        batch = None if batch_keys is None else list(batch_keys)
        non_tensors = list(self.non_tensor_batch) if non_tensor_keys is None else list(non_tensor_keys)
        meta = list(self.meta_info) if meta_keys is None else list(meta_keys)
        for kind, wanted, have in (
            ("batch", batch or [], available),
            ("non_tensor_batch", non_tensors, list(self.non_tensor_batch)),
            ("meta_info", meta, list(self.meta_info)),
        ):
            missing = [k for k in wanted if k not in have]
            if missing:
                raise KeyError(f"{kind} has no key(s) {missing}; available: {sorted(have)}")
        return batch, non_tensors, meta

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s keys to this DataProto (in place, returned for chaining). A key present in both
        must hold equal values (``union_tensor_dict``'s rule), else ValueError naming it."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union: lengths differ ({len(self)} vs {len(other)})")
        # every conflict is found before anything is merged: a failed union leaves self as it was
        if self.batch is not None and other.batch is not None:
            check_union("batch", self.batch, other.batch, equal=tensors_equal)
        check_union("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch)
        check_union("meta_info", self.meta_info, other.meta_info)
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.clone(recurse=False)
            else:
                union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        self.check_consistency()
        return self

    # ------------------------------------------------------------------ reshaping by rows
    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of every part, in order. ``meta_info`` merges every part's keys (a key two parts give
        different values is a ValueError naming it), except ``metrics``: every part's metrics (a dict, or a
        list of dicts) become one dict of lists, so per-worker metrics are never dropped."""
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        key_sets = {
            (tuple(sorted(p.batch.keys())) if p.batch is not None else (), tuple(sorted(p.non_tensor_batch)))
            for p in data
        }
        if len(key_sets) != 1:
            raise ValueError(f"DataProto.concat: parts have different keys: {sorted(key_sets)}")
        batch = tensordict.cat([p.tensors for p in data], dim=0) if data[0].batch is not None else None
        non_tensors = {
            k: np.concatenate([p.non_tensor_batch[k] for p in data]) for k in data[0].non_tensor_batch
        }
        meta: dict[str, Any] = {}
        for part in data:
            others = {k: v for k, v in part.meta_info.items() if k != "metrics"}
            check_union("meta_info", meta, others, "concat")
            meta.update(others)
        metrics = [p.meta_info["metrics"] for p in data if p.meta_info.get("metrics") is not None]
        if metrics:
            meta["metrics"] = merge_metrics(metrics)
        return type(data[0])(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` consecutive parts whose lengths differ by at most one, the first ones longer (7 rows in
        3 chunks: 3, 2, 2); every part gets ``meta_info``."""
        if chunks <= 0:
            raise ValueError(f"chunk: the number of chunks must be positive, got {chunks}")
        bounds = np.cumsum([0] + [len(self) // chunks + (i < len(self) % chunks) for i in range(chunks)])
        return [self.slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` when ``interleave`` (n samples per prompt), else ``abab``."""
        n = len(self)
        idx = np.repeat(np.arange(n), repeat_times) if interleave else np.tile(np.arange(n), repeat_times)
        return self[idx]

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (``[3, 1, 2]`` on ``abc``: ``aaabcc``)."""
        times = np.asarray(repeat_times.tolist() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        if times.shape != (len(self),) or (
            times.size and (not np.issubdtype(times.dtype, np.integer) or times.min() < 0)
        ):
            raise ValueError(
                f"sample_level_repeat: repeat_times must be {len(self)} non-negative integers (one per row), "
                f"got {np.asarray(repeat_times).tolist()!r:.80}"
            )
        return self[np.repeat(np.arange(len(self)), times)]

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Each row becomes ``n_split`` rows: the columns in ``split_keys`` are cut along their second
        dimension into ``n_split`` pieces (one per new row); every other column is repeated. Keeps grouped
        values (e.g. a pair of responses) together through a shuffle. ``split_keys=None`` splits nothing."""
        split = set(split_keys or [])
        unknown = split - set(self.keys())
        if unknown:
            raise KeyError(
                f"unfold_column_chunks: no column(s) {sorted(unknown)}; available: {sorted(self.keys())}"
            )

        def unfold(key: str, value: Any, repeat: Callable[[Any], Any]) -> Any:
            if key not in split:
                return repeat(value)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise ValueError(
                    f"unfold_column_chunks: column {key!r} of shape {tuple(value.shape)} has no second "
                    f"dimension divisible by n_split={n_split}"
                )
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            tensors = {
                k: unfold(k, v, lambda t: t.repeat_interleave(n_split, dim=0)) for k, v in self.batch.items()
            }
            batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        columns = {
            k: unfold(k, v, lambda a: np.repeat(a, n_split, axis=0)) for k, v in self.non_tensor_batch.items()
        }
        return type(self)(batch=batch, non_tensor_batch=columns, meta_info=dict(self.meta_info))

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Permute the rows in place (``new[i] = old[indices[i]]``); returns self."""
        reordered = self[indices]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first row (``padding_candidate="first"``) or of the last
        (anything else, as in verl), in place."""
        if padding_size == 0:
            return
        if len(self) == 0:
            raise ValueError("padding: cannot pad an empty DataProto")
        row = self[[0 if padding_candidate == "first" else len(self) - 1]]
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def is_padding_enabled(self) -> bool:
        """Whether this batch (``from_dict(auto_padding=True)``) or the process (``DataProtoConfig``) asks
        for auto padding."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

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
        self,
        mini_batch_size: int,
        epochs: int = 1,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
        *,
        shuffle: bool = False,
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes. Shuffling (``shuffle=True`` or verl's
        ``dataloader_kwargs={"shuffle": True}``) draws each pass's permutation from a generator seeded with
        ``seed`` (0 when None), as verl's DataLoader does with its seed: the same seed gives the same
        order. The last mini-batch may be shorter, unless ``dataloader_kwargs={"drop_last": True}``."""
        options = dict(dataloader_kwargs or {})
        unknown = set(options) - _ITERATOR_OPTIONS
        if unknown:
            raise ValueError(
                f"make_iterator: dataloader_kwargs {sorted(unknown)} are not supported; only {sorted(_ITERATOR_OPTIONS)}"
            )
        if mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be positive, got {mini_batch_size}")
        shuffle = shuffle or bool(options.get("shuffle", False))
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
            for mini in self[order].split(mini_batch_size):
                if len(mini) == mini_batch_size or not options.get("drop_last", False):
                    yield mini

    # ------------------------------------------------------------------ persistence
    def __getstate__(self) -> dict[str, Any]:
        return {
            "batch": serialize_tensordict(self.batch) if self.batch is not None else None,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = deserialize_tensordict(state["batch"]) if state["batch"] is not None else None
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def save_to_disk(self, filepath: str | Path) -> None:
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(filepath: str | Path) -> DataProto:
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise ValueError(f"{filepath} holds a {type(data).__name__}, not a DataProto")
        return data
