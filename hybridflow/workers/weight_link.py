"""``WeightLink``: the actor's weights from its rank 0 to the rollout workers of their own, never through the
driver, checked on arrival (``checksum``, ``verify_loaded``).

A ``torch.distributed`` process group of its own between the actor's rank 0 (member 0, the sender) and the
rollout workers (members 1..): gloo on CPU, nccl on GPU, formed when the run starts. The weights stream in
buckets (tensors of one dtype, about ``bucket_bytes``; a tensor is never split), each tensor copied into its
bucket as it is gathered from the FSDP2 shards and dropped at once, and each bucket loaded by the receivers
while the sender fills the next. How a bucket travels:

- every member on the sender's machine, CPU: through two segments of shared memory the sender fills in turn
  (the receivers copy a bucket out of one while the next fills the other, and say when they are done with it),
  with only its header over the group. A sync then costs about two copies of the weights, not a trip through
  the network stack (gloo's TCP moved about 1 GB/s over loopback on the 2-core machine, a memcpy 10 GB/s);
- and where there is one receiver and the model's buckets are known when the link forms (``model_bytes``), a
  third segment the size of the whole model (``MODEL_SEGMENT``): a lock-step sync (nothing generates while it
  runs) writes each bucket at its own place there (``into_model``), the receiver's model adopts those tensors
  as its own at the first such sync, and every later one writes straight into the rollout's model: one copy of
  the weights, and the receiver only reads them back for the check;
- otherwise (another machine, or GPUs): the bucket itself over the group (nccl on GPUs), broadcast
  asynchronously so the next one fills meanwhile.

Each bucket carries the ``checksum`` of its tensors' bits; a receiver reads back what its model holds after
loading and compares (``verify_loaded``), so an engine that silently kept old weights stops the run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.utils.cores import rebalance
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)
Named = list[tuple[str, torch.Tensor]]
MB = 2**20
SHARED_MEMORY = "/dev/shm"
MODEL_SEGMENT = 2  #: the link's segment a lock-step sync writes the whole model into (after the two buckets)
ALIGN = 64  #: bytes each bucket's place in the model segment is aligned to (a cache line)


# ------------------------------------------------------------------------------------------ checks
class WeightSyncError(UserError):
    """A rollout engine does not hold the weights the trainer sent: one line naming the version, and the run
    stops (an engine that silently kept old weights trains on samples of a policy nobody is updating)."""


#: bytes copied, then read back for the checksum, at a time: the copy is still in the core's cache when it is
#: read (a second pass over the weights would read them from memory again)
CHUNK_BYTES = 2**20


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An exact fingerprint of tensors' bits, in order: the sum of each tensor's raw bits as integers, each
    weighted by its place (a tensor loaded under another name changes it). Cheap: one read of each tensor."""
    return placed(bits_sum(tensor) for tensor in tensors)


def placed(sums: Iterable[int]) -> int:
    """``checksum`` from each tensor's ``bits_sum`` (or ``copy_summed``), in order."""
    return sum(place * value for place, value in enumerate(sums, 1))


def bits_sum(tensor: torch.Tensor) -> int:
    """The tensor's bytes read as integers and summed with wrap-around (so in any order, exactly): as 8-byte
    words when its size is a whole number of them (as fast as reading them; widening narrower words as they
    are summed is 20x slower), else as words of the element's width. Depends on the values only."""
    flat = tensor.detach().contiguous().reshape(-1)
    width = flat.element_size()
    if (flat.numel() * width) % 8 == 0:  # the words line up unless the tensor starts mid-word: then a copy
        words = flat if _starts_on_a_word(flat) else flat.clone()
        return int(words.view(torch.int64).sum())
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[width]
    return int(flat.view(bits).sum(dtype=bits))


def _starts_on_a_word(flat: torch.Tensor) -> bool:
    return (flat.storage_offset() * flat.element_size()) % 8 == 0


