"""The weight link's buckets filled by every actor rank at once, each with its own shards, in shared memory.

Why: gathering the FSDP2 shards to rank 0 (``gathering.whole_tensors``) sends ``(world - 1) / world`` of the
model through gloo's TCP and leaves rank 0 alone to copy all of it into the buckets: on 4 ranks on the 2-core
machine that was 1.4-1.9 s of a 1.6-2.1 s sync. When the link's buckets live in shared memory (every member
on one machine, ``WeightLink.segments``), the actor's other ranks map the segments too (``share_segments``
on rank 0, ``map_shared_segments`` on the others, when the link forms), and each rank copies its rows of each
tensor straight to where they lie in the whole tensor in the bucket: a tensor is whole once every rank has
written, no shard crosses a socket, and the copies run on every rank at once.

Every rank lays out the same buckets from the tensors' global shapes (``plan_buckets``, the link's own rule:
one dtype, ``bucket_limit``), and each bucket's place in the link's model segment (``model_layout``, which
also sizes that segment when the link forms; a single unsharded rank fills the same places). Per bucket two
small collectives cross the actor's group: a barrier before writing into one of the two bucket segments (rank
0 reaches it once the receivers are done with the segment's previous bucket; a bucket's place in the model
segment is its own, so there is none) and the ranks' checksums of their parts after (an all-gather: the
bucket is whole when it returns). A tensor's checksum term
is the sum of its parts' (they add with wrap-around) when every part starts on a word of the whole tensor;
otherwise rank 0 reads the whole tensor back. Tensors sharded otherwise (a two-dimensional mesh) are made
whole by ``full_tensor()`` on every rank and written by rank 0, as are plain tensors.

Imports torch, ``utils.cores`` and the workers' ``gathering`` and ``weight_link``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.utils.cores import rebalance
from hybridflow.workers.gathering import padded_rows, rows_sharded
from hybridflow.workers.weight_link import (
    ALIGN,
    MODEL_SEGMENT,
    Bucket,
    bits_sum,
    bucket_limit,
    copy_summed,
    fits,
    map_segments,
    placed,
    region,
)

Named = list[tuple[str, torch.Tensor]]


def share_segments(paths: list[str], sizes: list[int]) -> None:
    """Rank 0 (``WeightLink``'s ``on_segments``): the actor's other ranks map the link's segments (none: the
    buckets travel over the link's group); returns once they have, so that rank 0 may unlink them."""
    dist.broadcast_object_list([paths, sizes], src=0)
    dist.barrier()


def map_shared_segments() -> list[torch.Tensor]:
    """The actor's other ranks, while rank 0 forms the link: the segments ``share_segments`` names, mapped."""
    named: list[object] = [None, None]
    dist.broadcast_object_list(named, src=0)
    paths, sizes = named
    assert isinstance(paths, list) and isinstance(sizes, list)
    segments = map_segments(paths, sizes)
    dist.barrier()
    return segments


def plan_buckets(state: Named, bucket_bytes: int) -> list[Named]:
    """``state``'s tensors in the buckets ``WeightLink.send`` would make of the whole tensors, by their global
    shapes: the same on every rank."""
    plans: list[Named] = []
    used = limit = 0
    for name, tensor in state:
        if not plans or not fits(plans[-1][0][1].dtype, used, limit, tensor):
            plans.append([])
            used, limit = 0, bucket_limit(bucket_bytes, tensor)
        used += tensor.numel()
        plans[-1].append((name, tensor))
    return plans


def model_layout(plans: list[Named]) -> list[int]:
    """Where each planned bucket starts in the link's model segment (end to end, each on an ``ALIGN``-byte
    boundary), and last where the segment ends (its size): bucket ``i`` lies between entries ``i`` and
    ``i + 1``."""
    offsets = [0]
    for tensors in plans:
        offsets.append(
            offsets[-1] + -(-sum(t.numel() * t.element_size() for _, t in tensors) // ALIGN) * ALIGN
        )
    return offsets


def shard_buckets(
    state: Named, segments: list[torch.Tensor], bucket_bytes: int, into_model: bool = False
) -> Iterator[Bucket]:
    """Every actor rank, in step: ``state`` (``sharding.weight_state``) written bucket by bucket into
    ``segments`` (bucket ``i`` into ``segments[i % 2]``, or with ``into_model`` at its place in the model
    segment), each rank its own rows; rank 0 yields each whole bucket with its checksum, the others yield
    nothing. Rank 0 iterates it inside ``WeightLink.send_buckets``, which waits for the receivers to be done
    with bucket ``i - 2`` before it asks for bucket ``i`` (in the model segment it need not)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = plan_buckets(state, bucket_bytes)
    offsets = model_layout(plans)
    for index, tensors in enumerate(plans):
        dtype = tensors[0][1].dtype
        if into_model:
            flat = region(segments[MODEL_SEGMENT], offsets[index], offsets[index + 1], dtype)
        else:
            dist.barrier()  # rank 0 comes here once segment index % 2 is free again
            flat = segments[index % 2].view(dtype)
        rebalance()
        parts, slots, used = [], [], 0
        for _, tensor in tensors:
            slots.append(flat[used : used + tensor.numel()])
            parts.append(_write_part(slots[-1], tensor, rank, world))
            used += tensor.numel()
        sums = [torch.zeros(len(parts), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sums, torch.tensor([p or 0 for p in parts], dtype=torch.int64))
        if rank == 0:
            totals = [
                _wrapped(sum(int(s[i]) for s in sums)) if part is not None else bits_sum(slot)
                for i, (part, slot) in enumerate(zip(parts, slots))
            ]
            names, shapes = [n for n, _ in tensors], [tuple(t.shape) for _, t in tensors]
            yield Bucket(flat[:used], used, names, shapes, placed(totals), used)


def _write_part(slot: torch.Tensor, tensor: torch.Tensor, rank: int, world: int) -> int | None:
    """This rank's share of ``tensor`` written into ``slot`` (where the whole tensor lies in the bucket), and
    its checksum term's share; None where the parts' terms do not add up to the whole's (rank 0 reads it back)."""
    if rows_sharded(tensor):
        rows, row = padded_rows(tensor, world)
        start = rank * rows
        held = max(0, min(rows, tensor.shape[0] - start))
        part, local = slot[start * row : (start + held) * row], tensor.to_local().reshape(-1)
        width = tensor.element_size()
        if (tensor.numel() * width) % 8 or (rows * row * width) % 8:  # a part that is not whole words
            part.copy_(local)
            return None
        return copy_summed(part, local)
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # every rank: a collective
    return copy_summed(slot, whole.reshape(-1)) if rank == 0 else 0


def _wrapped(total: int) -> int:
    """A sum of 64-bit words wrapped as the whole tensor's ``bits_sum`` is."""
    return (total + 2**63) % 2**64 - 2**63
