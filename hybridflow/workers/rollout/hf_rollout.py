"""Rollout over the Hugging Face model with its own decoding loop: the portable engine that runs anywhere torch
does.

In the hybrid engine the rollout holds the *same module* the actor trains, so it always samples from the
current weights and no second copy of the model exists.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow import rollout as contract
from hybridflow.config import RolloutConfig
from hybridflow.models.layers import layer_layout
from hybridflow.models.routing import ROUTED_EXPERTS
from hybridflow.models.vision import (
    ImageInput,
    model_image_inputs,
    placeholder_token_ids,
    vision_positions,
    without_placeholders,
)
from hybridflow.protocol import DataProto
from hybridflow.rollout import Capabilities, EngineSpec, Rollout, register_rollout
from hybridflow.utils.deprecation import moved_names
from hybridflow.workers.engine import DivergedError
from hybridflow.workers.rollout.routing_log import RoutingLog
from hybridflow.workers.row_layouts import row_images

# the engine-neutral pieces that lived here until the rollout contract got a room of its own
__getattr__ = moved_names(
    __name__,
    contract,
    [
        "SAMPLING_KEYS",
        "SamplingParams",
        "WeightFeed",
        "assemble_rollout",
        "attach_responses",
        "response_mask_from",
    ],
)


def check_finite(logits: torch.Tensor) -> None:
    """Raise ``DivergedError`` when the model's next-token scores hold inf or NaN, instead of sampling garbage
    (greedy) or failing inside ``torch.multinomial`` with a message that names neither the cause nor the fix."""
    if not torch.isfinite(logits).all():
        raise DivergedError("the model's next-token scores are not finite (inf or NaN)")


Generators = torch.Generator | list[torch.Generator] | None


def sample_tokens(
    logits: torch.Tensor, params: contract.SamplingParams, generator: Generators = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row from ``logits`` ``(rows, V)``: argmax when greedy, else a draw at
    ``temperature`` from the ``top_k`` most likely tokens and the smallest set of them holding ``top_p`` of the
    probability. Returns ``tokens`` ``(rows,)`` and their log-probs ``(rows,)`` at ``temperature`` before the
    top-k/top-p cut (what the trainer's forward computes; zero when greedy). ``generator``: where the draws
    come from: one for all rows, one per row (a list), or torch's global one (None)."""
    logits = logits.float()
    if not params.do_sample:
        return logits.argmax(dim=-1), torch.zeros(len(logits), device=logits.device)
    scaled = logits / params.temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    kept = scaled
    if params.top_k > 0:
        kth = torch.topk(kept, min(params.top_k, kept.shape[-1]), dim=-1).values[:, -1:]
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        covered_before = probs.cumsum(dim=-1) - probs  # a token goes once the ones above it hold top_p
        kept = kept.scatter(-1, order, ordered.masked_fill(covered_before >= params.top_p, float("-inf")))
    tokens = draw(torch.softmax(kept, dim=-1), generator)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One token per row of ``probs`` ``(rows, V)``, drawn as ``torch.multinomial`` would but by inverse CDF (a
    cumulative sum and a binary search), about 10x faster on a CPU over a 49k vocabulary. Where rounding lands
    on a token without mass (past the last one), that row is drawn again by ``multinomial``. ``generator``: one
    for all rows, one per row (a list: each row's draw depends on its own generator only), or None (torch's
    global one)."""
    cdf = probs.cumsum(dim=-1)
    if isinstance(generator, list):
        uniform = torch.cat([torch.rand(1, dtype=cdf.dtype, generator=g) for g in generator])[:, None]
        point = uniform.to(probs.device) * cdf[:, -1:]
    else:
        point = (
            torch.rand(len(probs), 1, device=probs.device, dtype=cdf.dtype, generator=generator) * cdf[:, -1:]
        )
    tokens = torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    missed = probs.gather(-1, tokens[:, None]).squeeze(-1) == 0
    if isinstance(generator, list):
        for row in missed.nonzero().flatten().tolist():
            tokens[row] = torch.multinomial(probs[row], 1, generator=generator[row]).squeeze(-1)
    elif missed.any():
        tokens[missed] = torch.multinomial(probs[missed], 1, generator=generator).squeeze(-1)
    return tokens


def fork(cache: Any, rows: torch.Tensor) -> None:
    """Make row ``i`` of ``cache`` a copy of its row ``rows[i]`` (fork a prompt's cache for its samples, or
    drop the rows that ended), for every layer kind: attention keys and values, and the convolution and
    recurrent states of linear-attention layers (which have no ``batch_repeat_interleave``)."""
    cache.reorder_cache(rows)


def common_prefix_length(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> int:
    """Length of the longest run of real tokens (and positions) that every left-padded prompt row of ``ids``
    ``(bs, P)`` starts with, short of each row's last token (the one whose output is sampled from)."""
    lengths = mask.sum(dim=1)
    shortest = int(lengths.min())
    starts = (ids.shape[1] - lengths).tolist()
    heads = torch.stack(
        [
            torch.stack([ids[r, s : s + shortest], positions[r, s : s + shortest]])
            for r, s in enumerate(starts)
        ]
    )
    differs = (heads != heads[:1]).any(dim=0).any(dim=0).nonzero()
    same = int(differs[0]) if len(differs) else shortest
    return max(0, min(same, shortest - 1))


