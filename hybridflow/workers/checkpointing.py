"""A trainable worker's checkpoint: a plain Hugging Face model folder plus its optimiser state.

``<path>/huggingface/`` loads with ``AutoModel*.from_pretrained`` and no hybridflow (weights, config,
tokenizer with its chat template); ``<path>/optim.pt`` holds the optimiser and schedule (identical on
every data-parallel rank, so rank 0 writes it) and ``<path>/rng_rank<r>.pt`` each rank's random state.
The driver writes all of it inside a temporary folder that it renames only once every part is there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.utils.errors import MissingInputError, UserError
from hybridflow.utils.rng import get_rng_state, set_rng_state
from hybridflow.workers.engine import TrainingEngine

HF_DIR = "huggingface"


def save_worker_state(path: str | Path, module: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None,
                      engine: TrainingEngine, rank: int) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        module.save_pretrained(path / HF_DIR, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path / HF_DIR)
        torch.save(engine.state_dict(), path / "optim.pt")
    torch.save(get_rng_state(), path / f"rng_rank{rank}.pt")


def load_hf_weights(module: PreTrainedModel, folder: str | Path) -> None:
    """Load safetensors weights (single file or shards) saved by ``save_pretrained`` into ``module``."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    state = {}
    for name in files:
        try:
            state.update(load_file(folder / name))
        except (OSError, SafetensorError) as e:
            raise UserError(f"{folder / name} cannot be read ({e}): the checkpoint is damaged; resume from an "
                            "earlier one") from e
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = set(getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied]
    if really_missing or unexpected:
        raise UserError(f"checkpoint {folder} does not match the model: missing {really_missing[:5]}, "
                        f"unexpected {unexpected[:5]}; resume with the model (actor_rollout_ref.model.path) it "
                        "was trained from")


def load_worker_state(path: str | Path, module: PreTrainedModel, engine: TrainingEngine, rank: int) -> None:
    path = Path(path)
    for needed in (path / HF_DIR, path / "optim.pt"):
        if not needed.exists():
            raise MissingInputError(f"incomplete checkpoint: {needed} is missing; resume from an earlier one")
    load_hf_weights(module, path / HF_DIR)
    engine.load_state_dict(torch.load(path / "optim.pt", weights_only=False))
    rng = path / f"rng_rank{rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=True))
