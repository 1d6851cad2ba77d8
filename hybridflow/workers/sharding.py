"""Model wrapping for training what does not fit in one process: FSDP2 sharding and LoRA adapters.

Why: with DDP-style data parallelism every rank holds the whole model, its gradients and two AdamW moments
(16 bytes per fp32 parameter). ``fully_shard`` (FSDP2) splits each decoder layer's parameters, gradients
and optimiser state across the worker group's ranks, so each holds ~1/world_size of them and gathers one
layer's full weights at a time for its forward and backward. LoRA (``peft``) trains small low-rank adapters
on a frozen base model instead, so gradients and optimiser state shrink to the adapters' size, and the
reference policy is the same module with the adapter switched off (no second copy of the weights).

Strategies (``actor.strategy``, ``ref.strategy``, ``critic.strategy``):

- ``ddp``: full replicas, gradients all-reduced by ``TrainingEngine`` (the default, ``auto``).
- ``fsdp2``: ``fully_shard`` on every decoder layer, then the root, over a device mesh of the group's ranks
  (gloo on CPU, nccl on GPU); ``fsdp_config.fsdp_size`` < world size shards within groups of that size and
  replicates across them (HSDP). One CPU rank is not wrapped; one GPU is (bf16 compute, `param_offload`).
  Checkpoints keep the sharded format either way.
  Only rank 0 reads the checkpoint: the ranks build the model with its parameters on the meta device and
  receive their shards from it one tensor at a time (``reads_weights``, ``shard_module``); rank 0 reads a
  safetensors checkpoint tensor by tensor too, so no rank ever holds the full weights.
- ``single``: one rank only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from hybridflow.config import FSDPConfig
from hybridflow.models.vision import lora_targets
from hybridflow.protocol import DataProto
from hybridflow.workers.gathering import whole_tensors
from hybridflow.workers.lora_merge import LoraMerge
from hybridflow.workers.packing import MicroBatching

STRATEGIES = ("auto", "ddp", "fsdp2", "single")
LORA_MARKERS = (".lora_A.", ".lora_B.")


def resolve_strategy(strategy: str, world_size: int, key: str = "actor_rollout_ref.actor.strategy") -> str:
    """``auto`` -> ``ddp`` (full replicas: fastest while the model fits; set ``fsdp2`` when it does not)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{key} must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if strategy == "single" and world_size > 1:
        raise ValueError(
            f"{key}=single runs on one rank, but the worker group has {world_size}; "
            "use ddp or fsdp2, or trainer.n_workers=1"
        )
    return "ddp" if strategy == "auto" else strategy


