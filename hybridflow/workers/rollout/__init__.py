"""Rollout engines: ``hf`` (Hugging Face ``generate``, runs anywhere torch does) and ``vllm`` (vLLM in the
actor's process, CUDA or CPU build; imported only when asked for)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.workers.modeling import resolve_dtype
from hybridflow.workers.rollout.hf_rollout import (
    HFRollout,
    SamplingParams,
    assemble_rollout,
    response_mask_from,
)

__all__ = ["HFRollout", "SamplingParams", "assemble_rollout", "build_rollout", "response_mask_from"]


def build_rollout(config: Any, module: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, response_length: int,
                  model_path: str | None = None, seed: int = 0) -> Any:
    """The engine named by ``config.name``. ``hf`` samples from ``module`` itself (shared with the actor);
    ``vllm`` loads its own copy from ``model_path`` (in ``config.dtype``) and must be sent the weights
    after each change (``update_weights``)."""
    name = getattr(config, "name", "hf") or "hf"
    if name == "hf":
        return HFRollout(module, tokenizer, config, response_length)
    if name == "vllm":
        from hybridflow.workers.rollout.vllm_rollout import VLLMRollout

        if model_path is None:
            raise ValueError("rollout.name=vllm needs model_path: vLLM loads the model from its folder")
        device = next(module.parameters()).device
        return VLLMRollout(model_path, tokenizer, config, response_length, config.max_model_len,
                           resolve_dtype(config.dtype, device), device, seed)
    raise ValueError(f"unknown rollout engine {name!r}; known: hf, vllm")
