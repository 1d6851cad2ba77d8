"""Ulysses sequence parallelism: one sequence's tokens split over the ranks of a group, so its activations
need not fit one rank (verl's ``ulysses_sequence_parallel_size``; DeepSpeed-Ulysses, arXiv 2309.14509).

Every layer but attention acts on each token alone, so a rank can run embeddings, MLPs, norms and the output
layer on its own slice of the columns. Attention needs every earlier token: before it, an all-to-all turns
"my columns, all heads" into "all columns, my heads" (query, key and value), each rank attends over the whole
sequence for ``heads / size`` heads, and a second all-to-all turns the result back into "my columns, all
heads". Activations per rank shrink by the group size; attention's per-head cost is unchanged.

How it plugs in, without copying any model code:

- ``enable_ulysses(model)`` switches the model to an attention implementation registered with transformers'
  ``AttentionInterface`` (``hybridflow_ulysses_sdpa`` / ``_eager``) that behaves exactly like the original one
  unless a forward is called with the ``ulysses=SequenceParallel(...)`` keyword (and ``ulysses_mask``, the
  whole sequence's mask), which transformers hands down to every attention call (and which gradient
  checkpointing keeps for the recomputation). Generation from the same module is untouched.
- ``split_columns`` lays a forward out for the group: the columns padded to a multiple of the size, this rank's
  slice of the input ids and position ids, and the full 4-D boolean attention mask of a prefix tree
  (``hybridflow.workers.packing``), which attention applies to the gathered sequence; plain rows are first
  moved to their first columns (``left_aligned``), so causal attention needs no mask at all.
- Each rank computes the per-token results (log-probs, entropies, values) for the response tokens its columns
  predict; ``spread`` assembles all of them on every rank: an all-reduce of disjoint parts forward, the
  identity backward. Every rank of the group then computes the same loss, and each rank's backward yields the
  gradient of its own part of the computation; summing the ranks' gradients (the data-parallel reduction
  already does) gives the full gradient. ``gather_rows`` makes every rank of a group hold the group's rows
  (the worker group's dispatch gives each rank its own shard), so the loss is the group's.

Collectives: ``all_to_all_single`` and ``all_reduce``, which gloo has in this torch (2.13) as nccl does, so the
same code runs on CPU ranks (tested with 2 and 4) and GPUs.

May import: torch, transformers, ``hybridflow.protocol``, ``hybridflow.models``, ``hybridflow.utils``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from hybridflow.models.layers import layer_layout
from hybridflow.protocol import DataProto
from hybridflow.utils.errors import UserError

ATTENTION_PREFIX = "hybridflow_ulysses_"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: ``size`` consecutive ranks of the default group,
    this one the ``rank``-th; ``group`` the process group they form."""

    group: Any
    size: int
    rank: int


_GROUPS: dict[int, SequenceParallel | None] = {}


