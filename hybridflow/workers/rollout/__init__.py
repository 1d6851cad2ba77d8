"""Rollout engines: ``hf`` (Hugging Face ``generate``, runs anywhere torch does), optionally driven by the
multi-turn agent loop (``rollout.multi_turn.enable``)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.protocol import DataProto
from hybridflow.tools import load_tools
from hybridflow.workers.rollout.agent_loop import AgentLoop, agent_metrics
from hybridflow.workers.rollout.hf_rollout import HFRollout, SamplingParams, response_mask_from

__all__ = ["AgentLoop", "HFRollout", "SamplingParams", "agent_metrics", "build_rollout", "check_generation_batch",
           "response_mask_from"]

_HOW = "build it with hybridflow.generation_batch(prompts, tokenizer) (strings or chat messages)"


def check_generation_batch(prompts: DataProto) -> None:
    """A ValueError saying what to do when ``prompts`` is not a generation batch: ``input_ids``,
    ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded (every prompt ends at the last column)."""
    keys = prompts.batch.keys() if prompts.batch is not None else []
    missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in keys]
    if missing:
        raise ValueError(f"generate_sequences: the batch has no {', '.join(missing)}; it needs left-padded "
                         f"input_ids, attention_mask and position_ids (bs, P): {_HOW}")
    mask = prompts.batch["attention_mask"]
    ends_in_padding = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if ends_in_padding:
        raise ValueError(f"generate_sequences: prompt row(s) {ends_in_padding[:5]} end in padding (attention_mask "
                         "0 in the last column): the batch is right-padded, and the model would continue after "
                         f"the padding; prompts must be left-padded: {_HOW}, or tokenizer.padding_side='left'")


def build_rollout(rollout: Any, module: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  response_length: int) -> HFRollout | AgentLoop:
    """The engine named by ``rollout.name`` (``rollout``: a ``RolloutConfig``), sampling from ``module``
    (shared with the actor); wrapped in the agent loop when ``rollout.multi_turn.enable``."""
    name = rollout.name
    if name == "hf":
        engine = HFRollout(module, tokenizer, rollout, response_length)
    elif name == "vllm":
        raise NotImplementedError("actor_rollout_ref.rollout.name=vllm: the vLLM rollout engine is not "
                                  "implemented yet; use rollout.name=hf (Hugging Face generate)")
    else:
        raise ValueError(f"unknown rollout engine {name!r}; known: hf")
    multi_turn = rollout.multi_turn
    if not multi_turn.enable:
        return engine
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
    return AgentLoop(engine, tokenizer, multi_turn, response_length, tools)
