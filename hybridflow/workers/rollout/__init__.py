"""Rollout engines: ``hf`` (Hugging Face ``generate``, runs anywhere torch does), optionally driven by the
multi-turn agent loop (``rollout.multi_turn.enable``)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.tools import load_tools
from hybridflow.workers.rollout.agent_loop import AgentLoop, agent_metrics
from hybridflow.workers.rollout.hf_rollout import HFRollout, SamplingParams, response_mask_from

__all__ = ["AgentLoop", "HFRollout", "SamplingParams", "agent_metrics", "build_rollout", "response_mask_from"]


def build_rollout(config: Any, module: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  response_length: int) -> HFRollout | AgentLoop:
    """The engine named by ``config.name``, sampling from ``module`` (shared with the actor); wrapped in
    the agent loop when ``config.multi_turn.enable``."""
    name = getattr(config, "name", "hf") or "hf"
    if name == "hf":
        engine = HFRollout(module, tokenizer, config, response_length)
    elif name == "vllm":
        raise NotImplementedError("actor_rollout_ref.rollout.name=vllm: the vLLM rollout engine is not "
                                  "implemented yet; use rollout.name=hf (Hugging Face generate)")
    else:
        raise ValueError(f"unknown rollout engine {name!r}; known: hf")
    multi_turn = config.multi_turn
    if not multi_turn.enable:
        return engine
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
    return AgentLoop(engine, tokenizer, multi_turn, response_length, tools)