def reads_weights(strategy: str, lora_rank: int = 0, streamed: bool = False) -> bool:
    """Whether this rank loads the model with its weights: all do, except the ranks > 0 of a sharded
    (``fsdp2``) model over several ranks, which build it with its parameters on the meta device and receive
    their shards from rank 0 in ``shard_module``; with ``streamed`` (the caller gives ``wrap_model`` a
    ``weights`` source, e.g. ``modeling.weights_source``) rank 0 does too, and sends the checkpoint's
    tensors one at a time. LoRA models load on every rank (peft builds its adapters on real tensors)."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if strategy != "fsdp2" or lora_rank > 0 or not multi:
        return True
    return dist.get_rank() == 0 and not streamed


def load_placement(strategy: str, dtype: str | None, device: torch.device) -> tuple[torch.device, str | None]:
    """Where and in which dtype to load a model before ``wrap_model``: FSDP2 loads on the CPU (each
    layer moves to ``device`` as it is sharded, so the full model never sits on one GPU) in fp32 on CUDA
    (master weights; its mixed-precision policy computes in bf16)."""
    if strategy != "fsdp2":
        return device, dtype
    return torch.device("cpu"), "fp32" if device.type == "cuda" else dtype


def wrap_model(
    module: nn.Module,
    strategy: str,
    fsdp_config: FSDPConfig,
    device: torch.device,
    lora_rank: int = 0,
    lora_alpha: int = 16,
    target_modules: list[str] | str | tuple[str, ...] = ("all-linear",),
    weights: Callable[[nn.Module], Mapping[str, torch.Tensor]] | None = None,
) -> PreTrainedModel:
    """LoRA adapters (``lora_rank`` > 0), then FSDP2 sharding for ``strategy`` ``fsdp2`` (``weights``: rank 0's
    source of full tensors for a module built on the meta device, ``shard_module``).

    Typed as the Hugging Face model it holds (``as_hf_model``)."""
    module = apply_lora(module, lora_rank, lora_alpha, list(target_modules))
    return as_hf_model(shard_module(module, fsdp_config, device, weights) if strategy == "fsdp2" else module)


def as_hf_model(module: nn.Module) -> PreTrainedModel:
    """A Hugging Face model, LoRA-wrapped or sharded, typed as the model it holds: FSDP2 keeps the model's
    class (it subclasses it), and a peft wrapper forwards the model's attributes (``config``,
    ``save_pretrained``...) to it."""
    return cast(PreTrainedModel, module)


def apply_lora(
    module: nn.Module,
    rank: int,
    alpha: int,
    target_modules: list[str] | str,
    task_type: str | None = "CAUSAL_LM",
) -> nn.Module:
    """``module`` wrapped in a ``peft`` LoRA model (base weights frozen); ``rank`` 0 returns it unchanged.

    ``target_modules``: ``["all-linear"]`` (every linear layer but the output layer; of a vision-language
    model, every linear layer of its language model) or module names. ``task_type`` None: a plain
    ``PeftModel`` (a reward model: peft's sequence-classification wrapper would rename its head, which the
    saved Hugging Face folder must keep as it is)."""
    if rank <= 0:
        return module
    from peft import LoraConfig, get_peft_model

    targets = target_modules
    if isinstance(targets, (list, tuple)) and list(targets) == ["all-linear"]:
        targets = "all-linear"
    targets = lora_targets(module, targets)  # a vision-language model: its language model's layers
    return get_peft_model(
        module,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
            task_type=task_type,
        ),
    )


def is_lora(module: nn.Module) -> bool:
    return hasattr(module, "peft_config")


def broadcast_module(module: nn.Module) -> None:
    """Rank 0's weights on every rank (a fresh value head or LoRA ``A`` matrix is random per rank).

    nccl only moves GPU memory: a model still on the CPU (FSDP2 shards it from there) goes one tensor at a
    time through the current GPU."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _broadcast(module.state_dict().values())


