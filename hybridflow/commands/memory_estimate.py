"""Peak memory of one worker, estimated from the model's shape and the config, before anything is loaded.

Why an estimate and not a trial: a run that does not fit dies minutes in (after loading, generating and
scoring), and a trial run costs as much. The arithmetic below follows what the workers hold:

- static, for the whole run: the actor's weights, gradients and AdamW's two moments (for the trainable
  parameters only under LoRA; divided over the shards under ``strategy: fsdp2``; moved to host memory by
  ``fsdp_config.param_offload`` / ``optimizer_offload``), the reference model's weights when a KL term
  needs it, the critic's weights, gradients and moments when there is one;
- plus the largest of the passes that come and go: the policy update's activations for one micro-batch
  (``ppo_micro_batch_size_per_gpu`` sequences, or ``ppo_max_token_len_per_gpu`` tokens with
  ``use_dynamic_bsz``), a log-prob pass, generation (its KV cache, and under ``fsdp2`` the whole model
  gathered on every rank unless ``rollout.sharded_generation``), and under ``fsdp2`` rank 0 reading a
  checkpoint it cannot stream tensor by tensor (the full weights, before the gradients and moments exist).

With Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` > 1) a group of ranks shares each
micro-batch, every rank holding ``1 / size`` of its tokens' activations and logits (a micro-batch holds at least
one whole sequence, however long: the case where only sequence parallelism or checkpointing help).

Activations per token and layer are taken as ``(14 * hidden + 4 * intermediate)`` values (attention and
MLP intermediates kept for backward; ``2 * hidden`` with gradient checkpointing), and the output layer's
fp32 logits three times over (logits, log-softmax and their gradient) on the response positions only, plus
``RUNTIME_BYTES`` for the Python and torch runtime. On SmolLM2-135M (fp32, micro-batches of 8 sequences of
176 + 16 tokens) this gives 5.0 GiB, where a fwd+bwd+AdamW step of 8 x 192 tokens was measured at 6.2 GB
peak RSS: an estimate to tell "fits easily" from "will not fit", not a promise to the last gigabyte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

GB = 1024**3
RUNTIME_BYTES = 0.5 * GB  # Python, torch and transformers themselves, per worker process
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class ModelShape:
    """What the estimate needs to know about a model: parameter count and layer sizes."""

    params: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    kv_dim: int  # key/value width per layer: num_key_value_heads * head_dim
    linear_in_out: int  # sum of in + out features over the linear layers LoRA adapts (not the output layer)
    streams_checkpoint: bool = False  # its safetensors hold every parameter as it is: rank 0 streams them

    def lora_params(self, rank: int) -> int:
        """Trainable parameters of rank-``rank`` adapters on every linear layer: ``rank * (in + out)`` each."""
        return rank * self.linear_in_out


def model_shape(hf_config: Any, folder: str | None = None) -> ModelShape:
    """Count a model's parameters without allocating them: the architecture built on the meta device (a
    vision-language model's with its vision tower); and whether the checkpoint in ``folder`` is one a sharded
    rank 0 sends tensor by tensor (``modeling.weights_source``) instead of loading it whole."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from hybridflow.models.vision import vision_family
    from hybridflow.workers.weight_files import SafetensorsFolder

    auto = AutoModelForImageTextToText if vision_family(hf_config) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    files = SafetensorsFolder.open(folder) if folder and os.path.isdir(folder) else None
    params = sum(p.numel() for p in model.parameters())  # tied embeddings are one tensor, counted once
    output = model.get_output_embeddings()
    linear = sum(
        m.in_features + m.out_features
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not output
    )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelShape(
        params=params,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        kv_dim=kv_heads * head_dim,
        linear_in_out=linear,
        streams_checkpoint=files is not None and files.holds(model),
    )


@dataclass
class MemoryEstimate:
    """Bytes per worker, by part; ``device`` is what must fit on the worker's device (GPU memory on CUDA,
    host memory on CPU), ``host`` what offloading moved to host memory."""

    static: dict[str, float] = field(default_factory=dict)
    passes: dict[str, float] = field(default_factory=dict)
    host: float = 0.0
    sequence_parallel: int = 1  #: ranks each policy-update sequence is split over
    #: whether one policy-update micro-batch is a single sequence (only splitting it, or checkpointing, helps)
    one_sequence: bool = False

    @property
    def largest_pass(self) -> str:
        """The name of the pass that needs the most memory."""
        return max(self.passes, key=lambda name: self.passes[name])

    @property
    def device(self) -> float:
        """Bytes on the device at the peak: the static state, the largest pass and the runtime."""
        return sum(self.static.values()) + max(self.passes.values()) + RUNTIME_BYTES

    def summary(self) -> str:
        """What makes up the peak, for doctor's line: each static part, the largest pass, the runtime."""
        parts = [f"{name} {_gb(b)}" for name, b in self.static.items() if b]
        split = f", each sequence over {self.sequence_parallel} ranks" if self.sequence_parallel > 1 else ""
        parts.append(f"+ largest pass ({self.largest_pass}{split}) {_gb(self.passes[self.largest_pass])}")
        return ", ".join(parts) + f" + runtime {_gb(RUNTIME_BYTES)}"


