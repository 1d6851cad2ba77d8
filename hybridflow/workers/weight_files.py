"""Safetensors files written and read one tensor at a time.

Why: a sharded (FSDP2) model's consolidated ``huggingface/`` folder is written from full tensors gathered one at
a time from the ranks' shards. Collecting them into a state dict for ``save_pretrained`` costs a second copy of
the whole model in the writing process on top of its training state (measured on a 199M model over 4 CPU ranks:
+741 MiB on every rank, whose share of the training state was 741 MiB). ``StreamedSafetensors`` writes each
tensor's bytes as it comes and holds none of them: the file is laid out with room for its header in front,
filled in once every tensor's offsets are known.

``SafetensorsFolder`` is the reading side: rank 0 of a sharded model streams a checkpoint's tensors to the ranks
one at a time instead of loading the whole model first (``sharding.shard_module``).

The files are what ``save_pretrained`` writes: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
plus ``model.safetensors.index.json`` beyond ``max_shard_bytes`` (50 GB, transformers' default shard size), with
``{"format": "pt"}`` metadata; ``safetensors`` and ``from_pretrained`` read them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 50 * 10**9  # transformers' default max_shard_size ("50GB")

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ENTRY_BYTES = 96  # a header entry's JSON beyond its quoted name and numbers (keys, dtype, brackets, commas)
_NUMBER_BYTES = 21  # the longest unsigned 64-bit number, and its comma


def header_bound(expected: Iterable[tuple[str, int]]) -> int:
    """Bytes enough for the header of a file holding any subset of ``expected`` ``(name, ndim)`` tensors."""
    metadata = len(json.dumps({"__metadata__": {"format": "pt"}}))
    return metadata + sum(
        len(json.dumps(name)) + _ENTRY_BYTES + _NUMBER_BYTES * (ndim + 2) for name, ndim in expected
    )


class StreamedSafetensors:
    """Writes tensors into ``folder``'s safetensors file(s) as they are added, keeping none of them.

    ``expected``: ``(name, ndim)`` of every tensor that may be added (names as long as or longer than those
    used: a model's ``state_dict`` keys do for the tensors ``full_weights`` yields), to leave room for the
    header. ``close()`` writes the headers, names the files and writes the index of a model split over several.
    """

    def __init__(
        self, folder: str | Path, expected: Iterable[tuple[str, int]], max_shard_bytes: int = MAX_SHARD_BYTES
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._reserve = header_bound(expected)
        self._max = max_shard_bytes
        self._files: list[tuple[Path, dict[str, dict]]] = []  # (part path, header entries)
        self._out: BinaryIO | None = None
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device; copied to the CPU one at a time) under ``name``."""
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"safetensors has no type for {name}'s {tensor.dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        out = self._out
        if out is None or (self._offset and self._offset + data.nbytes > self._max):
            out = self._next_file()
        out.write(data.data)  # the array's own buffer, not a copy
        self._files[-1][1][name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + data.nbytes],
        }
        self._offset += data.nbytes

    def _next_file(self) -> BinaryIO:
        """Start the next part file (the current one finished); returns it."""
        self._finish_file()
        path = self.folder / f".part{len(self._files)}.safetensors"
        self._out = out = open(path, "wb")  # noqa: SIM115 (kept open across add calls; closed in _finish_file)
        out.write(b" " * (8 + self._reserve))
        self._files.append((path, {}))
        self._offset = 0
        return out

    def _finish_file(self) -> None:
        """Fill in the header of the file being written: its length (u64, little-endian), then the JSON,
        padded with spaces to the room left for it (the format allows trailing whitespace)."""
        if self._out is None:
            return
        entries = self._files[-1][1]
        header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        if len(header) > self._reserve:
            raise ValueError(
                f"safetensors header of {len(header)} bytes exceeds the {self._reserve} reserved"
            )
        self._out.seek(0)
        self._out.write(struct.pack("<Q", self._reserve) + header.ljust(self._reserve))
        self._out.close()
        self._out = None

    def close(self) -> list[Path]:
        """Finish the files under their final names (an index beside several); returns their paths."""
        self._finish_file()
        if not self._files:  # nothing was added: an empty model file, as save_pretrained writes one
            self._next_file()
            self._finish_file()
        count = len(self._files)
        names = (
            [WEIGHTS_NAME]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for (part, _), name in zip(self._files, names):
            os.replace(part, self.folder / name)
        if count > 1:
            weight_map = {t: name for (_, entries), name in zip(self._files, names) for t in entries}
            total = sum(
                e["data_offsets"][1] - e["data_offsets"][0] for _, es in self._files for e in es.values()
            )
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [self.folder / name for name in names]


_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of a model folder's safetensors file(s) (``model.safetensors``, or the files its index
    names), each read from disk when it is asked for (``folder[name]``), with plain reads: no file is mapped
    into the process, so it holds the tensors it keeps and nothing more (``safe_open`` maps the file, and the
    pages it reads stay resident in the process until the file is closed).

    ``SafetensorsFolder.open(folder)``: None when the folder has no safetensors weights (a hub id, ``.bin``)."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for path in files:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                dtype = _TORCH_DTYPES[entry["dtype"]]
                self._where[name] = (path, dtype, tuple(entry["shape"]), 8 + length + begin, end - begin)

    @classmethod
    def open(cls, folder: str | Path) -> SafetensorsFolder | None:
        folder = Path(folder)
        if (folder / INDEX_NAME).is_file():
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            return cls([folder / name for name in sorted(set(weight_map.values()))])
        return cls([folder / WEIGHTS_NAME]) if (folder / WEIGHTS_NAME).is_file() else None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][2]

    def holds(self, module: torch.nn.Module) -> bool:
        """Whether every parameter of ``module`` is here under its own name and shape (a checkpoint that
        transformers renames or converts as it loads it is not)."""
        return all(
            name in self._where and self._where[name][2] == tuple(p.shape)
            for name, p in module.named_parameters()
        )

    def __contains__(self, name: object) -> bool:  # without reading the tensor (Mapping's default does)
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        path, dtype, shape, start, size = self._where[name]
        tensor = torch.empty(shape, dtype=dtype)
        with open(path, "rb") as f:
            f.seek(start)
            if size and f.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data) != size:
                raise OSError(f"{path} ends inside tensor {name}: the file is truncated")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