def _broadcast(tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` (the same list on every rank) copied into them on every rank."""
    staged = collective_device().type == "cuda"
    for tensor in tensors:
        if staged and tensor.device.type == "cpu":
            on_gpu = tensor.cuda()
            dist.broadcast(on_gpu, src=0)
            tensor.copy_(on_gpu)
        else:
            dist.broadcast(tensor, src=0)


def _decoder_layers(module: nn.Module) -> list[nn.Module]:
    """Every transformer block: the children of the model's ``layers`` ``ModuleList`` (Llama, Qwen,
    Mistral...; GPT-2 calls it ``h``), and a vision-language model's vision blocks too (Qwen's ``blocks``,
    CLIP's ``layers``), each list found once."""
    blocks: list[nn.Module] = []
    found: list[str] = []  # the lists taken, whose own sub-lists are parts of their blocks
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or name.rsplit(".", 1)[-1] not in ("layers", "h", "blocks"):
            continue
        if len(child) and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
            blocks += list(child)
    if blocks:
        return blocks
    raise ValueError(
        f"cannot shard {type(module).__name__}: no decoder-layer list (a ModuleList named "
        "'layers' or 'h') was found; use strategy ddp for this model"
    )


def shard_module(
    module: nn.Module,
    fsdp_config: FSDPConfig,
    device: torch.device,
    weights: Callable[[nn.Module], Mapping[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over all ranks of the default process group.

    Returns ``module`` itself (now an ``FSDPModule`` on ``device``) holding rank 0's weights. A module built
    with its parameters on the meta device (``modeling.parameters_on_meta``) receives only its shards, streamed
    from rank 0 one tensor at a time; rank 0 takes each full tensor from ``weights(module)`` (the checkpoint's
    tensors, read as they are asked for: ``weights_source``), or from its own state dict when it loaded the
    model itself. So no rank holds the full model, not even rank 0 when the checkpoint is read tensor by tensor.
    A LoRA model (loaded by every rank) gets rank 0's weights broadcast whole first, as its random adapters
    differ by rank.

    On CUDA, parameters compute in bf16 and gradients reduce in fp32 (``module`` should be loaded in fp32:
    those are the master weights), and ``fsdp_config.param_offload`` keeps the shards in CPU memory between
    uses. A single GPU gets the same wrapping over a process group of its one rank, so both policies apply
    there too (verl's single-GPU recipe). On CPU neither does anything, and one rank returns
    ``module.to(device)``: there is nothing to shard, offload or cast."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if device.type != "cuda":
            return module.to(device)
        if not dist.is_initialized():  # one GPU: a process group of one rank, in memory
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    lora = is_lora(module)
    if lora:
        broadcast_module(module)
    full = None  # rank 0's full tensors by name: read from the checkpoint as they are asked for, or those of
    if (
        not lora and dist.get_rank() == 0
    ):  # the module it loaded, held while fully_shard swaps them for shards
        full = weights(module) if on_meta(module) and weights is not None else module.state_dict()
    world = dist.get_world_size()
    shard = world if fsdp_config.fsdp_size in (-1, None) else fsdp_config.fsdp_size
    if shard < 1 or world % shard:
        raise ValueError(
            f"fsdp_config.fsdp_size={fsdp_config.fsdp_size} must divide the {world} ranks (or be -1)"
        )
    mesh = (
        init_device_mesh(device.type, (world,))
        if shard == world
        else init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    )
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": fsdp_config.reshard_after_forward}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if fsdp_config.param_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    _wrap(module, kwargs, device)
    if not lora:
        _receive_shards(module, full, torch.device("cpu") if "offload_policy" in kwargs else device)
    return module


def _wrap(module: nn.Module, kwargs: dict[str, Any], device: torch.device) -> None:
    """``fully_shard`` every decoder layer, then the root, with ``kwargs``; on CPU without backward prefetch."""
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(module)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    if device.type == "cpu":
        _without_backward_prefetch([*layers, module])


def _without_backward_prefetch(units: list[nn.Module]) -> None:
    """On CPU, FSDP2's gathers block the thread that runs the backward, so its default of gathering the next
    unit before the current one's backward overlaps nothing and only holds a second layer's full weights (with
    the layers' prefetch off, a 4-rank update of the 199M model peaked 50 MB lower per rank in the same time):
    each unit is told to prefetch itself, which it holds already."""
    from torch.distributed.fsdp import FSDPModule

    for unit in units:
        cast(FSDPModule, unit).set_modules_to_backward_prefetch([cast(FSDPModule, unit)])


def on_meta(module: nn.Module) -> bool:
    """Whether ``module``'s parameters have no storage yet (built with ``modeling.parameters_on_meta``)."""
    return any(p.device.type == "meta" for p in module.parameters())


def _receive_shards(module: nn.Module, full: Mapping[str, torch.Tensor] | None, device: torch.device) -> None:
    """Fill the shards of a freshly sharded ``module`` from rank 0's full tensors ``full`` (None on the
    other ranks): parameter by parameter, rank 0 broadcasts the full tensor and every rank copies its own
    slice, so each holds one full tensor at a time. Parameters still on the meta device are allocated on
    ``device`` first, keeping the buffers the model computed; rank 0's buffers are copied to every rank at
    the end (all of them, including those no state dict holds: rotary frequencies)."""
    if on_meta(module):
        buffers = {name: b.detach().clone() for name, b in module.named_buffers() if b.device.type != "meta"}
        module.to_empty(device=device)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    for name, param in module.named_parameters():  # a tied weight once, under its first name
        _receive_shard(param, None if full is None else full[name])
    _broadcast(module.buffers())


@torch.no_grad()
def _receive_shard(param: torch.Tensor, tensor: torch.Tensor | None) -> None:
    """Rank 0's full ``tensor`` (None elsewhere) broadcast, and this rank's slice of it copied into ``param``;
    nothing of it outlives the call."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    staging = collective_device()
    if tensor is None:
        tensor = torch.empty(param.shape, dtype=param.dtype, device=staging)
    else:
        tensor = tensor.to(staging, param.dtype)
    dist.broadcast(tensor, src=0)
    if isinstance(param, DTensor):
        local = distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(tensor)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def agreed_count(batching: MicroBatching, data: DataProto, module: nn.Module) -> int:
    """How many micro-batches this rank must cut its shard ``data`` into: the largest of the ranks' own
    ``batching.count`` when ``module`` is sharded over several ranks, else 0 (the rank decides alone, and the
    count is not computed twice).

    Why: every forward and backward of a sharded module all-gathers (and reduce-scatters) with the other
    ranks, so all of them must run as many micro-batches as the rank that needs the most; a token budget
    gives each rank's shard its own count (``packing.MicroBatching``)."""
    if not (is_sharded(module) and dist.is_initialized() and dist.get_world_size() > 1):
        return 0
    value = torch.tensor([batching.count(data)], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def collective_device() -> torch.device:
    """Where a small tensor sent through a collective must live: nccl moves GPU memory only, gloo CPU memory."""
    return torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")


@contextlib.contextmanager
def gathered(module: nn.Module, reshard_after_forward: bool = True) -> Iterator[nn.Module]:
    """Full weights on every rank inside the block, sharded again after it (freeing the gathered copies);
    then forwards reshard as ``reshard_after_forward`` (the module's ``fsdp_config``) says.

    Why: a sharded forward all-gathers each layer's weights from the other ranks, so every rank must run
    the same forwards in step; ``generate`` stops when *this rank's* sequences end, which would deadlock
    ranks whose samples differ in length. Inside the block forwards are purely local."""
    if not is_sharded(module):
        yield module
        return
    from torch.distributed.fsdp import FSDPModule

    parts = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for part in parts:
        part.unshard()
        part.set_reshard_after_forward(False)
    try:
        yield module
    finally:
        for part in parts:
            part.reshard()
            part.set_reshard_after_forward(reshard_after_forward)


@contextlib.contextmanager
def lockstep(module: nn.Module, reshard_after_forward: bool = True) -> Iterator[nn.Module]:
    """Forwards of a sharded module inside the block that need no full copy on any rank: each forward
    gathers one layer at a time (FSDP2's own gathering, layers freed after use) while the ranks step together.

    Why: each forward's gathers are collectives, so every rank must run as many forwards as the rank that runs
    the most (a rank decodes until *its* sequences end). Every forward first tells the others it wants to run
    (an all-reduce before FSDP's own pre-forward hook); at the end of the block a rank that is done runs a
    one-token idle forward for each forward another rank still announces, until none does. No effect on an
    unsharded module. An exception inside the block on one rank leaves the others waiting: it is meant for
    code that fails on every rank alike, or not at all. Afterwards forwards reshard as
    ``reshard_after_forward`` (the module's ``fsdp_config``) says."""
    if not (is_sharded(module) and dist.is_initialized() and dist.get_world_size() > 1):
        yield module
        return
    from torch.distributed.fsdp import FSDPModule

    parts = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for part in parts:
        part.set_reshard_after_forward(True)
    idle = [False]

    def announce(*_: Any) -> None:
        if not idle[0]:
            _ranks_wanting(1)

    handle = module.register_forward_pre_hook(announce, prepend=True)
    try:
        yield module
        idle[0] = True
        dummy = torch.zeros(1, 1, dtype=torch.long, device=next(module.parameters()).device)
        with torch.no_grad():
            while _ranks_wanting(0):
                module(input_ids=dummy, use_cache=False)
    finally:
        handle.remove()
        for part in parts:
            part.set_reshard_after_forward(reshard_after_forward)


def _ranks_wanting(mine: int) -> int:
    value = torch.tensor([mine], device=collective_device())
    dist.all_reduce(value)
    return int(value.item())


def full_weights(
    module: nn.Module,
    adapter_only: bool = False,
    device: torch.device | str = "cpu",
    root: int | None = None,
    group_bytes: int = 64 * 2**20,
    tied_once: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full weights as ``(name, tensor on device)`` pairs (``device="cuda"`` keeps them on the GPU
    for an in-memory weight sync into another engine), gathered from FSDP2 shards up to ``group_bytes`` of
    tensors per collective (``gathering.whole_tensors``).

    Names are the base Hugging Face model's (``model.layers.0.self_attn.q_proj.weight``), what
    ``save_pretrained``, vLLM's ``load_weights`` and ``load_state_dict`` of an unwrapped model expect. A LoRA
    model yields its base weights with the adapters merged in (``W + alpha/r * B @ A``); with
    ``adapter_only`` it yields only the adapter tensors under peft's names (what ``PeftModel`` saves:
    ``base_model.model.<...>.lora_A.weight``). A tied tensor (SmolLM2's embedding and ``lm_head``) comes under
    each of its names, or with ``tied_once`` under its first alone, gathered once: what a receiver whose
    model ties them too needs (a weight sync; 113 MB less for SmolLM2).

    A collective on a sharded module: every rank must iterate it to the end, in step; all ranks receive
    the same tensors, or with ``root`` that rank alone (the others yield nothing). Unsharded tensors already on
    ``device`` are the module's own (read, do not modify)."""
    lora = is_lora(module)
    merge = LoraMerge(module) if lora and not adapter_only else None
    state = weight_state(module, adapter_only, tied_once)
    for name, tensor in whole_tensors(state, device, root, group_bytes):
        if merge is not None:
            yield from merge.feed(name, tensor)
        elif adapter_only:
            yield name.replace(".default.", "."), tensor
        else:
            yield name, tensor
    if merge is not None:
        merge.finish()


def weight_state(
    module: nn.Module, adapter_only: bool = False, tied_once: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """The module's own tensors (``state_dict``: on a sharded module, each rank's shards as DTensors) that
    ``full_weights`` makes whole, in order: with ``adapter_only`` a LoRA model's adapters alone, with
    ``tied_once`` a tied tensor under its first name alone."""
    lora = is_lora(module)
    state = list(module.state_dict().items())
    if adapter_only:
        state = [(name, t) for name, t in state if lora and any(marker in name for marker in LORA_MARKERS)]
    if tied_once:
        first = {name for name, _ in module.named_parameters()}  # a shared parameter under its first name
        aliases = {name for name, _ in module.named_parameters(remove_duplicate=False)} - first
        state = [(name, t) for name, t in state if name not in aliases]
    return state


def unwrapped(module: nn.Module) -> PreTrainedModel:
    """The Hugging Face model under a peft wrapper (``module`` itself otherwise): its class and config
    describe what ``full_weights`` yields."""
    from peft import PeftModel

    model = module.get_base_model() if isinstance(module, PeftModel) else module
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a Hugging Face model (under its peft wrapper), got {type(model).__name__}")
    return model