def copy_summed(target: torch.Tensor, source: torch.Tensor) -> int:
    """Copy ``source`` into ``target`` (contiguous, as many elements) and return ``bits_sum`` of what
    ``target`` then holds, each ``CHUNK_BYTES`` read back right after its copy, from cache. Where the words do
    not line up (or the dtypes differ) it copies, then reads ``target`` back whole: the same value; where
    ``target`` is ``source`` itself it only reads it."""
    flat, width = target.view(-1), target.element_size()
    if target.data_ptr() == source.data_ptr() and (target.dtype, target.numel()) == (
        source.dtype,
        source.numel(),
    ):
        return bits_sum(target)  # the same memory (a model that holds the link's segment): only the check
    if target.dtype != source.dtype or (flat.numel() * width) % 8 or not _starts_on_a_word(flat):
        target.copy_(source.reshape(target.shape))
        return bits_sum(target)
    given, step, total = source.reshape(-1), CHUNK_BYTES // width, 0
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        part.copy_(given[start : start + step])
        total += int(part.view(torch.int64).sum())
    return (total + 2**63) % 2**64 - 2**63  # wrapped as one sum of the whole would be


def verify_loaded(found: int, expected: int, version: int, where: str) -> None:
    """``WeightSyncError`` unless what the engine holds now (``found``: the ``checksum`` of its tensors, read
    back after loading) is what the trainer computed for weight ``version``."""
    if found != expected:
        raise WeightSyncError(
            f"{where}: after loading weight version {version} its model does not hold the weights the trainer "
            f"sent (checksum {found} where the trainer's is {expected}): the weights did not reach the engine"
        )


# ------------------------------------------------------------------------------------------ the link
@dataclass(frozen=True)
class LinkAddress:
    """Where a ``WeightLink`` meets: the sender's host and a free port there; ``size`` members (the sender
    and every receiver); ``backend`` gloo or nccl."""

    host: str
    port: int
    size: int
    backend: str


def link_address(size: int, device: torch.device) -> LinkAddress:
    """A meeting point on this machine (the sender's) for a link of ``size`` members."""
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return LinkAddress(host, port, size, "nccl" if device.type == "cuda" else "gloo")


@dataclass
class SyncStats:
    """What one sync cost on one member: seconds filling the buckets (the sender's: gathering the tensors
    from the shards and copying them in), in transfers (and, with shared memory, waiting for the receivers to be done with a segment), and loading
    (a receiver's copies into its model and their check), the bytes moved, the buckets."""

    gather_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    buckets: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            name: float(getattr(self, name))
            for name in ("gather_s", "transfer_s", "load_s", "bytes", "buckets")
        }


