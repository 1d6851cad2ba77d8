"""Rollout with vLLM, in the actor worker's own process (the hybrid engine).

Why in the same process: the engine then reads the new weights straight from the trainer's tensors after
each update (``load_weights`` through ``collective_rpc``), no files and no second process. vLLM keeps its
own copy of the weights (its layers are fused: ``qkv_proj``, ``gate_up_proj``), so unlike the Hugging Face
rollout it must be told after every change (``update_weights``).

The same code runs on vLLM's CPU build (``vllm-cpu``) and on the CUDA ``vllm`` package. On a GPU with
``free_cache_engine`` the engine sleeps between generations (level 1: KV cache dropped, weights moved to
host memory), so the actor has the GPU to itself while it trains; on CPU there is nothing to free.

A partial rollout (an asynchronous run's rollout worker, ``weights`` set) decodes in chunks of
``rollout.partial_rollout_chunk`` tokens per sample and looks for newer weights between chunks: when some
came, the engine takes them and drops its prefix cache, so each unfinished sample's prompt and tokens so far
are recomputed under the new weights (never reused stale), and every token records the version that
sampled it. Between chunks without new weights the prefix cache serves the continuation.

``vllm`` is imported only when this engine is built (``rollout.name=vllm``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.config import RolloutConfig
from hybridflow.models.routing import ROUTED_EXPERTS
from hybridflow.models.vision import vision_family
from hybridflow.protocol import DataProto
from hybridflow.rollout import (
    Capabilities,
    EngineSpec,
    Rollout,
    SamplingParams,
    WeightFeed,
    assemble_rollout,
    register_rollout,
    tag_weight_versions,
)
from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import resolve_dtype
from hybridflow.workers.sharding import is_lora

# GiB of KV cache on CPU when the user sets none: a tiny or 135M-parameter model needs far less.
DEFAULT_CPU_KVCACHE_GIB = "1"

#: model types whose rollout on vLLM's CPU build (0.32) equals the trainer's: sampled log-probs within 1e-3 and
#: the weights of every update reaching the engine (tests/vllm_engine/test_vllm_families.py, a tiny model each)
CPU_CHECKED = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma4_text",
)
#: what the CPU build does with the other families hybridflow trains (measured the same way)
CPU_REFUSED = {
    "olmo2": "its engine fails to build (a custom op made outside vLLM's config)",
    "qwen3_moe": "its MoE kernel does not compute with the experts an update sends (log-probs 0.02 off after one)",
    "glm4_moe": "its log-probs differ from transformers' by up to 7 nats",
    "gpt_oss": "its log-probs differ from transformers' by up to 0.4 nats",
    "deepseek_v3": "it cannot load the router's e_score_correction_bias",
    "qwen3_5_text": "vLLM 0.32 rejects the model's config",
    "qwen3_5_moe_text": "vLLM 0.32 rejects the model's config",
    "qwen3_next": "its Gated DeltaNet kernels need bf16 on a CPU",
}


def _import_vllm() -> Any:
    # The engine core must run in this process (else it starts a spawned process that cannot see the
    # model we update); the CPU build sizes its KV cache from this variable instead of GPU memory.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "actor_rollout_ref.rollout.name=vllm needs vLLM: `pip install vllm` on a CUDA machine, or build the "
            "CPU environment with `scripts/vllm_cpu_env.sh` (README: vLLM rollout); or use rollout.name=hf"
        ) from err
    return vllm


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker: copy ``weights`` (Hugging Face names) into its model.

    ``reload_weights`` (recent vLLM) re-runs the post-load processing that some platforms apply (the CPU
    build repacks linear weights for its kernels, after which ``load_weights`` alone no longer works);
    older versions only have the model's ``load_weights``."""
    model = worker.model_runner.model
    if getattr(model, "lm_head", None) is None:
        # a model that computes its logits with the embedding itself (Gemma): no output layer to load into
        weights = [(name, tensor) for name, tensor in weights if not name.startswith("lm_head.")]
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=iter(weights))
    else:
        model.load_weights(weights)
    return len(weights)


