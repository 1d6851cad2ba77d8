"""Rollout engines and the rollout modes of the workers: ``hf`` (a decoding loop over the Hugging Face model,
runs anywhere torch does) and ``vllm`` (vLLM in the actor's process, CUDA or CPU build; ``vllm`` itself is
imported only when that engine is built), both registered by name in the rollout registry
(``hybridflow.rollout``); the multi-turn agent loop over any engine (``rollout.multi_turn.enable``); the
served rollout (``rollout.served_agent.path``: an ``openai``-SDK agent over ``hybridflow.serving``'s server).

``build_rollout`` is the one place that turns a worker's rollout config into what it generates with: the
registered engine, wrapped by the mode the config asks for."""

from __future__ import annotations

from collections.abc import Callable

import hybridflow.workers.rollout.vllm_rollout  # noqa: F401 - registers "vllm" (vllm is imported when built)
from hybridflow import rollout as contract
from hybridflow.config import RolloutConfig
from hybridflow.rollout import EngineSpec, Rollout, RolloutEngine, rollout_class
from hybridflow.serving import ServedRollout
from hybridflow.tools import load_tools
from hybridflow.utils.deprecation import moved_names
from hybridflow.workers.modeling import load_image_prompts
from hybridflow.workers.rollout.agent_loop import AgentLoop, agent_metrics
from hybridflow.workers.rollout.hf_rollout import HFRollout

__all__ = ["AgentLoop", "HFRollout", "agent_metrics", "build_rollout", "records_routing"]

# engine-neutral names this package exported before the rollout contract got a room of its own
__getattr__ = moved_names(
    __name__,
    contract,
    ["SamplingParams", "assemble_rollout", "check_generation_batch", "response_mask_from"],
)


def build_rollout(
    spec: EngineSpec,
    engine: type[RolloutEngine] | None = None,
    weight_version: Callable[[], int] = lambda: 0,
    allow_unsafe_code: bool = False,
) -> Rollout:
    """The engine ``engine`` (default: the one registered as ``spec.config.name``) built from ``spec``; in the
    agent loop when ``rollout.multi_turn.enable``, behind the served agent's endpoint when
    ``rollout.served_agent.path`` (``weight_version``: the version its answers report). The agent loop's python
    tool may run code unisolated where this machine has no sandbox only with ``allow_unsafe_code``
    (``sandbox.unsafe_without_isolation``)."""
    built = (engine or rollout_class(spec.config.name)).from_spec(spec)
    multi_turn = spec.config.multi_turn
    if spec.config.served_agent.path is not None:
        # a vision-language policy's agents may send pictures: the server reads them with the model's processor
        processor = load_image_prompts(spec.model_path, spec.tokenizer) if spec.model_path else None
        return ServedRollout(
            built, spec.tokenizer, spec.config, spec.response_length, weight_version, processor=processor
        )
    if not multi_turn.enable:
        return built
    tools = load_tools(multi_turn.tool_config_path, allow_unsafe_code) if multi_turn.tool_config_path else {}
    return AgentLoop(built, spec.tokenizer, multi_turn, spec.response_length, tools)


def records_routing(config: RolloutConfig, engine: type[RolloutEngine] | None = None) -> bool:
    """Whether what ``build_rollout`` makes from the rollout ``config`` returns each token's chosen experts:
    an engine that records them (``Capabilities.records_routing``) not wrapped by the agent loop or a served
    agent (which assemble their turns themselves)."""
    engine_class = engine or rollout_class(config.name)
    wrapped = config.multi_turn.enable or config.served_agent.path is not None
    return engine_class.capabilities.records_routing and not wrapped
