"""The policy's weights as ``(name, tensor)`` pairs: what the trainer hands a rollout engine that keeps its
own copy of the model (vLLM in the actor's process, or a rollout worker in another process).

``WeightMailbox`` is the receiving end of an asynchronous run: versions posted while the rollout generates.
``WeightSyncEnds`` are the worker's methods that move them: over a ``weight_link.WeightLink`` between processes
on Ray (never through the driver, in buckets of ``rollout.weight_sync_bucket_mb``, each load checked against
the trainer's checksum), as arrays within one process on the local backend.

Why one small module: every path that moves weights out of the trainer (in-memory sync into vLLM after
each update, the link to a split rollout worker) reads them through ``policy_weights``, so a
sharded or adapter-wrapped actor only has to change this one function to gather full tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.config import ActorRolloutRefConfig
from hybridflow.rollout import Rollout, RolloutEngine, rollout_class
from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.engine import TrainingEngine
from hybridflow.workers.sharding import full_weights, is_lora, weight_state
from hybridflow.workers.weight_link import (
    MODEL_SEGMENT,
    LinkAddress,
    Named,
    SyncStats,
    WeightLink,
    WeightSyncError,
    checksum,
    copy_summed,
    link_address,
    placed,
    verify_loaded,
)
from hybridflow.workers.weight_shards import (
    map_shared_segments,
    model_layout,
    plan_buckets,
    shard_buckets,
    share_segments,
)

MB = 2**20


def policy_weights(
    module: torch.nn.Module,
    adapter_only: bool = False,
    root: int | None = None,
    bucket_bytes: int = 64 * MB,
    tied_once: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the policy under its Hugging Face name (``model.layers.0.mlp.up_proj.weight``...),
    detached, on the module's device: gathered from FSDP2 shards about ``bucket_bytes`` at a time (a
    collective: every rank iterates; with ``root`` only that rank receives and yields) and with LoRA adapters
    merged (``sharding.full_weights``), or with ``adapter_only`` the adapters alone under peft's names. Tied
    weights appear under each of their names, or with ``tied_once`` under the first alone."""
    device = next(module.parameters()).device
    for name, tensor in full_weights(module, adapter_only, device, root, bucket_bytes, tied_once):
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
    engine's own copy, for vLLM) as a version.

    Once a receiver has asked for one (``take_spare``), a version forgotten (``use``'s ``keep_from``) is kept
    as the spare the next one is received into: fresh memory for a model's worth of copies costs its page faults every sync (measured
    for SmolLM2's 513 MB on one thread: 0.6-1.8 s into new tensors, 0.14 s into reused ones)."""

    def __init__(self, load: Callable[[Named, int], None]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._posted: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._spare: list[tuple[str, torch.Tensor]] = []  # a forgotten version's tensors
        self._recycles = False  # whether a receiver takes spares (none is held for nobody)
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
                forgotten = [w for v, w in self._posted.items() if v < keep_from and w is not weights]
                if forgotten and self._recycles:
                    self._spare = forgotten[-1]
                self._posted = {v: w for v, w in self._posted.items() if v >= keep_from}
        if weights is not None:
            self._load(weights, version)
            self.version = version

    def take_spare(self) -> dict[str, torch.Tensor]:
        """The tensors of a version no longer kept, by name, to receive the next version into (empty when
        there is none); they are the caller's from now on."""
        with self._lock:
            spare, self._spare, self._recycles = self._spare, [], True
        return dict(spare)

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


# ------------------------------------------------------------------------------------------ the workers' ends
T = TypeVar("T")


def _several_ranks() -> bool:
    """Whether this process is one of several ranks of its worker group (the actor's other ranks take part in
    the link's forming and in every send)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def _in_model(link: WeightLink, named: Named) -> bool:
    """Whether a bucket's tensors lie in the link's model segment (they stay valid after the bucket)."""
    place = link.place(named[0][1]) if named else None
    return place is not None and place[0] == MODEL_SEGMENT


def _module_name(name: str) -> str:
    """A LoRA adapter's name as ``policy_weights(adapter_only=True)`` sends it (peft's saved form) -> the
    receiving peft module's own (``...lora_A.default.weight``); other names are the module's already."""
    for part in (".lora_A.", ".lora_B."):
        if part in name and part + "default." not in name:
            return name.replace(part, part + "default.")
    return name


def _like(spare: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    """Where a copy of ``tensor`` goes: ``spare`` (a forgotten version's tensor of that name) when it has its
    shape and dtype, else new memory."""
    if spare is not None and spare.shape == tensor.shape and spare.dtype == tensor.dtype:
        return spare
    return torch.empty_like(tensor)


def load_in_place(
    state: dict[str, torch.Tensor], named: Named, version: int, where: str, expected: int | None = None
) -> None:
    """Copy ``named`` into a module's own tensors (``state``: its ``state_dict()``, whose tensors are the
    module's; no second copy of the model is made), reading each back as it is copied (``copy_summed``):
    ``WeightSyncError`` naming ``version`` unless they hold exactly what was given (``expected``: the sender's
    ``checksum`` of them; None: the given tensors' own). KeyError naming a tensor the module does not have."""
    found = placed(copy_summed(state[_module_name(name)], tensor) for name, tensor in named)
    verify_loaded(found, checksum(t for _, t in named) if expected is None else expected, version, where)


def adopt(module: torch.nn.Module, named: Named) -> bool:
    """The module's tensors of ``named``'s names (and dtypes and shapes) made ``named``'s own tensors (their
    memory: the link's model segment, which later syncs write straight into); whether any changed."""
    own = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    changed = False
    for name, tensor in named:
        mine = own.get(_module_name(name))
        if mine is None or (mine.dtype, mine.shape) != (tensor.dtype, tensor.shape):
            continue  # not the module's to hold: loaded (or refused) by copying, as ever
        if mine.data_ptr() != tensor.data_ptr():
            mine.data = tensor
            changed = True
    return changed


class WeightSyncEnds:
    """The weight-moving methods of ``ActorRolloutRefWorker``: the actor sends, a rollout worker of its own
    (``trainer.placement=split``, asynchronous runs) receives.

    On Ray they meet over a ``WeightLink`` the trainer forms when the run starts (``weight_link_address``, then
    ``join_weight_link`` on both groups at once), and each sync is ``send_weights`` and ``receive_weights``
    called together: the driver only orders it. In one process (the local backend) the driver is the workers'
    own process, and ``get_weights`` / ``update_weights`` / ``post_weights`` hand the tensors over as arrays.

    Every path ends in ``_load_weights``, which meets the rollout contract (``hybridflow.rollout``) by what the
    engine declares: the worker's module takes the weights in place (an engine that samples from it, hf, needs
    nothing more) and an engine with ``Capabilities.own_weights`` (vLLM) is handed them (``update_weights``),
    and must say it took every tensor. A version received while the rollout generates goes to the mailbox,
    the ``WeightFeed`` a rollout that ``follows_weights`` takes new weights from between decoding steps.

    LoRA with an engine that samples from the worker's module (no ``own_weights``: hf): that module carries
    the adapters too, so only they travel; an engine with weights of its own takes the merged weights."""

    config: ActorRolloutRefConfig
    module: torch.nn.Module | None
    engine: TrainingEngine | None
    rollout: Rollout | None
    rollout_engine: type[RolloutEngine] | None
    mailbox: WeightMailbox | None
    weight_link: WeightLink | None
    shard_segments: list[
        torch.Tensor
    ] = []  # the actor's other ranks: the link's segments, to fill with rank 0
    weights_received: int
    rank: int
    device: torch.device
    _is_actor: bool
    _module_state: dict[str, torch.Tensor] | None = None  # a rollout worker's model's tensors by name

    def _require(self, part: T | None, role: str, method: str) -> T:
        """``part`` if the worker has it (``ActorRolloutRefWorker._require``: else one line naming the role)."""
        raise NotImplementedError

    def sends_adapters(self) -> bool:
        """Whether the weights that travel are LoRA adapters alone: LoRA, and a rollout engine that samples
        from its worker's module (which then carries the adapters) rather than from weights of its own."""
        engine = self.rollout_engine or rollout_class(self.config.rollout.name)
        return self.config.model.lora_rank > 0 and not engine.capabilities.own_weights

    def _where(self) -> str:
        return f"rollout worker rank {self.rank}"

    def _load_weights(
        self, named: Named, version: int, expected: int | None = None, hold: bool = False
    ) -> None:
        """Weight ``version`` into this rollout worker's model, checked (``load_in_place``), and into its
        engine's own copy; with ``hold`` (lock-step, ``named`` in the link's model segment) the model takes
        ``named``'s tensors as its own (``adopt``) and loading is only the check."""
        rollout = self._require(self.rollout, "rollout", "loading weights")
        if hold and adopt(self._policy(), named):
            self._module_state = None  # its tensors are others now
        if self._module_state is None:  # the module's own tensors by name, looked up once
            self._module_state = self._policy().state_dict()
        load_in_place(self._module_state, named, version, self._where(), expected)
        if rollout.capabilities.own_weights:
            taken = rollout.update_weights(named)
            if taken != len(named):
                raise WeightSyncError(
                    f"{self._where()}: the rollout engine {type(rollout).__name__} took {taken} of the "
                    f"{len(named)} tensors of weight version {version}: the weights did not reach the engine"
                )

    def _policy(self) -> torch.nn.Module:
        return self._require(self.module, "actor or rollout", "the weights")

    def _dtype(self) -> torch.dtype:
        return next(self._policy().parameters()).dtype

    def _sent(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What travels to a rollout worker, gathered to rank 0 alone (the only rank that sends); a tied tensor
        once (the rollout's model, built from the same config, ties it too)."""
        policy = self._policy()
        adapters = self.sends_adapters() and is_lora(policy)
        bucket = self.config.rollout.weight_sync_bucket_mb * MB
        return policy_weights(policy, adapters, root=0, bucket_bytes=bucket, tied_once=True)

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
        self._load_weights(list(from_numpy(weights, self._dtype())), self.weights_received)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def post_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        """Keep the actor's weights (``get_weights``) as ``version`` for this rollout worker's next
        generations, or for the one in flight when it follows new weights; returns at once (a copy is made
        here, so the actor may train on)."""
        mailbox = self._require(self.mailbox, "rollout", "post_weights")
        mailbox.post(version, list(from_numpy(weights, self._dtype())))

    # ------------------------------------------------------------------ over the link (Ray)
    def _fills_in_place(self, policy: torch.nn.Module) -> bool:
        """Whether the actor's ranks fill the link's shared-memory buckets with their shards in place
        (``weight_shards``), rather than gathering whole tensors to rank 0: when there are several, and the
        weights that travel are the module's own (LoRA merges or picks adapters from whole tensors)."""
        return _several_ranks() and not is_lora(policy)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def weight_link_address(self, receivers: int) -> LinkAddress:
        """A meeting point on the actor's rank 0 for itself and ``receivers`` rollout workers."""
        return link_address(1 + receivers, self.device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_link(self, address: LinkAddress) -> None:
        """Join the weight link (a new one replaces an old one): the actor's rank 0 as its sender, rollout
        worker ``r`` as member ``r + 1``; the actor's other ranks help fill the buckets (in shared memory,
        ``weight_shards``, when the link's buckets are there) or gather to rank 0. Blocks until every member
        has joined, so the trainer calls it on both groups at once."""
        member = (0 if self.rank == 0 else None) if self._is_actor else 1 + self.rank
        if member is None:  # the segments the link's buckets lie in, if they are shared, to fill with rank 0
            self.weight_link = None
            self.shard_segments = map_shared_segments()
            return
        largest = max(t.numel() * t.element_size() for t in self._policy().state_dict().values())
        bucket = self.config.rollout.weight_sync_bucket_mb * MB
        self.weight_link = WeightLink(
            address,
            member,
            self.device,
            bucket,
            largest if member == 0 else 0,
            on_segments=share_segments if member == 0 and _several_ranks() else None,
            model_bytes=self._model_bytes() if member == 0 else 0,
        )

    def _model_bytes(self) -> int:
        """The size of the link's model segment (``weight_shards.model_layout``) for the weights a lock-step
        sync writes straight into the rollout's model; 0 (none) where they are not the module's own (LoRA)."""
        policy = self._policy()
        if is_lora(policy):
            return 0
        return model_layout(self._plan(policy))[-1]

    def _plan(self, policy: torch.nn.Module) -> list[Named]:
        """The buckets a sync sends, by the tensors' global shapes (``weight_shards.plan_buckets``)."""
        bucket = self.config.rollout.weight_sync_bucket_mb * MB
        return plan_buckets(weight_state(policy, tied_once=True), bucket)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, into_model: bool = False) -> dict[str, float] | None:
        """Stream the actor's weights over the link (rank 0; the other ranks write their shards into its
        shared-memory buckets with it, or send them to rank 0); returns rank 0's ``SyncStats``. With
        ``into_model`` (a lock-step sync: the rollout does not generate meanwhile) into the link's model
        segment where it has one, which the rollout's model holds."""
        self._require(self.engine, "actor", "send_weights")
        policy = self._policy()
        segments = self.weight_link.segments if self.weight_link is not None else self.shard_segments
        into_model = into_model and len(segments) > MODEL_SEGMENT
        send: Callable[[WeightLink], SyncStats]
        if segments and self._fills_in_place(policy):  # every rank writes its shards into the buckets
            bucket = self.config.rollout.weight_sync_bucket_mb * MB
            buckets = shard_buckets(weight_state(policy, tied_once=True), segments, bucket, into_model)
            stream: Iterable[object] = buckets
            send = lambda link: link.send_buckets(buckets)  # noqa: E731
        else:  # gathered to rank 0
            weights = self._sent()
            stream = weights
            offsets = model_layout(self._plan(policy)) if into_model else None
            send = lambda link: link.send(weights, offsets)  # noqa: E731
        if self.weight_link is None:
            for _ in stream:  # the ranks > 0 yield nothing: they write their shards, or send them to rank 0
                pass
            return None
        return send(self.weight_link).as_dict()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int, staged: bool) -> dict[str, float]:
        """Take weight ``version`` from the link: loaded bucket by bucket into the model in place (a lock-step
        run: nothing generates meanwhile), or with ``staged`` kept as a posted version (an asynchronous run
        generating meanwhile takes it between generations or decoding steps, ``WeightMailbox``)."""
        self._require(self.rollout, "rollout", "receive_weights")
        if self.weight_link is None:
            raise RuntimeError("receive_weights before join_weight_link: the trainer forms the link first")
        if not staged:
            link = self.weight_link
            stats = link.receive(
                lambda named, sent: self._load_weights(named, version, sent, hold=_in_model(link, named))
            )
            self.weights_received += 1
            return stats.as_dict()
        kept: Named = []
        mailbox = self._require(self.mailbox, "rollout", "receive_weights(staged=True)")
        spare = mailbox.take_spare()

        def keep(named: Named, expected: int) -> None:  # copied, checked, kept until the version is used
            copies = [(name, _like(spare.pop(name, None), tensor)) for name, tensor in named]
            found = placed(copy_summed(copy, given) for (_, copy), (_, given) in zip(copies, named))
            if found != expected:
                raise WeightSyncError(f"{self._where()}: weight version {version} arrived damaged")
            kept.extend(copies)

        stats = self.weight_link.receive(keep)
        mailbox.post(version, kept)
        return stats.as_dict()
