"""The policy's weights as ``(name, tensor)`` pairs: what the trainer hands a rollout engine that keeps its
own copy of the model (vLLM in the actor's process, or a rollout worker in another process).

``WeightMailbox`` is the receiving end of an asynchronous run: versions posted while the rollout generates.
``WeightLink`` moves them between processes without the driver: a ``torch.distributed`` process group of its
own between the actor's rank 0 and the rollout workers (gloo on CPU, nccl on GPU), over which the weights
stream in buckets of ``rollout.weight_sync_bucket_mb``, each gathered from the FSDP2 shards while the one before
is in flight, and each checked on arrival (``checksum``) and after it is loaded (``verify_loaded``).

Why one small module: every path that moves weights out of the trainer (in-memory sync into vLLM after
each update, the link to a split rollout worker) reads them through ``policy_weights``, so a
sharded or adapter-wrapped actor only has to change this one function to gather full tensors.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.config import ActorRolloutRefConfig
from hybridflow.single_controller import Dispatch, register
from hybridflow.utils.errors import UserError
from hybridflow.workers.sharding import full_weights, is_lora

Named = list[tuple[str, torch.Tensor]]


def policy_weights(module: torch.nn.Module, adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the policy under its Hugging Face name (``model.layers.0.mlp.up_proj.weight``...),
    detached, on the module's device: gathered from FSDP2 shards (a collective: every rank iterates) and
    with LoRA adapters merged (``sharding.full_weights``), or with ``adapter_only`` the adapters alone under
    peft's names. Tied weights appear under each of their names."""
    for name, tensor in full_weights(module, adapter_only, device=next(module.parameters()).device):
        yield name, tensor.detach()


