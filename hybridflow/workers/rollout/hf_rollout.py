"""Rollout with Hugging Face ``generate``: the portable engine that runs anywhere torch does.

In the hybrid engine the rollout holds the *same module* the actor trains, so it always samples from the
current weights and no second copy of the model exists.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.protocol import DataProto
from hybridflow.workers.engine import DivergedError

SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "n", "response_length")


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
    def from_config(cls, config: Any, response_length: int, overrides: dict | None = None) -> SamplingParams:
        values = {"n": config.n, "do_sample": config.do_sample, "temperature": config.temperature,
                  "top_p": config.top_p, "top_k": config.top_k, "response_length": response_length}
        values.update({k: v for k, v in (overrides or {}).items() if k in SAMPLING_KEYS and v is not None})
        params = cls(**values)
        if params.temperature <= 0:  # temperature 0 means greedy, as in vLLM
            params.do_sample, params.temperature = False, 1.0
        return params


def response_mask_from(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every response token up to and including the first EOS, 0 after it. ``(bs, L)`` int64."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


class FiniteScores(LogitsProcessor):
    """Raise ``DivergedError`` when the model's next-token scores hold inf or NaN, instead of sampling
    garbage (greedy) or failing inside ``torch.multinomial`` with a message that names neither the cause nor
    the fix. Costs one ``isfinite`` over ``(bs, vocab)`` per generated token."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not torch.isfinite(scores).all():
            raise DivergedError("the model's next-token scores are not finite (inf or NaN)")
        return scores


def assemble_rollout(expanded: DataProto, responses: torch.Tensor, rollout_log_probs: torch.Tensor,
                     eos_token_ids: list[int], pad_token_id: int) -> DataProto:
    """The rollout contract every engine returns, from its raw samples.

    ``expanded``: the prompts repeated ``n`` times (interleaved), ``(bs*n, P)`` left-padded;
    ``responses`` ``(bs*n, L)`` sampled tokens (anything after the first EOS is replaced by pad);
    ``rollout_log_probs`` ``(bs*n, L)`` the engine's log-prob of each sampled token (zero when greedy).
    See ``attach_responses`` for the columns added."""
    response_mask = response_mask_from(responses, eos_token_ids)
    responses = torch.where(response_mask.bool(), responses, pad_token_id)
    return attach_responses(expanded, responses, response_mask, rollout_log_probs)


def attach_responses(rows: DataProto, responses: torch.Tensor, response_mask: torch.Tensor,
                     rollout_log_probs: torch.Tensor, attended: torch.Tensor | None = None) -> DataProto:
    """Add ``prompts``, ``responses``, ``response_mask``, ``rollout_log_probs`` (masked) and the whole
    sequence's ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P + L)`` to left-padded prompt
    ``rows``. ``attended`` ``(bs, L)`` marks the response tokens the model sees (default: ``response_mask``);
    a multi-turn rollout's tool output is seen but not trained on."""
    attended = response_mask if attended is None else attended
    prompt_ids, prompt_positions = rows.batch["input_ids"], rows.batch["position_ids"]
    response_positions = prompt_positions[:, -1:] + torch.arange(1, responses.shape[1] + 1)
    rows.batch["prompts"] = prompt_ids
    rows.batch["responses"] = responses
    rows.batch["response_mask"] = response_mask
    rows.batch["rollout_log_probs"] = rollout_log_probs * response_mask
    rows.batch["input_ids"] = torch.cat([prompt_ids, responses], dim=1)
    rows.batch["attention_mask"] = torch.cat([rows.batch["attention_mask"], attended], dim=1)
    rows.batch["position_ids"] = torch.cat([prompt_positions, response_positions], dim=1)
    return rows


class HFRollout:
    """``generate_sequences`` over left-padded prompts with ``model.generate``."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: Any,
                 response_length: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.response_length = response_length
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_token_id = tokenizer.pad_token_id
        # transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version takes
        forward_params = inspect.signature(type(model).forward).parameters
        self._cache_key = "cache" if "cache" in forward_params else "past_key_values"

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt.

        In: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded. Out: ``bs * n``
        rows (every input column repeated, interleaved) plus ``prompts (bs*n, P)``, ``responses``,
        ``response_mask``, ``rollout_log_probs`` ``(bs*n, L)`` (zero when greedy), and ``input_ids``,
        ``attention_mask``, ``position_ids`` ``(bs*n, P + L)`` for the whole sequence."""
        params = SamplingParams.from_config(self.config, self.response_length, prompts.meta_info)
        micro = self.config.micro_batch_size or len(prompts)  # null: all prompts in one call
        parts = [self._generate(part, params) for part in prompts.split(micro)]
        return DataProto.concat(parts) if len(parts) > 1 else parts[0]

    def _shared_prefix_cache(self, prompts: DataProto, n: int, device: torch.device) -> dict[str, Any]:
        """Run each prompt through the model once and copy its KV cache for the ``n`` samples.

        ``generate(num_return_sequences=n)`` would process every prompt ``n`` times; on a CPU the
        prompt pass is the larger part of a short rollout. The last prompt token is left out so that
        ``generate`` computes the first sampling step itself."""
        out = self.model(input_ids=prompts.batch["input_ids"][:, :-1].to(device),
                         attention_mask=prompts.batch["attention_mask"][:, :-1].to(device),
                         position_ids=prompts.batch["position_ids"][:, :-1].to(device), use_cache=True,
                         logits_to_keep=1)
        cache = out[self._cache_key]
        cache.batch_repeat_interleave(n)
        return {self._cache_key: cache}

    def _generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        device = next(self.model.parameters()).device
        expanded = prompts.repeat(params.n, interleave=True)  # every output row, before its response is known
        input_ids = expanded.batch["input_ids"].to(device)
        sampling = {"temperature": params.temperature, "top_p": params.top_p,
                    "top_k": params.top_k if params.top_k > 0 else None} if params.do_sample else {}
        was_training = self.model.training
        self.model.eval()
        cache = self._shared_prefix_cache(prompts, params.n, device) if params.n > 1 else {}
        out = self.model.generate(
            input_ids=input_ids, attention_mask=expanded.batch["attention_mask"].to(device), **cache, do_sample=params.do_sample,
            max_new_tokens=params.response_length, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
            output_logits=params.do_sample, return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([FiniteScores()]), **sampling)
        self.model.train(was_training)
        generated = out.sequences[:, input_ids.shape[1]:]
        responses = torch.full((generated.shape[0], params.response_length), self.pad_token_id,
                               dtype=generated.dtype, device=device)
        responses[:, :generated.shape[1]] = generated
        rollout_log_probs = torch.zeros(responses.shape, dtype=torch.float32, device=device)
        if params.do_sample and out.logits:
            logits = torch.stack(out.logits, dim=1).float() / params.temperature
            rollout_log_probs[:, :generated.shape[1]] = logprobs_from_logits(logits, generated)
        return assemble_rollout(expanded, responses.cpu(), rollout_log_probs.cpu(), self.eos_token_ids,
                                self.pad_token_id)
