"""Rollout engines: ``hf`` (a decoding loop over the Hugging Face model, runs anywhere torch does) and ``vllm`` (vLLM in the
actor's process, CUDA or CPU build; imported only when asked for), either optionally driven by the
multi-turn agent loop (``rollout.multi_turn.enable``)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.config import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.tools import load_tools
from hybridflow.workers.modeling import resolve_dtype
from hybridflow.workers.rollout.agent_loop import AgentLoop, agent_metrics
from hybridflow.workers.rollout.hf_rollout import (
    HFRollout,
    SamplingParams,
    assemble_rollout,
    response_mask_from,
)

__all__ = [
    "AgentLoop",
    "HFRollout",
    "SamplingParams",
    "agent_metrics",
    "assemble_rollout",
    "build_rollout",
    "check_generation_batch",
    "response_mask_from",
]

_HOW = "build it with hybridflow.generation_batch(prompts, tokenizer) (strings or chat messages)"


def check_generation_batch(prompts: DataProto) -> None:
    """A ValueError saying what to do when ``prompts`` is not a generation batch: ``input_ids``,
    ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded (every prompt ends at the last column)."""
    keys = prompts.batch.keys() if prompts.batch is not None else []
    missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in keys]
    if missing:
        raise ValueError(
            f"generate_sequences: the batch has no {', '.join(missing)}; it needs left-padded "
            f"input_ids, attention_mask and position_ids (bs, P): {_HOW}"
        )
    mask = prompts.batch["attention_mask"]
    ends_in_padding = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if ends_in_padding:
        raise ValueError(
            f"generate_sequences: prompt row(s) {ends_in_padding[:5]} end in padding (attention_mask "
            "0 in the last column): the batch is right-padded, and the model would continue after "
            f"the padding; prompts must be left-padded: {_HOW}, or tokenizer.padding_side='left'"
        )


def build_rollout(
    rollout: RolloutConfig,
    module: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    response_length: int,
    model_path: str | None,
    seed: int,
    allow_unsafe_code: bool = False,
) -> Any:
    """The engine named by ``rollout.name`` (``rollout``: a ``RolloutConfig``). ``hf`` samples from ``module``
    itself (shared with the actor); ``vllm`` loads its own copy from ``model_path`` (in ``rollout.dtype``) and
    must be sent the weights after each change (``update_weights``), with ``seed`` its engine's seed
    (``rollout.seed``, null = ``trainer.seed``; the worker adds its rank). ``hf`` seeds each sample from
    ``rollout.seed``, the step and the prompt, the same on every worker (``HFRollout``). Wrapped in the agent
    loop when ``rollout.multi_turn.enable``, whose python tool may run code unisolated where this machine
    has no sandbox only with ``allow_unsafe_code`` (``sandbox.unsafe_without_isolation``)."""
    name = rollout.name
    if name == "hf":
        engine = HFRollout(module, tokenizer, rollout, response_length, rollout.seed)
    elif name == "vllm":
        from hybridflow.workers.rollout.vllm_rollout import VLLMRollout

        if model_path is None:
            raise ValueError("rollout.name=vllm needs model_path: vLLM loads the model from its folder")
        device = next(module.parameters()).device
        engine = VLLMRollout(
            model_path,
            tokenizer,
            rollout,
            response_length,
            rollout.max_model_len,
            resolve_dtype(rollout.dtype, device),
            device,
            seed,
        )
    else:
        raise ValueError(f"unknown rollout engine {name!r}; known: hf, vllm")
    multi_turn = rollout.multi_turn
    if not multi_turn.enable:
        return engine
    tools = load_tools(multi_turn.tool_config_path, allow_unsafe_code) if multi_turn.tool_config_path else {}
    return AgentLoop(engine, tokenizer, multi_turn, response_length, tools)
