"""The rollout contract: the ``Rollout`` protocol every engine and rollout mode implements, and the
engine-neutral pieces they all use.

A rollout turns a batch of left-padded prompts into a batch of samples laid out one way (``attach_responses``
says which columns), so the trainer's step, the multi-turn agent loop and the served endpoint drive any engine
alike. What an engine can do beyond that is *declared* (``Capabilities``) rather than probed: whether it keeps
its own copy of the weights (vLLM: the worker must send it every update) and whether it can take newer weights
between decoding steps (what a partial rollout needs). Engines are built by name from the registry
(``registry.py``) out of an ``EngineSpec``; modes (the agent loop, the served rollout) wrap an engine and pass
its capabilities on.

Weight versions: an asynchronous run records per token the version of the weights that sampled it
(``rollout_weight_versions``); ``tag_weight_versions`` is the one place that writes that column.

Scores: a rollout that scores its own samples (a served agent returns each session's reward) attaches them
(``attach_scores``: ``rm_scores`` on each row's last response token, verl's name for scores that come with
the batch, and ``reward_extra/<key>`` columns); the trainer then takes them (``rollout_scores``) instead of
calling a reward function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.algorithms import sequence_to_token_scores
from hybridflow.config import RolloutConfig, SamplingConfig
from hybridflow.protocol import DataProto
from hybridflow.protocol.columns import top_keys

#: the sampling settings a batch's ``meta_info`` may override for one generation
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "n", "response_length")
VERSIONS = "rollout_weight_versions"
SCORES, EXTRA = "rm_scores", "reward_extra/"


@dataclass
class SamplingParams:
    """How to sample; the rollout config (a ``SamplingConfig``) gives the values, ``meta_info`` may override
    any of them. No defaults here: the schema holds them."""

    response_length: int
    n: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int

    @classmethod
    def from_config(
        cls, config: SamplingConfig, response_length: int, overrides: dict[str, Any] | None = None
    ) -> SamplingParams:
        """``config``'s sampling with the ``SAMPLING_KEYS`` of ``overrides`` (a batch's ``meta_info``) laid over
        it; temperature 0 means greedy, as in vLLM."""
        values: dict[str, Any] = {
            "n": config.n,
            "do_sample": config.do_sample,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
            "response_length": response_length,
        }
        values.update({k: v for k, v in (overrides or {}).items() if k in SAMPLING_KEYS and v is not None})
        params = cls(**values)
        if params.temperature <= 0:
            params.do_sample, params.temperature = False, 1.0
        return params


@dataclass(frozen=True)
class Capabilities:
    """What a rollout does beyond ``generate_sequences``, declared by its class so that the worker and the
    driver decide without probing for methods.

    ``own_weights``: it samples from a copy of the weights of its own (vLLM), so the worker sends it the
    actor's weights after every change (``update_weights``); False: it samples from the actor's module
    itself and needs nothing. ``follows_weights``: it takes newer weights between decoding steps
    (``follow_weights``), which an asynchronous run's partial rollout needs. ``records_routing``: for an MoE
    model it can return each token's chosen experts (``routed_experts``), which the trainer replays
    (``router_replay.mode=R3``)."""

    own_weights: bool = False
    follows_weights: bool = False
    records_routing: bool = False


class WeightFeed(Protocol):
    """Where a rollout's weights come from while it generates (an asynchronous run's rollout worker):
    ``version`` is the weight version the module holds now; ``refresh()`` loads a newer one that arrived
    since, if any, into the module and says whether it did."""

    version: int

    def refresh(self) -> bool:
        """Load a newer version into the module if one arrived; whether one did."""
        ...


class Rollout(Protocol):
    """A rollout engine or mode: ``generate_sequences`` plus what it declares in ``capabilities``.

    Subclass it explicitly to inherit the defaults below (no reseeding, no weights of its own, no following
    of weights); an engine that declares a capability overrides the method that goes with it.
    ``eos_token_ids``: the ids that end a sample (the agent loop and the server cut turns at them)."""

    capabilities: Capabilities = Capabilities()
    eos_token_ids: list[int]

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt.

        In: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded (``check_generation_batch``);
        ``meta_info`` may override the ``SAMPLING_KEYS``. Out: ``bs * n`` rows (every input column repeated,
        interleaved) with the columns ``attach_responses`` adds, ``rollout_log_probs`` zero when greedy; a rollout
        that follows weights also tags ``rollout_weight_versions`` (``tag_weight_versions``)."""
        ...

    def reseed(self, step: int) -> None:
        """The next generations draw the samples of training step ``step`` (an engine whose draws depend on
        the step, so a resumed or asynchronous run draws what a lock-step run does); default: nothing."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the actor's weights (Hugging Face names) into the rollout's own copy; returns how many tensors
        it took. Called only when ``capabilities.own_weights``."""
        raise _undeclared(self, "declares no weights of its own (own_weights)")

    def follow_weights(self, feed: WeightFeed | None) -> None:
        """Take newer weights from ``feed`` between decoding steps of the generations that follow (None: stop).
        Called only when ``capabilities.follows_weights``."""
        if feed is not None:
            raise _undeclared(self, "cannot take new weights while it generates (follows_weights)")


