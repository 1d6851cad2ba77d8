"""Whole tensors from FSDP2 shards, many tensors per collective, to every rank or to one.

Why: ``DTensor.full_tensor()`` is one all-gather per tensor, and every rank ends up with every tensor. A
weight sync or a consolidated checkpoint walks the whole model that way: a few hundred collectives (SmolLM2
has 272 tensors), each paying the group's latency, and ``world_size`` times the bytes through the network,
though one rank alone sends or writes them. ``whole_tensors`` instead packs the local shards of consecutive
tensors (up to ``group_bytes`` of whole tensors) into one buffer and gathers it with one collective, to every
rank (``root=None``) or to ``root`` only, whose share of the traffic is then all of it.

FSDP2 shards a tensor's first dimension as ``torch.chunk`` does: with ``c = ceil(rows / world)``, rank ``r``
holds rows ``[r*c, min((r+1)*c, rows))`` (possibly none). Each rank's part is padded to ``c`` rows so that the
ranks' buffers are the same size; the whole tensor is the ranks' rows end to end. Tensors of other layouts
(HSDP's two-dimensional mesh, a mesh that is not the whole world, one rank) are gathered one by one by
``full_tensor()``.

Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

Named = tuple[str, torch.Tensor]


def whole_tensors(
    named: Iterable[Named], device: torch.device | str, root: int | None = None, group_bytes: int = 64 * 2**20
) -> Iterator[Named]:
    """``named`` (a ``state_dict``'s items, in order) with every DTensor made whole, on ``device``.

    A collective when the tensors are sharded: every rank iterates to the end, in step. With ``root`` only
    that rank (global rank) yields anything; the others take part in the gathers and yield nothing. Plain
    tensors are yielded as they are (the module's own: read, do not modify)."""
    receives = root is None or not dist.is_initialized() or dist.get_rank() == root
    group: list[tuple[str, DTensor]] = []
    for name, tensor in named:
        if group and not _joins(group, tensor, group_bytes):
            yield from _gather_group(group, device, root, receives)
            group = []
        if rows_sharded(tensor):
            group.append((name, tensor))
            continue
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if receives:
            yield name, whole.detach().to(device)
    if group:
        yield from _gather_group(group, device, root, receives)


def rows_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor FSDP2 shards on its first dimension over a one-dimensional mesh of the whole world."""
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return False
    mesh = tensor.device_mesh
    whole_world = mesh.ndim == 1 and mesh.size() == dist.get_world_size() > 1
    return whole_world and tensor.placements == (Shard(0),)


def _joins(group: list[tuple[str, DTensor]], tensor: torch.Tensor, group_bytes: int) -> bool:
    """Whether ``tensor`` goes into the same collective as ``group``: the same dtype and mesh, and room left."""
    first = group[0][1]
    if not rows_sharded(tensor) or tensor.dtype != first.dtype or tensor.device_mesh != first.device_mesh:
        return False
    used = sum(t.numel() for _, t in group) * first.element_size()
    return used + tensor.numel() * tensor.element_size() <= group_bytes


def padded_rows(tensor: DTensor, world: int) -> tuple[int, int]:
    """Rows per rank after padding (``ceil(rows / world)``) and the elements of one row."""
    return math.ceil(tensor.shape[0] / world), math.prod(tensor.shape[1:])


def _gather_group(
    group: list[tuple[str, DTensor]], device: torch.device | str, root: int | None, receives: bool
) -> Iterator[Named]:
    """One collective for ``group``'s shards; on the receiving ranks, each whole tensor in turn. A tensor
    alone whose rows divide by the ranks is gathered as it is, into the tensor yielded (no copy either side)."""
    mesh = group[0][1].device_mesh
    world, process_group = mesh.size(), mesh.get_group()
    layout = [padded_rows(tensor, world) for _, tensor in group]
    sizes = [rows * row for rows, row in layout]
    local = _packed(group, sizes)
    whole = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device) if receives else None
    parts = list(whole.chunk(world)) if whole is not None else None
    if root is None:
        dist.all_gather(parts, local, group=process_group)
    else:
        dist.gather(local, parts, dst=root, group=process_group)
    if whole is None or parts is None:
        return
    if len(group) == 1 and group[0][1].shape[0] % world == 0:  # the ranks' rows end to end: the tensor
        yield group[0][0], whole.view(group[0][1].shape).to(device)
        return
    offset = 0
    for (name, tensor), (rows, row), size in zip(group, layout, sizes):
        pieces = []
        for rank, part in enumerate(parts):
            held = max(0, min(rows, tensor.shape[0] - rank * rows))  # torch.chunk's rows on this rank
            pieces.append(part[offset : offset + held * row])
        yield name, torch.cat(pieces).view(tensor.shape).to(device)
        offset += size


def _packed(group: list[tuple[str, DTensor]], sizes: list[int]) -> torch.Tensor:
    """This rank's shards of ``group`` end to end, each padded to ``sizes`` elements: the shard itself when it
    is alone and needs no padding."""
    shards = [tensor.to_local().reshape(-1) for _, tensor in group]
    if len(shards) == 1 and shards[0].numel() == sizes[0] and shards[0].is_contiguous():
        return shards[0]
    local = torch.zeros(sum(sizes), dtype=shards[0].dtype, device=shards[0].device)
    offset = 0
    for shard, size in zip(shards, sizes):
        local[offset : offset + shard.numel()].copy_(shard)
        offset += size
    return local