def sequence_parallel(size: int, key: str) -> SequenceParallel | None:
    """This rank's group of ``size`` consecutive ranks (None for size 1), formed once per size in a process
    (colocated roles with the same size share it). Every rank of the default group must call it, in the same
    order: forming a group is a collective. ``key`` names the setting in errors."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if size < 1 or world % size:
        raise UserError(
            f"{key}={size} must divide the {world} worker(s) (trainer.n_workers): each sequence is split over "
            "that many ranks of the data-parallel group"
        )
    if size not in _GROUPS:
        mine = None
        for start in range(0, world, size):  # every rank forms every group, as new_group requires
            group = dist.new_group(list(range(start, start + size)))
            if start <= dist.get_rank() < start + size:
                mine = SequenceParallel(group, size, dist.get_rank() - start)
        _GROUPS[size] = mine
    return _GROUPS[size]


# ---------------------------------------------------------------------------------------- collectives
def _device_for(tensor: torch.Tensor, group: Any) -> torch.device:
    """nccl moves GPU memory only, gloo CPU memory."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else tensor.device
    )


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dimension 0 goes to rank ``i``; the result's chunk ``i`` came from rank ``i``. Its own
    adjoint: the backward sends the gradient's chunks back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()  # the collective reads and writes raw memory: both buffers must be dense
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``(b, heads, columns / size, d)`` of my columns -> ``(b, heads / size, columns, d)`` of my heads."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, sp.size, h // sp.size, s, d).transpose(0, 1)  # chunk j: the heads rank j gets
    out = _AllToAll.apply(chunks.contiguous(), sp.group)  # chunk i: rank i's columns of my heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // sp.size, sp.size * s, d)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: ``(b, heads / size, columns, d)`` -> ``(b, heads, columns / size, d)``."""
    b, h, cols, d = x.shape
    s = cols // sp.size
    chunks = x.reshape(b, h, sp.size, s, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's columns
    out = _AllToAll.apply(chunks.contiguous(), sp.group)  # chunk i: my columns of rank i's heads
    return out.transpose(0, 1).reshape(b, sp.size * h, s, d)


class _Summed(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: for parts that are disjoint across ranks (zero elsewhere)
    from which every rank then computes the same loss, so a rank's gradient for its own part is its own
    loss's (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        device = _device_for(x, group)
        out = x.detach().to(device, copy=True)
        dist.all_reduce(out, group=group)
        return out.to(x.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def spread(
    values: torch.Tensor, index: torch.Tensor | None, count: int, sp: SequenceParallel | None
) -> torch.Tensor:
    """``values`` ``(m, ...)`` of the tokens at ``index`` ``(m,)`` -> ``(count, ...)`` of every token on every rank
    of the group (each token's value computed by exactly one rank; gradients flow back to it)."""
    if sp is None or index is None:
        return values
    full = values.new_zeros((count, *values.shape[1:])).index_put((index.to(values.device),), values)
    return _Summed.apply(full, sp.group)


def gather_rows(data: DataProto, sp: SequenceParallel | None) -> DataProto:
    """The tensors of the group's shards, concatenated in rank order, on every rank of the group (the shards
    the worker group dispatched have equal sizes); ``meta_info`` kept, non-tensor columns left out."""
    if sp is None:
        return data
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(str(k) for k in data.tensors.keys()):
        tensor = data.tensors[key].contiguous()
        moved = tensor.to(_device_for(tensor, sp.group))
        parts = [torch.empty_like(moved) for _ in range(sp.size)]
        dist.all_gather(parts, moved, group=sp.group)
        tensors[key] = torch.cat(parts).to(tensor.device)
    return DataProto.from_dict(tensors, meta_info=dict(data.meta_info))


@overload
def own_rows(values: torch.Tensor, sp: SequenceParallel | None) -> torch.Tensor: ...
@overload
def own_rows(values: None, sp: SequenceParallel | None) -> None: ...
def own_rows(values: torch.Tensor | None, sp: SequenceParallel | None) -> torch.Tensor | None:
    """This rank's shard of per-row results computed over ``gather_rows``'s union."""
    if sp is None or values is None:
        return values
    rows = values.shape[0] // sp.size
    return values[sp.rank * rows : (sp.rank + 1) * rows]


# ---------------------------------------------------------------------------------------- layout
@dataclass
class Columns:
    """One forward laid out for a sequence-parallel group: this rank's ``input_ids`` and ``position_ids``
    ``(G, W / size)`` (columns ``start`` onward), and the whole ``(G, 1, W, W)`` boolean mask (True: attends),
    or None for causal attention alone."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    start: int
    width: int


def left_aligned(
    input_ids: torch.Tensor, position_ids: torch.Tensor, padding: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows whose real tokens (``padding`` 1) are one run each, moved to the first columns, so that causal
    attention alone sees exactly each row's earlier tokens: no mask, where a ``(W, W)`` one per layer (sdpa
    keeps a float copy for its backward) would cost more than a long sequence's activations. Positions travel
    with their tokens. None when some row's real tokens have gaps."""
    real = padding.bool()
    first = (real.cumsum(1) == 0).sum(1)
    count = real.sum(1)
    width = input_ids.shape[1]
    columns = torch.arange(width)[None]
    if not torch.equal(real, (columns >= first[:, None]) & (columns < (first + count)[:, None])):
        return None
    source = (columns + first[:, None]).clamp(max=width - 1)
    keep = columns < count[:, None]
    return input_ids.gather(1, source) * keep, position_ids.gather(1, source) * keep


def causal_mask(padding: torch.Tensor) -> torch.Tensor:
    """``(G, W)`` 0/1 padding mask -> ``(G, 1, W, W)`` bool: a real token attends to the real tokens up to
    itself; a padding column only to itself (its output is never read, and a row with no key would be NaN)."""
    width = padding.shape[1]
    real = padding.bool()
    allowed = torch.ones(width, width, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
    return (allowed | torch.eye(width, dtype=torch.bool))[:, None]


def split_columns(
    input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor | None, sp: SequenceParallel
) -> Columns:
    """Pad the ``W`` columns to a multiple of the group size (padding columns attend only to themselves, or
    causally, after every real one) and take this rank's slice; ``allowed`` ``(G, 1, W, W)`` bool (None:
    causal) stays whole, as attention sees every column."""
    width = input_ids.shape[1]
    padded = -(-width // sp.size) * sp.size
    extra = padded - width
    if extra:
        input_ids = F.pad(input_ids, (0, extra))
        position_ids = F.pad(position_ids, (0, extra))
    if extra and allowed is not None:
        allowed = F.pad(allowed, (0, extra, 0, extra))
        tail = torch.arange(width, padded)
        allowed[:, :, tail, tail] = True
    local = padded // sp.size
    start = sp.rank * local
    return Columns(
        input_ids[:, start : start + local], position_ids[:, start : start + local], allowed, start, local
    )


# ---------------------------------------------------------------------------------------- attention
def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """``(b, kv_heads, s, d)`` -> ``(b, kv_heads * times, s, d)``, each head repeated in place (GQA's layout)."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def _ulysses_attention(inner: Any) -> Any:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        ulysses: SequenceParallel | None = None,
        ulysses_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention call (``query`` ``(b, heads, s, d)``, ``key``/``value`` ``(b, kv_heads, s,
        d)``, returns ``(b, s, heads, d)``); with ``ulysses`` over the whole sequence, heads split by rank, under
        ``ulysses_mask`` ``(b, 1, S, S)`` bool (None: causal) instead of the mask the model made for its slice."""
        if ulysses is None:
            return inner(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % ulysses.size:  # fewer key/value heads than ranks: each rank gets copies of its own
            key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
        q, k, v = (seq_to_heads(t, ulysses) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=ulysses_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=ulysses_mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return heads_to_seq(out, ulysses).transpose(1, 2).contiguous(), None

    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    for name, inner in (("sdpa", sdpa_attention_forward), ("eager", eager_attention_forward)):
        AttentionInterface.register(ATTENTION_PREFIX + name, _ulysses_attention(inner))
        AttentionMaskInterface.register(ATTENTION_PREFIX + name, ALL_MASK_ATTENTION_FUNCTIONS[name])


def ulysses_problems(model: PreTrainedModel, size: int) -> list[str]:
    """What keeps ``model``'s forwards from running sequence-parallel over ``size`` ranks exactly: the
    attention here is plain softmax attention over the whole sequence, head-split, so anything else a layer
    does along the sequence (a window, a recurrent state, sinks, soft-capping) would be lost."""
    shape = model.config.get_text_config()
    impl = model.config._attn_implementation.removeprefix(ATTENTION_PREFIX)
    heads = shape.num_attention_heads
    layout = layer_layout(model.config)
    problems = [
        (impl not in ("sdpa", "eager"), f"attention implementation {impl!r} (needs sdpa or eager)"),
        (shape is not model.config, "a vision tower (sequence parallelism covers text models only)"),
        (heads % size != 0, f"{heads} attention heads, which {size} ranks cannot share evenly"),
        ("sliding_attention" in layout.types, "sliding-window attention"),
        (
            bool(layout.recurrent),
            f"{' and '.join(layout.recurrent)} layers (their state runs along the sequence)",
        ),
        (any(name.endswith(".sinks") for name, _ in model.named_parameters()), "attention sinks"),
        (getattr(shape, "attn_logit_softcapping", None) is not None, "attention logit soft-capping"),
    ]
    return [what for failed, what in problems if failed]


def enable_ulysses(model: PreTrainedModel, size: int, key: str) -> None:
    """Let ``model``'s forwards run sequence-parallel over groups of ``size`` when called with ``ulysses=``
    (they behave as before otherwise). A ``UserError`` naming ``key`` and the model type for a model whose
    attention heads do not divide by ``size``, or whose layers are not plain attention (``ulysses_problems``)."""
    impl = model.config._attn_implementation
    if impl.startswith(ATTENTION_PREFIX):
        return
    problems = ulysses_problems(model, size)
    if problems:
        kind = layer_layout(model.config).model_type
        raise UserError(f"{key}={size}: {kind} has {problems[0]}; use {key}=1 for this model")
    if ATTENTION_PREFIX + impl not in _registered():
        _register()
    model.config._attn_implementation = ATTENTION_PREFIX + impl


def _registered() -> set[str]:
    from transformers import AttentionInterface

    return set(AttentionInterface._global_mapping)


def takes_4d_mask(model: PreTrainedModel) -> bool:
    """Whether ``model``'s attention takes a 4-D mask (eager and SDPA do; flash-attention kernels do not)."""
    impl = model.config._attn_implementation.removeprefix(ATTENTION_PREFIX)
    return impl in ("eager", "sdpa")