def _undeclared(rollout: object, what: str) -> NotImplementedError:
    """The error of a default method called on a rollout without its capability (a real default, not an
    abstract method: a rollout that does not declare the capability inherits it)."""
    return NotImplementedError(f"{type(rollout).__name__} {what}")


@dataclass
class EngineSpec:
    """What a worker hands an engine's ``from_spec``: ``config`` (the rollout section), ``module`` (the actor's
    model: an engine that shares it samples from the weights being trained), ``tokenizer``,
    ``response_length`` (the most tokens a sample may have), ``model_path`` (the weights' local folder, for an
    engine that loads a copy of its own; None when the model came from elsewhere) and ``seed`` (this worker's
    engine seed: ``rollout.seed`` plus its rank; ``config.seed`` is the run's)."""

    config: RolloutConfig
    module: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    response_length: int
    model_path: str | None
    seed: int
    record_routing: bool = False  #: return each token's chosen experts (an MoE model replayed by the trainer)


class RolloutEngine(Rollout, Protocol):
    """A rollout the registry builds by name (``register_rollout``): a ``Rollout`` with ``from_spec``."""

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> Rollout:
        """The engine for a worker, from what the worker holds."""
        ...


_HOW = "build it with hybridflow.generation_batch(prompts, tokenizer) (strings or chat messages)"


def check_generation_batch(prompts: DataProto) -> None:
    """A ValueError saying what to do when ``prompts`` is not a generation batch: ``input_ids``,
    ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded (every prompt ends at the last column)."""
    keys = top_keys(prompts.batch) if prompts.batch is not None else []
    missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in keys]
    if missing:
        raise ValueError(
            f"generate_sequences: the batch has no {', '.join(missing)}; it needs left-padded "
            f"input_ids, attention_mask and position_ids (bs, P): {_HOW}"
        )
    mask = prompts.tensors["attention_mask"]
    ends_in_padding = (mask[:, -1] == 0).nonzero().flatten().tolist()
    if ends_in_padding:
        raise ValueError(
            f"generate_sequences: prompt row(s) {ends_in_padding[:5]} end in padding (attention_mask "
            "0 in the last column): the batch is right-padded, and the model would continue after "
            f"the padding; prompts must be left-padded: {_HOW}, or tokenizer.padding_side='left'"
        )


