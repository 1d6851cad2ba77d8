"""A trainable worker's checkpoint: a plain Hugging Face model folder plus its optimiser state.

``<path>/huggingface/`` loads with ``AutoModel*.from_pretrained`` and no hybridflow (weights, config,
tokenizer with its chat template; a LoRA model's adapters merged in) and ``<path>/rng_rank<r>.pt`` holds each
rank's random state. The optimiser takes one of two forms:

- full replicas (``ddp``/``single``): ``<path>/optim.pt`` (identical on every rank, so rank 0 writes it);
  the model is read back from ``huggingface/``.
A vision-language model's folder also holds its processor's files (image processor, processor config, chat
template), so ``AutoModelForImageTextToText`` and ``AutoProcessor`` load it.

- sharded (``fsdp2``) or LoRA models: ``<path>/dcp/``, a torch.distributed.checkpoint of model and optimiser
  that every rank writes its own shards of, plus ``<path>/schedule.pt``. DCP reshards on load, so a run
  saved on 2 ranks resumes on 1 or 2 (or 4) ranks, sharded or not. A LoRA model also gets
  ``<path>/lora_adapter/`` (loadable with ``peft``); ``save_lora_only`` skips the merged ``huggingface/``.

The driver writes all of it inside a temporary folder that it renames only once every part is there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.data.images import ImagePrompts
from hybridflow.utils.errors import InputError, MissingInputError, UserError
from hybridflow.utils.rng import get_rng_state, set_rng_state
from hybridflow.workers.engine import TrainingEngine
from hybridflow.workers.lora_merge import base_name
from hybridflow.workers.sharding import LORA_MARKERS, full_weights, is_lora, is_sharded, unwrapped
from hybridflow.workers.weight_files import StreamedSafetensors

HF_DIR = "huggingface"
DCP_DIR = "dcp"
ADAPTER_DIR = "lora_adapter"


def save_worker_state(
    path: str | Path,
    module: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    engine: TrainingEngine,
    rank: int,
    save_lora_only: bool = False,
    processor: ImagePrompts | None = None,
) -> None:
    """Every rank calls it (a sharded model's weights are gathered collectively). ``processor``: a
    vision-language model's, saved beside the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lora = is_lora(module)
    if engine.sharded or lora:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(module, engine.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path / DCP_DIR))
        if rank == 0:
            torch.save(engine.state_dict(with_optimizer=False), path / "schedule.pt")
    elif rank == 0:
        torch.save(engine.state_dict(), path / "optim.pt")
    if lora:
        adapter = dict(full_weights(module, adapter_only=True, root=0))
        if rank == 0:
            module.peft_config["default"].save_pretrained(path / ADAPTER_DIR)
            save_file(
                {k: v.contiguous() for k, v in adapter.items()},
                path / ADAPTER_DIR / "adapter_model.safetensors",
            )
    if not (lora and save_lora_only):
        _save_hf_folder(path / HF_DIR, module, rank)
    if rank == 0 and tokenizer is not None:
        for folder in (HF_DIR, ADAPTER_DIR):
            if (path / folder).is_dir():
                tokenizer.save_pretrained(path / folder)
                if processor is not None:
                    processor.save_pretrained(path / folder)
    torch.save(get_rng_state(), path / f"rng_rank{rank}.pt")