class WeightLink:
    """One member of the link (see the module docstring). Every member constructs it at the same time (it
    blocks until all have); member 0 sends (``send``), the others receive (``receive``), both called together
    for each sync. ``bucket_bytes`` and ``largest_bytes`` (the largest tensor that will travel) size the
    sender's buckets and shared memory, ``model_bytes`` (the sender's: ``weight_shards.model_layout``; 0:
    none) the model segment, made where there is one receiver; ``shared_memory`` false (the sender's say)
    sends every bucket over the group even on one machine. ``on_segments(paths, sizes)``, the sender's, is
    called with the shared-memory segments and their bytes (none when the buckets travel over the group)
    before they are unlinked: the processes that fill buckets with the sender (the actor's other ranks,
    ``weight_shards``) map them then."""

    def __init__(
        self,
        address: LinkAddress,
        member: int,
        device: torch.device,
        bucket_bytes: int = 64 * 2**20,
        largest_bytes: int = 0,
        timeout_s: float = 600.0,
        shared_memory: bool = True,
        on_segments: Callable[[list[str], list[int]], None] | None = None,
        model_bytes: int = 0,
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.device, self.bucket_bytes = device, bucket_bytes
        store = dist.TCPStore(
            address.host, address.port, address.size, member == 0, timeout=timeout, wait_for_workers=False
        )
        # torch's stubs give the process-group classes neither their collectives nor NCCL's default options
        self.group: Any
        if address.backend == "nccl":
            self.group = dist.ProcessGroupNCCL(store, member, address.size)  # type: ignore[call-arg]
        else:
            self.group = dist.ProcessGroupGloo(store, member, address.size, timeout)
        self.segments: list[torch.Tensor] = []  # the shared-memory buckets, when every member can map them
        paths: list[str] = []
        sizes: list[int] = []
        if address.backend == "gloo":
            wanted = [max(bucket_bytes, largest_bytes)] * 2 + ([model_bytes] if model_bytes else [])
            if address.size != 2:  # the model segment is one receiver's model
                wanted = wanted[:MODEL_SEGMENT]
            paths, sizes = self._share_memory(store, member, address.size, wanted, shared_memory)
        if member == 0:
            if on_segments is not None:
                on_segments(paths, sizes)
            for path in paths:  # the memory lives while a process maps it: a killed run leaves nothing behind
                os.unlink(path)

    def _share_memory(
        self, store: dist.Store, member: int, size: int, wanted: list[int], shared: bool
    ) -> tuple[list[str], list[int]]:
        """When every member runs on the sender's machine: segments of the ``wanted`` sizes (the sender's say)
        in shared memory, which the sender creates and every member maps; their paths and sizes once every
        member has (the sender then unlinks them)."""
        store.set(f"host/{member}", socket.gethostname())
        if member == 0:
            hosts = {store.get(f"host/{m}").decode() for m in range(size)}
            shared = shared and len(hosts) == 1 and os.access(SHARED_MEMORY, os.W_OK)
            sizes = _fitting([-(-n // ALIGN) * ALIGN for n in wanted], _free_bytes()) if shared else []
            store.set("segments", json.dumps([[_new_segment(n) for n in sizes], sizes]))
        paths, sizes = json.loads(store.get("segments"))
        self.segments = map_segments(paths, sizes)
        self._all_done().wait()  # every member has mapped them
        return paths, sizes

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def _all_done(self) -> dist.Work:
        """A collective every member joins: the receivers once done with a bucket, the sender before it refills
        that bucket's segment."""
        return self.group.allreduce([torch.zeros(1, device=self.device)])

    def _announce(self, bucket: Bucket, place: tuple[int, int] | None) -> list[dist.Work]:
        header = bucket.header(place).to(self.device)
        return [self._broadcast(t) for t in (_length(len(header), self.device), header)]

    def place(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """The shared-memory segment ``tensor`` lies in and its byte offset there; None: memory of its own."""
        base = tensor.untyped_storage().data_ptr()
        for index, segment in enumerate(self.segments):
            if segment.untyped_storage().data_ptr() == base:
                return index, int(tensor.storage_offset()) * tensor.element_size()
        return None

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], offsets: list[int] | None = None
    ) -> SyncStats:
        """Stream ``weights`` (a generator that may gather as it goes) to every receiver; with ``offsets`` (the
        buckets' places, ``weight_shards.model_layout``, where the link has a model segment) into it."""
        buffer: Callable[[int, torch.dtype, int], torch.Tensor] = self._buffer
        if offsets is not None:
            model, places = self.segments[MODEL_SEGMENT], offsets
            buffer = lambda index, dtype, _: region(model, places[index], places[index + 1], dtype)  # noqa: E731
        return self.send_buckets(_buckets(weights, self.bucket_bytes, buffer))

    def send_buckets(self, buckets: Iterable[Bucket]) -> SyncStats:
        """Stream ``buckets`` (a generator that fills each as it goes: bucket ``i`` in ``self.segments[i % 2]``
        when there are segments, once the receivers are done with bucket ``i - 2``, or at its own place in the
        model segment) to every receiver."""
        stats = SyncStats()
        in_flight: list[dist.Work] = []  # what the receivers must be done with before the next bucket
        for bucket in _timed(buckets, stats):
            stats.bytes += bucket.flat.numel() * bucket.flat.element_size()
            stats.buckets += 1
            place = self.place(bucket.flat)
            if place is None:  # over the group: the bucket before must have arrived, a third is not filled
                works = [*self._announce(bucket, None), self._broadcast(bucket.flat)]
                stats.transfer_s += _wait(in_flight)
                in_flight = works
                continue
            stats.transfer_s += _wait(in_flight)  # the receivers are done with the other bucket segment
            stats.transfer_s += _wait(self._announce(bucket, place))
            in_flight = [self._all_done()] if place[0] < MODEL_SEGMENT else []
        stats.transfer_s += _wait(in_flight) + _wait([self._broadcast(_length(0, self.device))])
        return stats

    def _buffer(self, index: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        """Where bucket ``index`` of ``count`` elements is filled: a shared-memory segment, or a new tensor."""
        if not self.segments:
            return torch.empty(count, dtype=dtype, device=self.device)
        segment = self.segments[index % 2].view(dtype)
        if count > segment.numel():
            raise ValueError(f"a tensor of {count} elements does not fit the link's {segment.numel()}")
        return segment

    def receive(self, load: Callable[[Named, int], None]) -> SyncStats:
        """Take every bucket the sender streams; ``load(named, checksum)`` puts each into the engine (or copies
        it to keep: the tensors are valid during the call only, or where they lie in the model segment,
        ``place``, until the next sync into the model) as it arrives, ``checksum`` the sender's for
        the bucket's tensors (what the engine must end up holding). A ``WeightSyncError`` of ``load`` is raised
        once the stream has ended (the sender is not left waiting)."""
        stats, failure = SyncStats(), None
        while True:
            rebalance()
            start = time.perf_counter()
            length = _length(0, self.device)
            self._broadcast(length).wait()
            if not int(length.item()):
                stats.transfer_s += time.perf_counter() - start
                if failure is not None:
                    raise failure
                return stats
            header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            self._broadcast(header).wait()
            names, shapes, dtype, expected, place = json.loads(header.cpu().numpy().tobytes())
            count = sum(_numel(s) for s in shapes)
            if place is None:
                flat = torch.empty(count, dtype=getattr(torch, dtype), device=self.device)
                self._broadcast(flat).wait()
            else:
                segment, offset = place
                kind = getattr(torch, dtype)
                flat = region(self.segments[segment], offset, offset + count * kind.itemsize, kind)
            stats.transfer_s += time.perf_counter() - start
            start = time.perf_counter()
            if failure is None:
                try:
                    load(list(zip(names, _views(flat, shapes))), expected)
                except WeightSyncError as error:
                    failure = error
            stats.load_s += time.perf_counter() - start
            stats.bytes += flat.numel() * flat.element_size()
            stats.buckets += 1
            if place is not None and place[0] < MODEL_SEGMENT:  # the sender may refill that segment now
                self._all_done().wait()


def map_segments(paths: list[str], sizes: list[int]) -> list[torch.Tensor]:
    """The shared-memory segments at ``paths``, of ``sizes`` bytes, mapped into this process."""
    return [torch.from_file(path, shared=True, size=n, dtype=torch.uint8) for path, n in zip(paths, sizes)]


def region(segment: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """A segment's bytes ``start`` to ``end`` (``start`` a multiple of ``ALIGN``) as ``dtype``: a bucket that
    outgrew its place fails to copy rather than write over the next one."""
    return segment[start:end].view(dtype)


def _free_bytes() -> int:
    st = os.statvfs(SHARED_MEMORY)
    return st.f_bavail * st.f_frsize


def _fitting(wanted: list[int], free: int) -> list[int]:
    """The segments ``free`` bytes of shared memory hold: every one ``wanted``, else the two buckets alone
    (lock-step syncs then copy out of them), else none (the buckets travel over the group). A tmpfs fills
    as it is written, so a segment larger than what is left would kill its writer mid-sync (SIGBUS)."""
    for count in (len(wanted), MODEL_SEGMENT):
        if sum(wanted[:count]) <= free:
            if count < len(wanted):
                logger.warning(_SMALL_SHARED_MEMORY, free // MB, sum(wanted) // MB, "copy out of two buckets")
            return wanted[:count]
    logger.warning(_SMALL_SHARED_MEMORY, free // MB, sum(wanted) // MB, "travel over the group (slower)")
    return []


_SMALL_SHARED_MEMORY = (
    "weight link: %d MB free in " + SHARED_MEMORY + " where its segments want %d MB: the weights %s; "
    "a larger " + SHARED_MEMORY + " (docker: --shm-size) makes syncs faster"
)


def _new_segment(capacity: int) -> str:
    descriptor, path = tempfile.mkstemp(prefix="hybridflow-weights-", dir=SHARED_MEMORY)
    os.ftruncate(descriptor, capacity)
    os.close(descriptor)
    return path


@dataclass
class Bucket:
    """Tensors of one dtype laid end to end in ``flat``, with their names and shapes, and their ``checksum``."""

    flat: torch.Tensor
    limit: int  # elements this bucket may hold
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    checksum: int = 0
    used: int = 0  # elements of ``flat`` filled

    def add(self, name: str, tensor: torch.Tensor) -> None:
        count = tensor.numel()
        self.names.append(name)
        self.shapes.append(tuple(tensor.shape))
        self.checksum += len(self.names) * copy_summed(self.flat[self.used : self.used + count], tensor)
        self.used += count

    def header(self, place: tuple[int, int] | None) -> torch.Tensor:
        """What the receivers read first: the tensors, their dtype, checksum, and where in shared memory the
        bucket lies (segment, byte offset; None: it follows over the group)."""
        dtype = str(self.flat.dtype).removeprefix("torch.")
        raw = json.dumps([self.names, self.shapes, dtype, self.checksum, place]).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def bucket_limit(bucket_bytes: int, first: torch.Tensor) -> int:
    """Elements a bucket that starts with ``first`` may hold: ``bucket_bytes`` of its dtype, or ``first`` alone
    when it is larger (a tensor is never split)."""
    return max(bucket_bytes // first.element_size(), first.numel())


def fits(dtype: torch.dtype, used: int, limit: int, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes into a bucket of ``dtype`` that holds ``used`` of its ``limit`` elements."""
    return tensor.dtype == dtype and used + tensor.numel() <= limit


def _buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    buffer: Callable[[int, torch.dtype, int], torch.Tensor],
) -> Iterator[Bucket]:
    """``weights`` in buckets of one dtype and at most ``bucket_bytes`` (``bucket_limit``), each tensor copied
    into its bucket (``buffer(index, dtype, elements)``) as it comes, so a gathered tensor is dropped at once."""
    bucket: Bucket | None = None
    index = 0
    for name, tensor in weights:
        if bucket is not None and not fits(bucket.flat.dtype, bucket.used, bucket.limit, tensor):  # full
            yield _trimmed(bucket)
            bucket, index = None, index + 1
        if bucket is None:
            limit = bucket_limit(bucket_bytes, tensor)
            bucket = Bucket(buffer(index, tensor.dtype, limit), limit)
        bucket.add(name, tensor)
    if bucket is not None:
        yield _trimmed(bucket)


def _timed(buckets: Iterable[Bucket], stats: SyncStats) -> Iterator[Bucket]:
    """``buckets``, the time spent filling each (gathering its tensors from the shards and copying them in)
    added to ``stats.gather_s``."""
    iterator = iter(buckets)
    while True:
        rebalance()  # the processes at work change as the actor's ranks and the receivers join the sync
        start = time.perf_counter()
        bucket = next(iterator, None)
        stats.gather_s += time.perf_counter() - start
        if bucket is None:
            return
        yield bucket


def _trimmed(bucket: Bucket) -> Bucket:
    bucket.flat = bucket.flat[: bucket.used]
    return bucket


def _length(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> Iterator[torch.Tensor]:
    offset = 0
    for shape in shapes:
        count = _numel(shape)
        yield flat[offset : offset + count].view(shape)
        offset += count


def _wait(works: list[dist.Work]) -> float:
    start = time.perf_counter()
    for work in works:
        work.wait()
    return time.perf_counter() - start