def _as_checkpoint(
    model: PreTrainedModel | None, weights: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` under the names and layouts of ``model``'s checkpoint (as ``save_pretrained`` writes them),
    one tensor at a time; as they are when transformers converts nothing for it."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions
        yield from weights
        return
    for name, tensor in weights:
        if model is None:
            yield name, tensor
        else:
            yield from revert_weight_conversion(model, {name: tensor}).items()


def _check_cpu_build(model_path: str, record_routing: bool) -> None:
    """A ``UserError`` for what vLLM's CPU build cannot do exactly: record routing (R3), or run a model type
    whose rollout is not known to be the trainer's."""
    if record_routing:
        raise UserError(
            "actor_rollout_ref.actor.router_replay.mode=R3 with rollout.name=vllm needs vLLM's routed-expert "
            "capture, which its CPU build cannot run (Model Runner V2, which needs Triton); use rollout.name=hf "
            "on a CPU, or mode=R2"
        )
    model_type = AutoConfig.from_pretrained(model_path).get_text_config().model_type
    if model_type in CPU_CHECKED:
        return
    why = CPU_REFUSED.get(model_type, "it is not among the families checked against transformers there")
    raise UserError(
        f"actor_rollout_ref.rollout.name=vllm: vLLM's CPU build does not run {model_type} exactly ({why}); "
        "use rollout.name=hf on a CPU"
    )


@register_rollout("vllm")
class VLLMRollout(Rollout):
    """``generate_sequences`` with a ``vllm.LLM`` built from ``model_path``; same contract as ``HFRollout``.

    ``config``: the rollout section (sampling defaults, engine keys); ``max_model_len``: the longest
    prompt + response; ``device``: where the actor trains (``cuda`` enables sleep mode); ``record_routing``:
    return each token's chosen experts (R3 routing replay; GPU builds only); ``model``: the trainer's, whose
    checkpoint layout the engine loads. It holds its own copy of the weights (sent by the worker after every
    change) and follows weights in chunks."""

    capabilities = Capabilities(own_weights=True, follows_weights=True, records_routing=True)

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
        response_length: int,
        max_model_len: int | None,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        record_routing: bool = False,
        model: PreTrainedModel | None = None,
    ) -> None:
        if vision_family(AutoConfig.from_pretrained(model_path)) is not None:
            raise UserError(
                f"rollout.name=vllm does not take vision-language models here ({model_path}): image prompts go "
                "through rollout.name=hf (vLLM's CPU build cannot import its vision models without torchvision, "
                "and passing multi_modal_data is not written yet)"
            )
        if device.type != "cuda":
            _check_cpu_build(model_path, record_routing)
        self.record_routing = record_routing
        if record_routing:  # vLLM captures routed experts in its second model runner only
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        self.model = model  # the trainer's model, whose checkpoint layout the engine loads (update_weights)
        vllm = _import_vllm()
        self.config, self.response_length, self.dtype = config, response_length, dtype
        self.weights: WeightFeed | None = None  # set for a partial rollout: looked at between chunks
        self.pad_token_id = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.on_gpu = device.type == "cuda"
        self.sleep_mode = self.on_gpu and config.free_cache_engine
        self._sampling_cls = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt
        gpu_only = (
            {"gpu_memory_utilization": config.gpu_memory_utilization, "enable_sleep_mode": self.sleep_mode}
            if self.on_gpu
            else {}
        )
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            enforce_eager=config.enforce_eager,
            seed=seed,
            tensor_parallel_size=config.tensor_model_parallel_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len or 0),
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=True,
            # the log-prob of each sampled token under the distribution it was sampled from (temperature
            # applied), which is what the trainer recomputes: rollout/logprob_diff compares like with like
            logprobs_mode="processed_logprobs",
            **({"enable_return_routed_experts": True} if record_routing else {}),
            **gpu_only,
        )
        self._asleep: set[str] = set()  # what sleep mode has moved out of GPU memory: weights, kv_cache
        self._sleep()

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> VLLMRollout:
        """A copy loaded from ``spec.model_path`` in ``rollout.dtype`` (auto: the actor's), on the actor's
        device, seeded with this worker's engine seed."""
        if spec.model_path is None:
            raise ValueError("rollout.name=vllm needs model_path: vLLM loads the model from its folder")
        device, rollout = next(spec.module.parameters()).device, spec.config
        dtype = resolve_dtype(rollout.dtype, device)
        return cls(
            spec.model_path,
            spec.tokenizer,
            rollout,
            spec.response_length,
            rollout.max_model_len,
            dtype,
            device,
            spec.seed,
            spec.record_routing,
            cast(PreTrainedModel, spec.module.base_model.model) if is_lora(spec.module) else spec.module,
        )

    def follow_weights(self, feed: WeightFeed | None) -> None:
        """Decode in chunks and take ``feed``'s newer weights between them (None: whole samples again)."""
        self.weights = feed

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's current weights (Hugging Face names) into the engine, in memory; returns how
        many of them it took. On GPU with sleep mode only the weights wake up, not the KV cache.

        vLLM's loaders read checkpoint names and layouts, which transformers changes for some models as it
        loads them (an MoE layer's experts fused into one 3-D tensor, where the checkpoint has one matrix per
        expert): each tensor is turned back into the checkpoint's (``revert_weight_conversion``) first, or
        vLLM would skip the experts silently and sample from stale ones."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        named = list(weights)
        converted = [(name, t.to(self.dtype)) for name, t in _as_checkpoint(self.model, named)]
        if self.config.tensor_model_parallel_size > 1:  # crosses into vLLM's worker processes: host memory
            converted = [(name, t.cpu()) for name, t in converted]
        self.llm.collective_rpc(_load_weights, args=(converted,))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return len(named)

    @contextlib.contextmanager
    def awake(self) -> Iterator[Any]:
        """The engine (``vllm.LLM``) with its weights and KV cache in GPU memory for the block, asleep again
        after it in sleep mode; on CPU it never sleeps."""
        if self._asleep:  # the KV cache, and the weights unless an update woke them already
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()
        try:
            yield self.llm
        finally:
            self._sleep()

    def _sleep(self) -> None:
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, params: SamplingParams, n: int, max_tokens: int) -> Any:
        sampling = (
            {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "logprobs": 0}
            if params.do_sample
            else {"temperature": 0.0}
        )
        return self._sampling_cls(
            n=n, max_tokens=max_tokens, stop_token_ids=self.eos_token_ids, detokenize=False, **sampling
        )

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt (vLLM's ``n``: each prompt's prefix is computed once).

        In: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P)``, left-padded. Out: ``bs * n`` rows,
        laid out exactly as ``HFRollout.generate_sequences`` returns them (``rollout_log_probs`` zero when
        greedy)."""
        params = SamplingParams.from_config(self.config, self.response_length, prompts.meta_info)
        ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
        firsts = [row[keep].tolist() for row, keep in zip(ids, mask)]
        with self.awake() as llm:
            if self.weights is None:
                requests = [self._tokens_prompt(prompt_token_ids=first) for first in firsts]
                sampling = self._sampling_params(params, params.n, params.response_length)
                outputs = llm.generate(requests, sampling, use_tqdm=False)
                samples = [_sampled(s, params) for out in outputs for s in out.outputs]  # prompt-major
                routes = (
                    [s.routed_experts for out in outputs for s in out.outputs]
                    if self.record_routing
                    else None
                )
                versions = None
            else:
                samples, versions = self._generate_following(llm, firsts, params)
                routes = None
        responses = torch.full((len(samples), params.response_length), self.pad_token_id, dtype=ids.dtype)
        log_probs = torch.zeros((len(samples), params.response_length), dtype=torch.float32)
        for i, (tokens, logps) in enumerate(samples):
            responses[i, : len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
            log_probs[i, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
        expanded = prompts.repeat(params.n, interleave=True)
        out = assemble_rollout(expanded, responses, log_probs, self.eos_token_ids, self.pad_token_id)
        if versions is not None:
            per_token = torch.tensor([v + [-1] * (params.response_length - len(v)) for v in versions])
            tag_weight_versions(out, per_token)
        if routes is not None:
            out.tensors[ROUTED_EXPERTS] = _routes_in_columns(routes, out.tensors["attention_mask"])
        return out

    def _generate_following(
        self, llm: Any, firsts: list[list[int]], params: SamplingParams
    ) -> tuple[list[tuple[list[int], list[float]]], list[list[int]]]:
        """A partial rollout: every sample (``n`` per prompt, prompt-major) decodes ``partial_rollout_chunk``
        tokens at a time; between chunks the newest posted weights are taken, and the unfinished samples go
        on from their prompt plus their tokens so far. Returns each sample's tokens and log-probs, and the
        weight version of each token."""
        chunk, feed = self.config.partial_rollout_chunk, self.weights
        if feed is None:  # _generate follows weights only when it was given a feed
            raise RuntimeError("a partial rollout needs the weight feed (follow_weights)")
        prompts = [first for first in firsts for _ in range(params.n)]
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        while live:
            requests = [self._tokens_prompt(prompt_token_ids=prompts[i] + tokens[i]) for i in live]
            sampling = [
                self._sampling_params(params, 1, min(chunk, params.response_length - len(tokens[i])))
                for i in live
            ]
            outputs = llm.generate(requests, sampling, use_tqdm=False)
            version, going = feed.version, []
            for i, out in zip(live, outputs):
                new, new_logps = _sampled(out.outputs[0], params)
                tokens[i] += new
                logps[i] += new_logps
                versions[i] += [version] * len(new)
                ended = out.outputs[0].finish_reason != "length" or not new
                if not ended and len(tokens[i]) < params.response_length:
                    going.append(i)
            live = going
            if live:
                feed.refresh()  # newer weights, if posted: the engine drops its prefix cache
        return list(zip(tokens, logps)), versions


def _routes_in_columns(routes: list[Any], attention_mask: torch.Tensor) -> torch.Tensor:
    """vLLM's routed experts of each sample (``[tokens it computed, layers, k]``: its prompt's, then its
    response's but the last) laid out in the batch's columns ``(rows, width, layers, k)``, -1 elsewhere."""
    first = torch.as_tensor(routes[0])
    grid = torch.full((*attention_mask.shape, *first.shape[1:]), -1, dtype=torch.int16)
    for row, (route, real) in enumerate(zip(routes, attention_mask.bool())):
        columns = real.nonzero().flatten()[: len(route)]
        grid[row, columns] = torch.as_tensor(route)[: len(columns)].to(torch.int16)
    return grid


def _sampled(sample: Any, params: SamplingParams) -> tuple[list[int], list[float]]:
    """One vLLM completion's tokens (at most the response length) and their log-probs (empty when greedy)."""
    tokens = list(sample.token_ids)[: params.response_length]
    if not (params.do_sample and sample.logprobs):
        return tokens, []
    return tokens, [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