def _save_hf_folder(folder: Path, module: PreTrainedModel, rank: int) -> None:
    """A plain Hugging Face folder of ``module``'s full weights, written by rank 0.

    A sharded or LoRA model's full tensors are gathered to rank 0 a group at a time (a collective: every rank
    takes part); rank 0 writes each to the safetensors file as it comes (``StreamedSafetensors``), so no rank
    ever holds a second copy of the model. Models whose weights transformers
    renames or fuses on saving (``save_pretrained`` reverts what loading converted) are collected on rank 0
    and saved by ``save_pretrained`` itself."""
    if not (is_lora(module) or is_sharded(module)):  # full replica, no adapters: save as it is
        if rank == 0:
            module.save_pretrained(folder, safe_serialization=True)
        return
    model = unwrapped(module)
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # e.g. lm_head.weight -> embed_tokens: once
    expected = [(name, tensor.dim()) for name, tensor in module.state_dict().items()]
    streamed = not _converts_on_save(model)
    if rank == 0:  # config, generation config, custom code: everything but the weights, as transformers does
        model.save_pretrained(folder, state_dict={}, safe_serialization=True)
    writer = StreamedSafetensors(folder, expected) if rank == 0 and streamed else None
    collected = {}
    for name, tensor in full_weights(module, root=0):  # rank 0 receives every tensor, the others none
        if name in tied:
            continue
        if writer is not None:
            writer.add(name, tensor)
        else:
            collected[name] = tensor
    if writer is not None:
        writer.close()
    elif rank == 0:
        model.save_pretrained(folder, state_dict=collected, safe_serialization=True)


def _converts_on_save(model: PreTrainedModel) -> bool:
    """Whether ``save_pretrained`` would store ``model``'s weights (LoRA adapters merged) under other names or
    shapes than its own: transformers reverts the conversions it applied on loading (e.g. fused experts).
    Probed with meta tensors."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions
        return False
    probe = {
        base_name(name): torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        for name, tensor in model.state_dict().items()
        if not any(marker in name for marker in LORA_MARKERS)
    }
    try:
        saved = revert_weight_conversion(model, dict(probe))
    except Exception:  # a conversion that cannot run on shapes alone: let save_pretrained do it all
        return True
    return {k: tuple(v.shape) for k, v in saved.items()} != {k: tuple(v.shape) for k, v in probe.items()}


def load_hf_weights(module: PreTrainedModel, folder: str | Path) -> None:
    """Load safetensors weights (single file or shards) saved by ``save_pretrained`` into ``module``."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    state = {}
    for name in files:
        try:
            state.update(load_file(folder / name))
        except (OSError, SafetensorError) as e:
            raise UserError(
                f"{folder / name} cannot be read ({e}): the checkpoint is damaged; resume from an earlier one"
            ) from e
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = set(
        getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None) or []
    )
    really_missing = [k for k in missing if k not in tied]
    if really_missing or unexpected:
        raise UserError(
            f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, "
            f"unexpected {unexpected[:5]}; resume with the model (actor_rollout_ref.model.path) it "
            "was trained from"
        )


def load_worker_state(path: str | Path, module: PreTrainedModel, engine: TrainingEngine, rank: int) -> None:
    """Every rank calls it; a ``dcp/`` checkpoint loads into any number of ranks, sharded or not."""
    path = Path(path)
    if (path / DCP_DIR).is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not (path / "schedule.pt").exists():
            raise MissingInputError(
                f"incomplete checkpoint: {path / 'schedule.pt'} is missing; resume from an earlier one"
            )
        configured = engine.optimizer_settings()  # the config's lr etc. win over the checkpoint's
        model_state, optim_state = get_state_dict(module, engine.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path / DCP_DIR))
        set_state_dict(
            module, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        engine.load_state_dict(torch.load(path / "schedule.pt", weights_only=False), configured)
    else:
        for needed in (path / HF_DIR, path / "optim.pt"):
            if not needed.exists():
                raise MissingInputError(
                    f"incomplete checkpoint: {needed} is missing; resume from an earlier one"
                )
        if is_lora(module) or engine.sharded:
            raise InputError(
                f"{path} holds full replicas (saved with strategy ddp and no LoRA); resume it with "
                "the same strategy and lora_rank=0, or start a new run from its huggingface/ folder"
            )
        load_hf_weights(module, path / HF_DIR)
        engine.load_state_dict(torch.load(path / "optim.pt", weights_only=False))
    rng = path / f"rng_rank{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=True))