def response_mask_from(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every response token up to and including the first EOS, 0 after it. ``(bs, L)`` int64."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


def assemble_rollout(
    expanded: DataProto,
    responses: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    eos_token_ids: list[int],
    pad_token_id: int,
) -> DataProto:
    """The batch an engine returns, from its raw samples.

    ``expanded``: the prompts repeated ``n`` times (interleaved), ``(bs*n, P)`` left-padded;
    ``responses`` ``(bs*n, L)`` sampled tokens (anything after the first EOS is replaced by pad);
    ``rollout_log_probs`` ``(bs*n, L)`` the engine's log-prob of each sampled token (zero when greedy).
    See ``attach_responses`` for the columns added."""
    response_mask = response_mask_from(responses, eos_token_ids)
    responses = torch.where(response_mask.bool(), responses, pad_token_id)
    return attach_responses(expanded, responses, response_mask, rollout_log_probs)


def attach_responses(
    rows: DataProto,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    attended: torch.Tensor | None = None,
) -> DataProto:
    """Add ``prompts``, ``responses``, ``response_mask``, ``rollout_log_probs`` (masked) and the whole
    sequence's ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P + L)`` to left-padded prompt
    ``rows``. ``attended`` ``(bs, L)`` marks the response tokens the model sees (default: ``response_mask``);
    a multi-turn rollout's tool output is seen but not trained on."""
    attended = response_mask if attended is None else attended
    prompt_ids, prompt_positions = rows.tensors["input_ids"], rows.tensors["position_ids"]
    response_positions = prompt_positions[:, -1:] + torch.arange(1, responses.shape[1] + 1)
    rows.tensors["prompts"] = prompt_ids
    rows.tensors["responses"] = responses
    rows.tensors["response_mask"] = response_mask
    rows.tensors["rollout_log_probs"] = rollout_log_probs * response_mask
    rows.tensors["input_ids"] = torch.cat([prompt_ids, responses], dim=1)
    rows.tensors["attention_mask"] = torch.cat([rows.tensors["attention_mask"], attended], dim=1)
    rows.tensors["position_ids"] = torch.cat([prompt_positions, response_positions], dim=1)
    return rows


def tag_weight_versions(batch: DataProto, versions: int | torch.Tensor) -> DataProto:
    """Set ``rollout_weight_versions`` ``(bs, L)``: per response token the weight version that sampled it,
    -1 off ``response_mask``. ``versions``: one version for every token (an int), or per token ``(bs, L)``
    (a rollout that took newer weights while it generated)."""
    mask = batch.tensors["response_mask"]
    if isinstance(versions, int):
        versions = torch.full_like(mask, versions)
    batch.tensors[VERSIONS] = versions.to(device=mask.device, dtype=torch.long).masked_fill(mask == 0, -1)
    return batch


def is_tagged(batch: DataProto) -> bool:
    """Whether the rollout recorded per token which weight version sampled it."""
    return batch.batch is not None and VERSIONS in batch.batch.keys()


def attach_scores(batch: DataProto, scores: Sequence[float], extras: Sequence[dict[str, Any]]) -> DataProto:
    """A rollout's own scores of its rows: ``scores`` ``(bs,)`` on each row's last response token as
    ``rm_scores`` ``(bs, L)`` (the placement every reward uses: ``sequence_to_token_scores``), and each key
    of ``extras`` (one dict per row) as a ``reward_extra/<key>`` column, None where a row has no value."""
    mask = batch.tensors["response_mask"]
    batch.tensors[SCORES] = sequence_to_token_scores(torch.tensor(list(scores), dtype=torch.float32), mask)
    for key in sorted({key for extra in extras for key in extra}):
        column = np.empty(len(extras), dtype=object)
        for i, extra in enumerate(extras):
            column[i] = extra.get(key)
        batch.non_tensor_batch[f"{EXTRA}{key}"] = column
    return batch


def rollout_scores(batch: DataProto) -> dict[str, Any] | None:
    """The scores a rollout attached to its rows, as a reward function returns them (``reward_tensor``,
    ``reward_extra_info``); None when it attached none."""
    if batch.batch is None or SCORES not in batch.batch.keys():
        return None
    extra = {k[len(EXTRA) :]: list(v) for k, v in batch.non_tensor_batch.items() if k.startswith(EXTRA)}
    return {"reward_tensor": batch.batch[SCORES], "reward_extra_info": extra}