def _gb(value: float) -> str:
    return f"{value / GB:.2f} GB" if value < 10 * GB else f"{value / GB:.0f} GB"


def _activations(
    shape: ModelShape, tokens: int, response_tokens: int, act_bytes: int, checkpointing: bool, grad: bool
) -> float:
    """One forward (and backward when ``grad``) over ``tokens`` tokens, ``response_tokens`` of which get
    logits."""
    logits = response_tokens * shape.vocab_size * 4 * (3 if grad else 2)
    if not grad:  # no graph is kept: one layer's intermediates at a time
        return logits + tokens * (14 * shape.hidden_size + 4 * shape.intermediate_size) * act_bytes
    per_layer = (
        2 * shape.hidden_size if checkpointing else 14 * shape.hidden_size + 4 * shape.intermediate_size
    )
    return logits + tokens * shape.num_layers * per_layer * act_bytes


def estimate_memory(
    cfg: Any, shape: ModelShape, world_size: int, prompt_tokens: int | None = None
) -> MemoryEstimate:
    """Peak bytes of one worker for the resolved ``PPOConfig`` ``cfg`` and the actor's ``shape``; the critic
    is taken to have the actor's shape (a value head instead of the output layer). ``prompt_tokens``: the
    longest prompt of the data when it is known (each batch is trimmed to its longest prompt), else
    ``data.max_prompt_length``."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    actor, rollout, model = arr.actor, arr.rollout, arr.model
    on_gpu = cfg.trainer.device == "cuda"
    width = DTYPE_BYTES[model.dtype]
    shards = 1
    if actor.strategy == "fsdp2":
        shards = actor.fsdp_config.fsdp_size if actor.fsdp_config.fsdp_size > 0 else world_size
    trainable = shape.lora_params(model.lora_rank) if model.lora_rank > 0 else shape.params
    est = MemoryEstimate()
    weights = shape.params * width / shards
    optimizer = 2 * trainable * width / (1 if model.lora_rank else shards)
    grads = trainable * width / (1 if model.lora_rank else shards)
    offload_params = on_gpu and actor.strategy == "fsdp2" and actor.fsdp_config.param_offload
    offload_optim = on_gpu and actor.strategy == "fsdp2" and actor.fsdp_config.optimizer_offload
    est.static["actor weights"] = 0.0 if offload_params else weights
    est.static["actor grads"] = grads
    est.static["AdamW state"] = 0.0 if offload_optim else optimizer
    est.host += weights * offload_params + optimizer * offload_optim
    if actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        ref_offload = on_gpu and actor.strategy == "fsdp2" and arr.ref.fsdp_config.param_offload
        est.static["reference weights"] = 0.0 if ref_offload else weights
        est.host += weights * ref_offload
    if cfg.critic.enable:
        critic_width = DTYPE_BYTES[cfg.critic.model.dtype]
        est.static["critic weights+grads+AdamW"] = 4 * shape.params * critic_width / shards
    sequence = (data.max_prompt_length if prompt_tokens is None else prompt_tokens) + data.max_response_length
    _activation_passes(cfg, shape, sequence, est)
    per_worker = data.train_batch_size * rollout.n // max(world_size, 1)
    generating = (
        min(per_worker, rollout.micro_batch_size * rollout.n) if rollout.micro_batch_size else per_worker
    )
    kv_cache = 2 * shape.num_layers * shape.kv_dim * width * generating * sequence
    # a sharded actor generates from its gathered weights, unless it gathers one layer at a time
    sharded = actor.strategy == "fsdp2" and shards > 1
    gathered = weights * (shards - 1) if sharded and not rollout.sharded_generation else 0.0
    est.passes["generation"] = kv_cache + generating * shape.vocab_size * 4 + gathered
    for name in ("generation", "log-prob pass"):  # between updates: the gradients are freed after each step
        est.passes[name] -= grads
    if sharded and not shape.streams_checkpoint:
        # rank 0 loads the checkpoint whole (transformers converts it) before gradients and moments exist
        est.passes["checkpoint read by rank 0"] = max(0.0, shape.params * width - grads - optimizer)
    return est


def _activation_passes(cfg: Any, shape: ModelShape, sequence: int, est: MemoryEstimate) -> None:
    """The activations of the policy update's micro-batch and of the largest log-prob pass (old policy or
    reference), for sequences of ``sequence`` tokens split over the sequence-parallel ranks: into ``est``."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    actor, rollout, model = arr.actor, arr.rollout, arr.model
    sp = est.sequence_parallel = actor.ulysses_sequence_parallel_size
    if actor.use_dynamic_bsz:  # the group's budget, but never less than one whole sequence
        tokens = max(actor.ppo_max_token_len_per_gpu * sp, sequence)
        sequences = max(1, tokens // sequence)
    else:
        sequences = actor.ppo_micro_batch_size_per_gpu
        tokens = sequences * sequence
    est.one_sequence = sequences == 1
    act_width = 4 if model.dtype == "fp32" else 2
    est.passes["policy update"] = _activations(
        shape,
        tokens / sp,
        sequences * (data.max_response_length + 1) / sp,
        act_width,
        model.enable_gradient_checkpointing,
        grad=True,
    )
    est.passes["log-prob pass"] = max(
        _activations(shape, m * sequence / s, m * (data.max_response_length + 1) / s, act_width, False, False)
        for m, s in (
            (rollout.log_prob_micro_batch_size_per_gpu, sp),
            (arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.ulysses_sequence_parallel_size),
        )
    )


def knob(cfg: Any, est: MemoryEstimate, workers_per_machine: int) -> str:
    """The setting to turn first, for the part of the estimate that weighs most."""
    arr = cfg.actor_rollout_ref
    actor = "actor_rollout_ref.actor"
    static = sum(est.static.values())
    largest = est.largest_pass
    hints = []
    if workers_per_machine > 1 and cfg.trainer.device != "cuda":
        hints.append(
            f"fewer trainer.n_workers (now {cfg.trainer.n_workers}: each CPU worker holds its own "
            "copy in this machine's memory)"
        )
    if est.passes[largest] >= static:
        if largest == "policy update" and est.one_sequence and cfg.trainer.device == "cuda":
            hints.append(_split_sequences(cfg))  # a micro-batch of one sequence: nothing smaller to cut
        if largest == "policy update":
            if arr.actor.use_dynamic_bsz:
                hints.append(
                    f"lower {actor}.ppo_max_token_len_per_gpu (now {arr.actor.ppo_max_token_len_per_gpu})"
                )
            else:
                hints.append(
                    f"lower {actor}.ppo_micro_batch_size_per_gpu (now {arr.actor.ppo_micro_batch_size_per_gpu})"
                )
            if not arr.model.enable_gradient_checkpointing:
                hints.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
        elif largest == "log-prob pass":
            hints.append(
                "lower actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu and "
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
            )
        elif largest == "generation" and arr.actor.strategy == "fsdp2" and not arr.rollout.sharded_generation:
            hints.append(
                "actor_rollout_ref.rollout.sharded_generation=true (generate gathering one layer at a time, "
                "not the whole model)"
            )
        elif largest == "checkpoint read by rank 0":
            hints.append(
                f"{actor}.fsdp_config.param_offload=true"
                if cfg.trainer.device == "cuda"
                else "more memory for rank 0"
            )
        else:
            hints.append("set actor_rollout_ref.rollout.micro_batch_size (prompts generated at once)")
    else:
        if not arr.model.lora_rank:
            hints.append("actor_rollout_ref.model.lora_rank=16 (train adapters, not every weight)")
        if cfg.trainer.device == "cuda":
            hints.append(
                f"{actor}.strategy=fsdp2 over more workers, with {actor}.fsdp_config.optimizer_offload=true"
            )
        hints.append("a smaller model")
    return "; or ".join(hints)


def _split_sequences(cfg: Any) -> str:
    """The setting that splits each sequence over more GPUs (Ulysses), for a sequence too long for one."""
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    now, workers = cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size, cfg.trainer.n_workers
    wanted = 2 * now
    where = (
        f"of the {workers}" if workers % wanted == 0 else f"(with trainer.n_workers a multiple of {wanted})"
    )
    return f"{key}={wanted} (one sequence's activations split over {wanted} GPUs {where}; now {now})"