def to_numpy(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Weights as CPU numpy arrays, to cross a process boundary: Ray stores numpy buffers once and readers map
    them without a copy, while torch tensors go through its slower pickling path (see FACTS: 0.2 s vs
    3.5-6.8 s for 302 MB). bf16 has no numpy type, so it travels as its raw 16 bits."""
    out = {}
    for name, tensor in weights:
        tensor = tensor.detach().cpu().contiguous()
        out[name] = tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
    return out


def from_numpy(arrays: dict[str, np.ndarray], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``to_numpy`` for a model whose floating tensors are ``dtype``."""
    for name, array in arrays.items():
        tensor = torch.from_numpy(np.array(array, copy=True))  # object-store buffers are read-only
        yield (
            name,
            tensor.view(torch.bfloat16)
            if dtype == torch.bfloat16 and tensor.dtype == torch.int16
            else tensor,
        )


class WeightMailbox:
    """Weight versions the trainer posts for a rollout worker that generates while the trainer trains (an
    asynchronous run), and the version the worker's module holds now.

    ``post`` runs in the trainer's call (another thread than the generation's: a Python thread on the local
    backend, a second concurrent call on a Ray actor) and only stores the weights; the module is changed only
    by the generating thread itself (``use`` before a generation, ``refresh`` between its decoding steps), so
    a forward never sees half-loaded weights. ``load`` puts ``(name, tensor)`` pairs into the module (and the
    engine's own copy, for vLLM) as a version."""

    def __init__(self, load: Callable[[Named, int], None]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._posted: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.version = 0  #: the version the module holds (0: the weights it was loaded with)
        self.follow = False  #: whether ``refresh`` takes newer versions (a partial rollout in progress)

    def post(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Keep ``weights`` (tensors the caller will not change: copies) as ``version``."""
        with self._lock:
            self._posted[version] = weights

    def use(self, version: int | None, keep_from: int | None = None) -> None:
        """Load ``version`` (None: the newest posted) unless the module holds it, then forget the versions
        older than ``keep_from`` (None: forget none). KeyError naming the posted ones when it was never
        posted."""
        with self._lock:
            if version is None:
                version = max(self._posted, default=self.version)
            weights = self._posted.get(version) if version != self.version else None
            if version != self.version and weights is None:
                raise KeyError(f"weight version {version} was not posted (posted: {sorted(self._posted)})")
            if keep_from is not None:
                self._posted = {v: w for v, w in self._posted.items() if v >= keep_from}
        if weights is not None:
            self._load(weights, version)
            self.version = version

    def refresh(self) -> bool:
        """While ``follow``: load the newest posted version if it is newer than the module's; whether it did."""
        if not self.follow:
            return False
        with self._lock:
            newest = max(self._posted, default=self.version)
            weights = self._posted.get(newest) if newest > self.version else None
        if weights is None:
            return False
        self._load(weights, newest)
        self.version = newest
        return True


# ------------------------------------------------------------------------------------------ checks
class WeightSyncError(UserError):
    """A rollout engine does not hold the weights the trainer sent: one line naming the version, and the run
    stops (an engine that silently kept old weights trains on samples of a policy nobody is updating)."""


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An exact fingerprint of tensors' bits, in order: the sum of each tensor's raw bits as integers, each
    weighted by its place (a tensor loaded under another name changes it). Cheap: one read of each tensor."""
    return sum(place * _bits_sum(tensor) for place, tensor in enumerate(tensors, 1))


def _bits_sum(tensor: torch.Tensor) -> int:
    """The tensor's bytes read as integers and summed with wrap-around (so in any order, exactly): as 8-byte
    words when its size is a whole number of them (as fast as reading them; widening narrower words as they
    are summed is 20x slower), else as words of the element's width. Depends on the values only."""
    flat = tensor.detach().contiguous().reshape(-1)
    width = flat.element_size()
    if (flat.numel() * width) % 8 == 0:  # the words line up unless the tensor starts mid-word: then a copy
        words = flat if (flat.storage_offset() * width) % 8 == 0 else flat.clone()
        return int(words.view(torch.int64).sum())
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[width]
    return int(flat.view(bits).sum(dtype=bits))


def verify_loaded(held: Iterable[torch.Tensor], expected: int, version: int, where: str) -> None:
    """``WeightSyncError`` unless the tensors the engine holds now (``held``, read back after loading) have the
    ``checksum`` the trainer computed for weight ``version``."""
    found = checksum(held)
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
    """What one sync cost on one member: seconds waiting for tensors (the sender's gather from the shards),
    in transfers, and loading (a receiver's copies into its model), the bytes moved, the buckets."""

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
    """A process group of its own between the actor's rank 0 (member 0, the sender) and the rollout workers
    (members 1..), formed when the run starts (``LinkAddress``: the sender's store; every member must construct
    it at the same time, which blocks until all have). The driver only tells both ends to run ``send`` and
    ``receive`` together; the weights never pass through it.

    The stream: for each bucket (tensors of one dtype, about ``bucket_bytes``, a tensor never split), a header
    (names, shapes, the bucket's ``checksum``) and the bucket flat. The sender's broadcasts are asynchronous,
    so the next bucket is gathered while this one travels and is loaded; at most two buckets are alive on
    either side."""

    def __init__(self, address: LinkAddress, member: int, device: torch.device, timeout_s: float = 600.0):
        timeout = timedelta(seconds=timeout_s)
        self.device = device
        store = dist.TCPStore(
            address.host, address.port, address.size, member == 0, timeout=timeout, wait_for_workers=False
        )
        make = dist.ProcessGroupNCCL if address.backend == "nccl" else dist.ProcessGroupGloo
        self.group = (
            make(store, member, address.size, timeout)
            if address.backend == "gloo"
            else make(store, member, address.size)
        )

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> SyncStats:
        """Stream ``weights`` (a generator that may gather as it goes) to every receiver."""
        stats, in_flight = SyncStats(), None
        for bucket in _buckets(weights, bucket_bytes, stats):
            header = bucket.header().to(self.device)
            works = [self._broadcast(t) for t in (_length(len(header), self.device), header, bucket.flat)]
            stats.bytes += bucket.flat.numel() * bucket.flat.element_size()
            stats.buckets += 1
            if in_flight is not None:  # the bucket before: done before a third is filled
                stats.transfer_s += _wait(in_flight[0])
            in_flight = (works, bucket, header)
        if in_flight is not None:
            stats.transfer_s += _wait(in_flight[0])
        stats.transfer_s += _wait([self._broadcast(_length(0, self.device))])
        return stats

    def receive(self, load: Callable[[Named, int], None]) -> SyncStats:
        """Take every bucket the sender streams; ``load(named, checksum)`` puts each into the engine (or keeps
        it) as it arrives, ``checksum`` the sender's for the bucket's tensors (what the engine must end up
        holding). A ``WeightSyncError`` of ``load`` is raised once the stream has ended (the sender is not left
        waiting)."""
        stats, failure = SyncStats(), None
        while True:
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
            names, shapes, dtype, expected = json.loads(header.cpu().numpy().tobytes())
            flat = torch.empty(
                sum(_numel(s) for s in shapes), dtype=getattr(torch, dtype), device=self.device
            )
            self._broadcast(flat).wait()
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


@dataclass
class Bucket:
    """Tensors of one dtype laid end to end in ``flat``, with their names and shapes, and their ``checksum``."""

    flat: torch.Tensor
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    checksum: int = 0
    used: int = 0  # elements of ``flat`` filled

    def add(self, name: str, tensor: torch.Tensor) -> None:
        count = tensor.numel()
        self.flat[self.used : self.used + count].copy_(tensor.reshape(-1))
        self.names.append(name)
        self.shapes.append(tuple(tensor.shape))
        self.checksum += len(self.names) * _bits_sum(tensor)
        self.used += count

    def header(self) -> torch.Tensor:
        dtype = str(self.flat.dtype).removeprefix("torch.")
        raw = json.dumps([self.names, self.shapes, dtype, self.checksum]).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, stats: SyncStats
) -> Iterator[Bucket]:
    """``weights`` in buckets of one dtype and at most ``bucket_bytes`` (a larger tensor travels alone), each
    tensor copied into its bucket as it comes, so a gathered tensor is dropped at once; the time spent waiting
    for the next tensor (the gather from the shards) goes to ``stats.gather_s``."""
    bucket: Bucket | None = None
    iterator = iter(weights)
    while True:
        start = time.perf_counter()
        item = next(iterator, None)
        stats.gather_s += time.perf_counter() - start
        if item is None:
            break
        name, tensor = item
        room = 0 if bucket is None else bucket.flat.numel() - bucket.used
        if (
            bucket is not None
            and bucket.used
            and (tensor.numel() > room or tensor.dtype != bucket.flat.dtype)
        ):
            yield _trimmed(bucket)
            bucket = None
        if bucket is None:
            capacity = max(bucket_bytes // tensor.element_size(), tensor.numel())
            bucket = Bucket(torch.empty(capacity, dtype=tensor.dtype, device=tensor.device))
        bucket.add(name, tensor)
    if bucket is not None and bucket.used:
        yield _trimmed(bucket)


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


# ------------------------------------------------------------------------------------------ the workers' ends
MB = 2**20


def _module_name(name: str) -> str:
    """A LoRA adapter's name as ``policy_weights(adapter_only=True)`` sends it (peft's saved form) -> the
    receiving peft module's own (``...lora_A.default.weight``); other names are the module's already."""
    for part in (".lora_A.", ".lora_B."):
        if part in name and part + "default." not in name:
            return name.replace(part, part + "default.")
    return name


def load_in_place(
    state: dict[str, torch.Tensor], named: Named, version: int, where: str, expected: int | None = None
) -> None:
    """Copy ``named`` into a module's own tensors (``state``: its ``state_dict()``, whose tensors are the
    module's; no second copy of the model is made), then read them back:
    ``WeightSyncError`` naming ``version`` unless they hold exactly what was given (``expected``: the sender's
    ``checksum`` of them; None: the given tensors' own). KeyError naming a tensor the module does not have."""
    held = []
    for name, tensor in named:
        target = state[_module_name(name)]
        target.copy_(tensor)
        held.append(target)
    verify_loaded(held, checksum(t for _, t in named) if expected is None else expected, version, where)


class WeightSyncEnds:
    """The weight-moving methods of ``ActorRolloutRefWorker``: the actor sends, a rollout worker of its own
    (``trainer.placement=split``, asynchronous runs) receives.

    On Ray they meet over a ``WeightLink`` the trainer forms when the run starts (``weight_link_address``, then
    ``join_weight_link`` on both groups at once), and each sync is ``send_weights`` and ``receive_weights``
    called together: the driver only orders it. In one process (the local backend) the driver is the workers'
    own process, and ``get_weights`` / ``update_weights`` / ``post_weights`` hand the tensors over as arrays.

    LoRA with the hf rollout: the rollout worker's model carries the adapters too, so only they travel;
    another engine (vLLM) takes the merged weights."""

    config: ActorRolloutRefConfig
    module: torch.nn.Module | None
    engine: object | None
    rollout: object | None
    mailbox: WeightMailbox | None
    weight_link: WeightLink | None
    weights_received: int
    rank: int
    device: torch.device
    _is_actor: bool
    _module_state: dict[str, torch.Tensor] | None = None  # a rollout worker's model's tensors by name

    def _require(self, part: object, role: str, method: str) -> None: ...

    def sends_adapters(self) -> bool:
        """Whether the weights that travel are LoRA adapters alone (lora with the hf rollout)."""
        return self.config.model.lora_rank > 0 and self.config.rollout.name == "hf"

    def _where(self) -> str:
        return f"rollout worker rank {self.rank}"

    def _load_weights(self, named: Named, version: int, expected: int | None = None) -> None:
        """Weight ``version`` into this rollout worker's model, checked (``load_in_place``), and into its
        engine's own copy."""
        if self._module_state is None:  # the module's own tensors by name, looked up once
            self._module_state = self.module.state_dict()
        load_in_place(self._module_state, named, version, self._where(), expected)
        if hasattr(self.rollout, "update_weights"):
            self.rollout.update_weights(named)

    def _sent(self) -> Iterator[tuple[str, torch.Tensor]]:
        return policy_weights(self.module, adapter_only=self.sends_adapters() and is_lora(self.module))

    # ------------------------------------------------------------------ in one process (local backend)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, np.ndarray] | None:
        """The actor's full weights (or LoRA adapters, ``sends_adapters``) as numpy arrays on rank 0 (None
        elsewhere; every rank takes part, since gathering FSDP2 shards is a collective), for a rollout worker
        in this process (the local backend)."""
        self._require(self.engine, "actor", "get_weights")
        weights = to_numpy(self._sent())
        return weights if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load the actor's weights (``get_weights``) into this rollout worker's model and engine."""
        self._require(self.rollout, "rollout", "update_weights")
        self.weights_received += 1
        self._load_weights(
            list(from_numpy(weights, next(self.module.parameters()).dtype)), self.weights_received
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def post_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Keep the actor's weights (``get_weights``) as ``version`` for this rollout worker's next
        generations, or for the one in flight when it follows new weights; returns at once (a copy is made
        here, so the actor may train on)."""
        self._require(self.mailbox, "rollout", "post_weights")
        self.mailbox.post(version, list(from_numpy(weights, next(self.module.parameters()).dtype)))

    # ------------------------------------------------------------------ over the link (Ray)
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def weight_link_address(self, receivers: int) -> LinkAddress:
        """A meeting point on the actor's rank 0 for itself and ``receivers`` rollout workers."""
        return link_address(1 + receivers, self.device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_link(self, address: LinkAddress) -> None:
        """Join the weight link (a new one replaces an old one): the actor's rank 0 as its sender, rollout
        worker ``r`` as member ``r + 1``; the actor's other ranks only help gather. Blocks until every member
        has joined, so the trainer calls it on both groups at once."""
        member = (0 if self.rank == 0 else None) if self._is_actor else 1 + self.rank
        self.weight_link = None if member is None else WeightLink(address, member, self.device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self) -> dict[str, float] | None:
        """Stream the actor's weights over the link (rank 0; the other ranks gather their shards with it);
        returns rank 0's ``SyncStats``."""
        self._require(self.engine, "actor", "send_weights")
        weights = self._sent()
        if self.weight_link is None:
            for _ in weights:  # each tensor gathered with rank 0, then dropped
                pass
            return None
        return self.weight_link.send(weights, self.config.rollout.weight_sync_bucket_mb * MB).as_dict()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int, staged: bool) -> dict[str, float]:
        """Take weight ``version`` from the link: loaded bucket by bucket into the model in place (a lock-step
        run: nothing generates meanwhile), or with ``staged`` kept as a posted version (an asynchronous run
        generating meanwhile takes it between generations or decoding steps, ``WeightMailbox``)."""
        self._require(self.rollout, "rollout", "receive_weights")
        if self.weight_link is None:
            raise RuntimeError("receive_weights before join_weight_link: the trainer forms the link first")
        if not staged:
            stats = self.weight_link.receive(lambda named, sent: self._load_weights(named, version, sent))
            self.weights_received += 1
            return stats.as_dict()
        kept: Named = []

        def keep(named: Named, expected: int) -> None:  # arrived intact: kept until the version is used
            if checksum(t for _, t in named) != expected:
                raise WeightSyncError(f"{self._where()}: weight version {version} arrived damaged")
            kept.extend(named)

        self._require(self.mailbox, "rollout", "receive_weights(staged=True)")
        stats = self.weight_link.receive(keep)
        self.mailbox.post(version, kept)
        return stats.as_dict()
