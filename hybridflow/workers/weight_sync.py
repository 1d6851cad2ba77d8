"""The policy's weights as ``(name, tensor)`` pairs: what the trainer hands a rollout engine that keeps its
own copy of the model (vLLM in the actor's process, or a rollout worker in another process).

``WeightMailbox`` is the receiving end of an asynchronous run: versions posted while the rollout generates.

Why one small module: every path that moves weights out of the trainer (in-memory sync into vLLM after
each update, the Ray object store to a split rollout worker) reads them through ``policy_weights``, so a
sharded or adapter-wrapped actor only has to change this one function to gather full tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from hybridflow.workers.sharding import full_weights


def policy_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the policy under its Hugging Face name (``model.layers.0.mlp.up_proj.weight``...),
    detached, on the module's device: gathered from FSDP2 shards (a collective: every rank iterates) and
    with LoRA adapters merged (``sharding.full_weights``). Tied weights appear under each of their names."""
    for name, tensor in full_weights(module, device=next(module.parameters()).device):
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
    engine's own copy, for vLLM)."""

    def __init__(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
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
            self._load(weights)
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
        self._load(weights)
        self.version = newest
        return True
