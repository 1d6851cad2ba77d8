"""Rollout engines: ``hf`` (Hugging Face ``generate``, runs anywhere torch does)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.workers.rollout.hf_rollout import HFRollout, SamplingParams, response_mask_from

__all__ = ["HFRollout", "SamplingParams", "build_rollout", "response_mask_from"]


def build_rollout(rollout: Any, module: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  response_length: int) -> HFRollout:
    """The engine named by ``rollout.name`` (``rollout``: a ``RolloutConfig``), sampling from ``module``
    (shared with the actor)."""
    name = rollout.name
    if name == "hf":
        return HFRollout(module, tokenizer, rollout, response_length)
    if name == "vllm":
        raise NotImplementedError("actor_rollout_ref.rollout.name=vllm: the vLLM rollout engine is not "
                                  "implemented yet; use rollout.name=hf (Hugging Face generate)")
    raise ValueError(f"unknown rollout engine {name!r}; known: hf")