@register_rollout("hf")
class HFRollout(Rollout):
    """``generate_sequences`` over left-padded prompts with the model's own forward and KV cache.

    A decoding loop of its own rather than ``generate(num_return_sequences=n)``, because at RL's shapes (a
    batch of chat prompts sharing a system prompt or few-shot example, ``n`` samples each, short answers) most
    of ``generate``'s work is repeated or wasted: the prefix every prompt shares is run once, each prompt's
    remainder once for its ``n`` samples (their caches are copies), rows that ended leave the batch instead of
    decoding padding until the longest one ends, and no per-step logits processors run. Sampling is
    temperature, top-k and top-p, as vLLM's; the result is the rollout contract's batch (``assemble_rollout``).

    ``seed`` (None: torch's global generator): each sample draws from a generator of its own, seeded by
    ``(seed, step, its prompt's tokens, its number among the prompt's n)`` (``reseed(step)`` sets the training
    step). A sample then depends on the seed, the step, its prompt and the weights only: not on what else in
    the process draws random numbers, or when (a trainer in another thread), not on which other prompts share
    its batch or its worker (another worker count, a resumed run).

    It samples from the module it is given (in the hybrid engine, the one the actor trains), so it has no
    weights of its own to be sent. It follows weights: a ``WeightFeed`` (``follow_weights``, set by an
    asynchronous run's rollout worker) is asked between decoding steps for newer weights; when they came, the
    unfinished rows' KV cache is recomputed under them (never reused stale), and ``rollout_weight_versions``
    ``(bs*n, L)`` records per token the version that sampled it."""

    capabilities = Capabilities(own_weights=False, follows_weights=True, records_routing=True)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
        response_length: int,
        seed: int | None = None,
        record_routing: bool = False,
    ) -> None:
        self.model = model
        self.seed, self.step = seed, 0
        self.weights: contract.WeightFeed | None = None
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
        self.layout = layer_layout(model.config)
        # record each token's chosen experts (the run replays them in the trainer: router_replay R3)
        self.records_routing = record_routing and self.layout.is_moe
        self.log: RoutingLog | None = None  # the generation in progress's, when recording
        self.width = 0  # the generation in progress's prompt + response columns

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> HFRollout:
        """Over the worker's module itself; each sample seeded from ``rollout.seed`` (the same on every
        worker, so a sample does not depend on which worker drew it)."""
        return cls(
            spec.module,
            spec.tokenizer,
            spec.config,
            spec.response_length,
            spec.config.seed,
            spec.record_routing,
        )

    def follow_weights(self, feed: contract.WeightFeed | None) -> None:
        """Ask ``feed`` for newer weights after every decoding step (None: stop)."""
        self.weights = feed

    def reseed(self, step: int) -> None:
        """The next generations draw the samples of training step ``step`` (see the class docstring): a
        resumed run, or a rollout that runs ahead of the trainer, draws what an uninterrupted lock-step run
        does."""
        self.step = step

    def _row_generators(self, prompts: DataProto, n: int) -> list[torch.Generator] | None:
        """One generator per sample (prompt-major, as the rows are expanded), or None without a seed."""
        if self.seed is None:
            return None
        device = next(self.model.parameters()).device
        generators: list[torch.Generator] = []
        seen: dict[int, int] = {}  # prompt key -> how many times it came before in this batch
        images = row_images(prompts) or [()] * len(prompts)
        for ids, mask, pictures in zip(
            prompts.tensors["input_ids"], prompts.tensors["attention_mask"], images
        ):
            key = zlib.crc32(
                ids[mask.bool()].cpu().numpy().tobytes() + "".join(im.key for im in pictures).encode()
            )
            seen[key] = seen.get(key, -1) + 1  # the same prompt twice in a batch: other samples
            for j in range(n):
                entropy = [self.seed, self.step, key, seen[key], j]
                seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
                generators.append(torch.Generator(device).manual_seed(seed))
        return generators

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt.

        In: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded. Out: ``bs * n``
        rows (every input column repeated, interleaved) plus ``prompts (bs*n, P)``, ``responses``,
        ``response_mask``, ``rollout_log_probs`` ``(bs*n, L)`` (zero when greedy), and ``input_ids``,
        ``attention_mask``, ``position_ids`` ``(bs*n, P + L)`` for the whole sequence."""
        params = contract.SamplingParams.from_config(self.config, self.response_length, prompts.meta_info)
        micro = self.config.micro_batch_size or len(prompts)  # null: all prompts in one call
        was_training = self.model.training
        self.model.eval()
        try:
            parts = [self._generate(part, params) for part in prompts.split(micro)]
        finally:
            self.model.train(was_training)
        return DataProto.concat(parts) if len(parts) > 1 else parts[0]

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any = None,
        images: Sequence[ImageInput] = (),
        places: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """The next-token logits after the last column ``(rows, V)``, and the cache extended by ``ids``;
        ``images``: those whose tokens are in ``ids`` (row order), for the vision tower; ``places``: where
        the tokens' expert routing goes in the result (``RoutingLog.record``), when it is recorded."""
        if self.log is not None:
            self.log.start()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **model_image_inputs(images, ids.device),
            **({self._cache_key: cache} if cache is not None else {}),
        )
        if self.log is not None and places is not None:
            self.log.record(places)
        return out.logits[:, -1], out[self._cache_key]

    def _shares_prefix(self, mask: torch.Tensor) -> bool:
        """Whether the prompts' common prefix may be run once for all of them. After it, each prompt's
        remainder is left-padded to the longest, so padding sits between the prefix and the remainder:
        exact for full attention under the mask, but a sliding window counts columns, not tokens, and a
        recurrent layer (linear attention) would carry its state through the gap; for those, only prompts
        of one length (no gap) share it."""
        if len(mask) < 2:
            return False
        if self.layout.recurrent or "sliding_attention" in self.layout.types:
            return bool((mask.sum(dim=1) == mask.shape[1]).all())
        return True

    def _positions(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, images: list | None
    ) -> torch.Tensor:
        """The positions a forward over left-padded rows takes: ``positions`` ``(bs, T)``, or with images
        Qwen's 3-D ones ``(3, bs, T)`` (``vision_positions``, as the trainer computes them)."""
        if images is None:
            return positions
        rope = vision_positions(self.model, ids, mask, [im for row in images for im in row])
        return positions if rope is None else rope

    def _prefill(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        n: int,
        images: list | None = None,
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Run the prompts ``(bs, P)`` through the model once: the prefix they all share at batch size one,
        then each prompt's remainder, left-padded to the longest, after it. Returns the logits that sample
        the first response token ``(bs, V)``, the cache, and its attention mask ``(bs, C)``. ``images``: each
        prompt's; the shared prefix stops before the first image, so each prompt's images go through the
        vision tower once, in its remainder (its ``n`` samples then share the cache)."""
        shared = common_prefix_length(ids, mask, positions) if self._shares_prefix(mask) else 0
        start = ids.shape[1] - int(mask[0].sum())
        if images is not None and shared:
            pictures = (ids[0, start : start + shared] == self.model.config.image_token_id).nonzero()
            shared = int(pictures[0]) if len(pictures) else shared
        flat = [im for row in images or [] for im in row]
        positions = self._positions(ids, mask, positions, images)
        width = ids.shape[1]
        samples = torch.arange(len(ids))[:, None] * n + torch.arange(n)  # each prompt's rows in the result
        if shared == 0:
            places = self._places(samples, torch.arange(width).expand(len(ids), -1), mask)
            logits, cache = self._forward(ids, mask, positions, images=flat, places=places)
            return logits, cache, mask
        prefix = self._prefix_places(mask, n, shared)
        _, cache = self._forward(
            ids[:1, start : start + shared],
            mask[:1, start : start + shared],
            positions[..., :1, start : start + shared],
            places=prefix,
        )
        fork(cache, torch.zeros(len(ids), dtype=torch.long, device=ids.device))
        lengths = mask.sum(dim=1)
        rest = int(lengths.max()) - shared  # the remainders, left-padded to a common width
        remainder = (
            torch.arange(width - rest, width, device=mask.device) >= (width - lengths + shared)[:, None]
        )
        mask = torch.cat(
            [torch.ones(len(ids), shared, dtype=mask.dtype, device=mask.device), remainder.to(mask.dtype)],
            dim=1,
        )
        places = self._places(samples, torch.arange(width - rest, width).expand(len(ids), -1), remainder)
        logits, cache = self._forward(ids[:, -rest:], mask, positions[..., -rest:], cache, flat, places)
        return logits, cache, mask

    def _prefix_places(self, mask: torch.Tensor, n: int, shared: int) -> torch.Tensor | None:
        """Where the shared prefix's tokens (one input row) go in the result when routing is recorded: the
        first ``shared`` prompt columns of every sample, each row's own (its prompt's left padding before)."""
        if self.log is None:
            return None
        starts = (mask.shape[1] - mask.sum(dim=1)).cpu().repeat_interleave(n)  # each sample's first column
        first = torch.arange(len(starts)) * self.width + starts
        return first[None, None, :] + torch.arange(shared)[None, :, None]

    def _places(self, rows: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """Where a forward's tokens' routing goes in the result (``RoutingLog.rows_places``), when recorded."""
        return None if self.log is None else self.log.rows_places(rows, columns, valid.cpu())

    def _generate(self, prompts: DataProto, params: contract.SamplingParams) -> DataProto:
        device = next(self.model.parameters()).device
        ids, mask, positions = (
            prompts.tensors[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")
        )
        prompt_mask, images = mask, row_images(prompts)
        n, length = params.n, params.response_length
        self.width = ids.shape[1] + length
        top_k = self.layout.top_k
        self.log = RoutingLog(self.model, len(ids) * n, self.width, top_k) if self.records_routing else None
        logits, cache, mask = self._prefill(ids, mask, positions, n, images)
        if n > 1:
            fork(cache, torch.arange(len(ids), device=device).repeat_interleave(n))
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        rows = len(logits)
        generators = self._row_generators(prompts, n)
        responses = torch.full((rows, length), self.pad_token_id, dtype=ids.dtype, device=device)
        log_probs = torch.zeros(rows, length, device=device)
        versions = torch.full((rows, length), -1, dtype=torch.long, device=device)
        live = torch.arange(rows, device=device)  # the rows still decoding, in cache order
        # after the prompt, one position per token (the same in Qwen's 3 dimensions: from its largest + 1)
        last = self._positions(ids, prompt_mask, positions, images)
        next_position = (last.amax(dim=0) if last.dim() == 3 else last)[:, -1].repeat_interleave(n) + 1
        three_d = last.dim() == 3
        eos = torch.tensor(self.eos_token_ids, device=device)
        placeholders = placeholder_token_ids(self.model.config)  # never sampled (the trainer scores so too)
        for step in range(length):
            check_finite(logits)
            logits = without_placeholders(logits, placeholders)
            live_generators = [generators[row] for row in live.tolist()] if generators else None
            tokens, token_log_probs = sample_tokens(logits, params, live_generators)
            responses[live, step], log_probs[live, step] = tokens, token_log_probs
            if self.weights is not None:
                versions[live, step] = self.weights.version
            going = ~torch.isin(tokens, eos)
            if step == length - 1 or not going.any():
                break
            if not going.all():  # ended rows leave the batch and its cache
                keep = going.nonzero().flatten()
                fork(cache, keep)
                live, tokens, mask, next_position = live[keep], tokens[keep], mask[keep], next_position[keep]
            if self.weights is not None and self.weights.refresh():
                logits, cache, mask = self._recompute(
                    ids, prompt_mask, positions, responses, live, n, step, images
                )
            else:
                column = ids.shape[1] + step  # where this step's token sits in the result
                logits, cache, mask = self._step(tokens, mask, next_position, cache, live, column, three_d)
            next_position = next_position + 1
        return self._result(prompts, n, responses, log_probs, versions)

    def _step(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        next_position: torch.Tensor,
        cache: Any,
        live: torch.Tensor,
        column: int,
        three_d: bool,
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One decoding step: the ``live`` rows' last ``tokens`` (at ``next_position``, result column
        ``column``) through the model. Returns the logits of their next tokens, the cache and its mask."""
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype, device=mask.device)], dim=1)
        positions = next_position[:, None].expand(3, -1, 1) if three_d else next_position[:, None]
        places = self._places(
            live.cpu()[:, None], torch.full((len(live), 1), column), torch.ones(len(live), 1)
        )
        logits, cache = self._forward(tokens[:, None], mask, positions, cache, places=places)
        return logits, cache, mask

    def _result(
        self,
        prompts: DataProto,
        n: int,
        responses: torch.Tensor,
        log_probs: torch.Tensor,
        versions: torch.Tensor,
    ) -> DataProto:
        """The rollout contract's batch of the sampled ``responses`` (with the recorded routing, if any)."""
        expanded = prompts.repeat(n, interleave=True)
        out = contract.assemble_rollout(
            expanded, responses.cpu(), log_probs.cpu(), self.eos_token_ids, self.pad_token_id
        )
        if self.log is not None:
            out.tensors[ROUTED_EXPERTS] = self.log.result(out.tensors["attention_mask"])
            self.log = None
        return out if self.weights is None else contract.tag_weight_versions(out, versions)

    def _recompute(
        self,
        ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        responses: torch.Tensor,
        live: torch.Tensor,
        n: int,
        step: int,
        images: list | None = None,
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """After a weight update in flight: run the ``live`` rows' prompts and their responses so far (tokens
        ``0..step``) through the new weights in one pass. Returns the logits that sample token ``step + 1``,
        a fresh cache and its attention mask; the cache computed under the old weights is dropped."""
        prompt_rows = live // n  # the expanded rows are the prompts repeated n times, interleaved
        prompt_ids, prompt_positions = ids[prompt_rows], positions[prompt_rows]
        prompt_mask = prompt_mask[prompt_rows]
        done = responses[live, : step + 1]
        offsets = torch.arange(1, step + 2, device=ids.device)
        full_ids = torch.cat([prompt_ids, done], dim=1)
        full_positions = torch.cat([prompt_positions, prompt_positions[:, -1:] + offsets], dim=1)
        full_mask = torch.cat(
            [prompt_mask, torch.ones(done.shape, dtype=prompt_mask.dtype, device=ids.device)], dim=1
        )
        rows_images = None if images is None else [images[r] for r in prompt_rows.tolist()]
        flat = [im for row in rows_images or [] for im in row]
        full_positions = self._positions(full_ids, full_mask, full_positions, rows_images)
        columns = torch.arange(full_ids.shape[1]).expand(len(live), -1)
        places = self._places(live.cpu()[:, None], columns, full_mask)
        logits, cache = self._forward(full_ids, full_mask, full_positions, images=flat, places=places)
        return logits, cache, full_mask
