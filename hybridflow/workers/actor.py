"""``ActorRolloutRefWorker``: the policy in any combination of roles: actor, rollout, reference.

With ``role="actor_rollout"`` (the hybrid engine) the rollout samples from the very module the actor
trains: one copy of the weights, no synchronisation step (a sharded module is gathered for generation and
sharded again after it). The reference policy is a second, frozen copy, loaded only when the role includes
``ref``; with LoRA it is the actor's own module with the adapter switched off, so no second copy exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from hybridflow.algorithms import (
    compute_sft_loss,
    get_offline_objective,
)
from hybridflow.config import ActorRolloutRefConfig, SandboxConfig
from hybridflow.config.checks import required
from hybridflow.models.routing import ROUTED_EXPERTS
from hybridflow.models.vision import freeze_vision_tower
from hybridflow.protocol import DataProto
from hybridflow.rollout import (
    EngineSpec,
    Rollout,
    RolloutEngine,
    check_generation_batch,
    is_tagged,
    tag_weight_versions,
)
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpointing import load_worker_state, save_worker_state
from hybridflow.workers.engine import DivergedError, TrainingEngine
from hybridflow.workers.expert_routing import PolicyRouting, Routing, routing_metrics
from hybridflow.workers.modeling import (
    load_image_prompts,
    load_model,
    load_tokenizer,
    model_location,
    response_log_probs,
    weights_source,
)
from hybridflow.workers.packing import MicroBatching, batched
from hybridflow.workers.policy_objective import logprob_diff_metrics, policy_objective
from hybridflow.workers.rollout import build_rollout, records_routing
from hybridflow.workers.row_layouts import RowLayout, image_column
from hybridflow.workers.sharding import (
    agreed_count,
    gathered,
    is_lora,
    load_placement,
    lockstep,
    reads_weights,
    resolve_strategy,
    wrap_model,
)
from hybridflow.workers.ulysses import (
    SequenceParallel,
    enable_ulysses,
    gather_rows,
    own_rows,
    sequence_parallel,
)
from hybridflow.workers.weight_sync import WeightLink, WeightMailbox, WeightSyncEnds, policy_weights

T = TypeVar("T")
ROLES = ("actor", "rollout", "ref")


#: The columns ``update_actor`` reads (those present): the rows, their advantages and the log-probs the ratio
#: and the KL terms need (``old_log_probs`` only when the data is used again, ``ref_log_prob`` with a KL term,
#: ``rollout_log_probs`` when the engine reported them). Replay keeps exactly these (``trainer.replay``).
UPDATE_ACTOR_KEYS = (
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "advantages",
    "old_log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "teacher_log_prob",
    ROUTED_EXPERTS,
)


class ActorRolloutRefWorker(WeightSyncEnds, Worker):
    """``config``: the ``actor_rollout_ref`` config section; ``role``: roles joined by ``_``
    (``actor_rollout``, ``actor_rollout_ref``, ``ref``, ``rollout``...); ``device``: ``trainer.device``;
    ``announce``: print one line per generation (``[rollout] generated ...``); ``rollout_engine``: the
    rollout engine's class (default: the one registered as ``rollout.name`` in this process; the trainer
    hands it over, so an engine registered in the driver is built in Ray's workers too). The rollout mode
    (the agent loop, a served agent) follows from the rollout config (``build_rollout``); ``sandbox``: the config's ``sandbox`` section, which says
    whether the python tool may run code unisolated."""

    def __init__(
        self,
        config: ActorRolloutRefConfig,
        role: str = "actor_rollout",
        response_length: int = 64,
        seed: int = 42,
        device: str = "auto",
        announce: bool = False,
        rollout_engine: type[RolloutEngine] | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        super().__init__(device)
        unknown = [r for r in role.split("_") if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown role part(s) {unknown} in {role!r}; roles combine {ROLES}")
        self.config, self.role = config, role
        self._is_actor, self._is_rollout, self._is_ref = (r in role.split("_") for r in ROLES)
        self.response_length, self.seed = response_length, seed
        self.announce = (
            announce  # print what this worker did (a role in its own process, as the tutorial logs)
        )
        self.module: PreTrainedModel | None = None  # the actor's (or a rollout-only worker's copy)
        self.ref_module: PreTrainedModel | None = None
        self.engine: TrainingEngine | None = None
        self.rollout: Rollout | None = None
        self.rollout_engine = rollout_engine
        # sequence-parallel groups (ulysses_sequence_parallel_size > 1)
        self.actor_sp: SequenceParallel | None = None
        self.rows = RowLayout()  # the layouts the policy's forwards take (set with the model)
        self.routing: PolicyRouting | None = None  # an MoE policy's expert routing (set with the actor)
        self.ref_sp: SequenceParallel | None = None
        self.mailbox: WeightMailbox | None = None  # a rollout-only worker's weight versions (async runs)
        self.sandbox = sandbox or SandboxConfig()
        self.weights_received = 0  # weight updates a rollout-only worker was sent
        self.weight_link: WeightLink | None = None  # to or from the actor's rank 0 (split placement on Ray)

    def weight_version(self) -> int:
        """How many times the weights the rollout samples from have changed: the actor's optimiser steps, the
        version an asynchronous rollout worker holds, or the updates a separate rollout worker received."""
        if self.engine is not None:
            return self.engine.steps_done
        return (
            self.mailbox.version
            if self.mailbox is not None and self.mailbox.version
            else self.weights_received
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load what this worker's roles need: the policy (trained by the actor, sampled by the rollout), its
        optimiser, the rollout engine, the frozen reference."""
        torch.manual_seed(self.seed + self.rank)
        self.init_process_group()
        model_cfg = self.config.model
        model_path = required(model_cfg.path, "actor_rollout_ref.model.path")
        self.tokenizer = load_tokenizer(model_path, model_cfg.trust_remote_code)
        self.processor = load_image_prompts(model_path, self.tokenizer, model_cfg.trust_remote_code)
        if self._is_actor or self._is_rollout:
            self._init_policy(model_path)
        if self._is_rollout:
            self._init_rollout(model_path)
        if self._is_actor:
            records = records_routing(self.config.rollout, self.rollout_engine)
            self.routing = PolicyRouting.of(self.config.actor, self.policy, records, self.actor_sp)
        if self._is_ref and not (self.module is not None and is_lora(self.module)):
            self._init_ref(model_path)
        elif self._is_ref:  # LoRA: the reference is the actor's module with the adapter off
            self.ref_sp = self._sequence_parallel(self.policy, self._ref_sp_size(), "ref")

    def _init_policy(self, model_path: str) -> None:
        """The policy module, wrapped for its strategy (LoRA, sharding), and the actor's training engine."""
        model_cfg, actor = self.config.model, self.config.actor
        # a rollout-only worker (trainer.placement=split) holds a plain copy the actor's full weights load into
        strategy = resolve_strategy(actor.strategy, self.world_size) if self._is_actor else "ddp"
        lora = model_cfg.lora_rank if self._is_actor or self.sends_adapters() else 0
        placement = load_placement(strategy, model_cfg.dtype, self.device)
        module = load_model(
            model_path,
            *placement,
            trust_remote_code=model_cfg.trust_remote_code,
            disable_dropout=model_cfg.disable_dropout,
            gradient_checkpointing=self._is_actor and model_cfg.enable_gradient_checkpointing,
            on_meta=not reads_weights(strategy, lora, streamed=True),
        )
        if self._is_actor:
            self.actor_sp = self._sequence_parallel(module, actor.ulysses_sequence_parallel_size, "actor")
        self.rows = self._row_layout(module)
        if self._is_actor and actor.freeze_vision_tower:
            freeze_vision_tower(module)
        self.module = wrap_model(
            module,
            strategy,
            actor.fsdp_config,
            self.device,
            lora,
            model_cfg.lora_alpha,
            model_cfg.target_modules,
            self._weights_source(placement[1]),
        )
        if self._is_actor:
            self.engine = TrainingEngine(
                self.policy,
                actor.optim,
                actor.grad_clip,
                "actor",
                self.world_size,
                actor.fsdp_config.optimizer_offload,
                actor.ulysses_sequence_parallel_size,
            )

    def _init_rollout(self, model_path: str) -> None:
        """The rollout engine over the policy (a rollout-only worker also gets the mailbox its weights arrive in)."""
        rollout = self.config.rollout
        spec = EngineSpec(
            rollout,
            self.policy,
            self.tokenizer,
            self.response_length,
            model_location(model_path),
            (self.seed if rollout.seed is None else rollout.seed) + self.rank,
            record_routing=self.config.actor.router_replay.mode == "R3",
        )
        self.rollout = build_rollout(
            spec, self.rollout_engine, self.weight_version, self.sandbox.unsafe_without_isolation
        )
        if not self._is_actor:
            self.mailbox = WeightMailbox(self._load_weights)

    def _init_ref(self, model_path: str) -> None:
        """The reference policy: a frozen copy of the model, wrapped for the reference's own strategy."""
        model_cfg = self.config.model
        strategy = resolve_strategy(
            self.config.ref.strategy, self.world_size, "actor_rollout_ref.ref.strategy"
        )
        placement = load_placement(strategy, model_cfg.dtype, self.device)
        module = load_model(
            model_path,
            *placement,
            trust_remote_code=model_cfg.trust_remote_code,
            disable_dropout=model_cfg.disable_dropout,
            on_meta=not reads_weights(strategy, streamed=True),
        ).eval()
        module.requires_grad_(False)
        self.ref_sp = self._sequence_parallel(module, self._ref_sp_size(), "ref")
        if self.module is None:  # a reference-only worker: the same model, so the same layouts
            self.rows = self._row_layout(module)
        self.ref_module = wrap_model(
            module,
            strategy,
            self.config.ref.fsdp_config,
            self.device,
            weights=self._weights_source(placement[1]),
        )

    def _weights_source(self, dtype: str | None) -> Callable[[torch.nn.Module], Any]:
        """Where rank 0 of a sharded policy takes the full tensors it sends to the ranks (``weights_source``)."""
        model_cfg = self.config.model
        path = required(model_cfg.path, "actor_rollout_ref.model.path")
        return weights_source(path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code)

    def _row_layout(self, module: PreTrainedModel) -> RowLayout:
        model = self.config.model
        return RowLayout.of(
            module, model.share_prompt_prefix, model.use_remove_padding, "actor_rollout_ref.model"
        )

    def _ref_sp_size(self) -> int:
        key = "actor_rollout_ref.ref.ulysses_sequence_parallel_size"  # resolve() sets it (null: the actor's)
        return required(self.config.ref.ulysses_sequence_parallel_size, key)

    def _sequence_parallel(self, module: PreTrainedModel, size: int, role: str) -> SequenceParallel | None:
        """This rank's Ulysses group for ``role`` (None for size 1), with ``module`` made able to use it."""
        key = f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size"
        sp = sequence_parallel(size, key)
        if sp is not None:
            enable_ulysses(module, size, key)
        return sp

    # ---------------------------------------------------------------- rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        rollout = self._require(self.rollout, "rollout", "generate_sequences")
        check_generation_batch(prompts)
        if "global_step" in prompts.meta_info:
            rollout.reseed(prompts.meta_info["global_step"])
        mailbox = self.mailbox if "weight_version" in prompts.meta_info else None  # an asynchronous run's
        if mailbox is not None:
            self._use_weights(prompts.meta_info, mailbox, rollout)
        try:
            reshard = self.config.actor.fsdp_config.reshard_after_forward
            sharded = self.config.rollout.sharded_generation
            with (lockstep if sharded else gathered)(self.policy, reshard):
                out = rollout.generate_sequences(prompts)
        except DivergedError as e:
            if self.engine is None or self.engine.steps_done == 0:
                raise
            raise DivergedError(
                f"{e}: the update of training step {self.engine.steps_done} (lr "
                f"{self.engine.lr:g}) broke the weights; lower actor_rollout_ref.actor.optim.lr"
            ) from e
        finally:
            if mailbox is not None and mailbox.follow:
                mailbox.follow = False
                rollout.follow_weights(None)
        if mailbox is not None and not is_tagged(out):  # generated by one version from start to end
            tag_weight_versions(out, mailbox.version)
        if self.announce:
            print(f"[rollout] generated {len(out)} responses for {len(prompts)} prompts", flush=True)
        return out

    # ---------------------------------------------------------------- weight sync
    def _use_weights(self, meta: dict[str, Any], mailbox: WeightMailbox, rollout: Rollout) -> None:
        """An asynchronous run's generation: load ``meta["weight_version"]`` (None: the newest posted), forget
        versions older than ``meta["keep_from"]``, and with ``meta["follow_weights"]`` (a partial rollout) let
        the engine take newer versions between decoding steps."""
        mailbox.use(meta["weight_version"], meta.get("keep_from"))
        if meta.get("follow_weights"):
            if not rollout.capabilities.follows_weights:
                raise ValueError(
                    "a partial rollout needs a rollout that takes new weights between decoding steps "
                    f"(Capabilities.follows_weights: hf, vllm); {type(rollout).__name__} does not"
                )
            mailbox.follow = True
            rollout.follow_weights(mailbox)

    def _sync_rollout(self) -> None:
        """After the actor's weights changed: a rollout engine with its own copy (vLLM) takes the new ones
        in memory; the Hugging Face rollout samples from the trained module itself and needs nothing."""
        if self._is_actor and self.rollout is not None and self.rollout.capabilities.own_weights:
            self.rollout.update_weights(policy_weights(self.policy))

    # ---------------------------------------------------------------- log-probs
    def _log_probs(
        self,
        module: PreTrainedModel,
        data: DataProto,
        with_entropy: bool,
        micro_batch_size: int,
        max_token_len: int | None,
        sp: SequenceParallel | None = None,
        routing: PolicyRouting | None = None,
    ) -> tuple[torch.Tensor, Any, torch.Tensor | None, list[Routing]]:
        """Log-probs without gradients: ``micro_batch_size`` rows, or ``max_token_len`` tokens, a forward.
        ``sp``: a Ulysses group, whose ranks score their rows together (a token budget per rank: x its size).
        ``routing``: the policy's expert routing; then also each token's chosen experts ``(bs, T, layers, k)``
        (None for a dense model) and each forward's ``Routing``."""
        was_training = module.training
        module.eval()
        data = gather_rows(data, sp)
        budget = max_token_len * sp.size if max_token_len and sp is not None else max_token_len
        micro = MicroBatching(micro_batch_size or len(data), budget, self.rows.share_prompt)
        temperature = self.config.rollout.temperature
        routings: list[Routing] = []

        def forward(d: DataProto) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            asked = routing.for_log_probs(d) if routing is not None else None
            routings.extend([asked] if asked is not None else [])
            log_probs, entropy = self._score(module, d, sp, temperature, with_entropy, routing=asked)
            return log_probs, entropy, None if asked is None else asked.chosen

        log_probs, entropy, chosen = batched(forward, data, micro, agreed_count(micro, data, module))
        module.train(was_training)
        return own_rows(log_probs, sp), own_rows(entropy, sp), chosen, routings

    def _score(
        self,
        module: PreTrainedModel,
        data: DataProto,
        sp: SequenceParallel | None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``response_log_probs`` under this worker's row layouts, ``sp`` the role's Ulysses group (or None)."""
        rows = self.rows
        return response_log_probs(
            module,
            data,
            temperature,
            with_entropy,
            entropy_grad,
            rows.share_prompt,
            sp,
            rows.remove_padding,
            routing,
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` ``(bs, L)`` under the current policy; for an MoE policy under
        ``router_replay.mode=R2`` also ``routed_experts``, the choices the updates replay."""
        policy = self._require(self.module, "actor", "compute_log_prob")
        rollout = self.config.rollout
        log_probs, entropy, chosen, routings = self._log_probs(
            policy,
            data,
            True,
            rollout.log_prob_micro_batch_size_per_gpu,
            rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None,
            self.actor_sp,
            self.routing,
        )
        metrics = routing_metrics(routings)
        if "rollout_log_probs" in data.tensors.keys() and data.tensors["rollout_log_probs"].abs().sum() > 0:
            metrics |= logprob_diff_metrics(
                data.tensors["rollout_log_probs"], log_probs, data.tensors["response_mask"]
            )
        columns = {"old_log_probs": log_probs, "entropys": entropy}
        if chosen is not None and self.routing is not None and self.routing.hands_on():
            columns[ROUTED_EXPERTS] = chosen
        return DataProto.from_dict(columns, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` ``(bs, L)`` under the frozen reference policy (with LoRA: the adapter off)."""
        ref = self.config.ref
        micro, budget = (
            ref.log_prob_micro_batch_size_per_gpu,
            (ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None),
        )
        if self._is_ref and self.ref_module is None:
            from peft import PeftModel

            lora = self.policy
            if not isinstance(lora, PeftModel):  # the LoRA actor is its own reference (role actor_ref)
                raise RuntimeError(
                    f"the reference is the actor with its adapter off, but it has none: {type(lora)}"
                )
            with lora.disable_adapter():
                log_probs, *_ = self._log_probs(self.policy, data, False, micro, budget, self.ref_sp)
        else:
            ref_module = self._require(self.ref_module, "ref", "compute_ref_log_prob")
            log_probs, *_ = self._log_probs(ref_module, data, False, micro, budget, self.ref_sp)
        return DataProto.from_dict({"ref_log_prob": log_probs})

    # ---------------------------------------------------------------- training
    def _policy_loss(self, micro: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy's log-probs (and entropy) of the sampled tokens, then ``policy_objective`` on them (and an
        MoE policy's routing: replayed choices, the load-balancing term)."""
        routing = self.routing.for_update(micro) if self.routing is not None else None
        temperature, entropy_grad = self.config.rollout.temperature, self.config.actor.entropy_coeff != 0
        log_prob, entropy = self._score(
            self.policy, micro, self.actor_sp, temperature, True, entropy_grad, routing
        )
        if entropy is None:  # asked for above (with_entropy=True)
            raise RuntimeError("response_log_probs(with_entropy=True) returned no entropy")
        loss, metrics = policy_objective(self.config, micro, log_prob, entropy)
        if self.routing is not None:
            term, routing_found = self.routing.loss(routing)
            loss = loss if term is None else loss + term
            metrics |= routing_found
        return loss, metrics

    def _sft_loss(self, micro: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """Supervised NLL on demonstration responses (prompt tokens masked out)."""
        log_prob, _ = self._score(self.policy, micro, self.actor_sp)
        loss = compute_sft_loss(
            log_prob, micro.tensors["response_mask"].float(), self.config.actor.loss_agg_mode
        )
        return loss, {"actor/sft_loss": loss.item()}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto, sft_data: DataProto | None = None) -> DataProto:
        """PPO epochs over mini-batches of this rank's shard; metrics come back in ``meta_info``.

        ``sft_data`` (demonstrations laid out like rollouts: ``input_ids``, ``responses``,
        ``response_mask``...) adds ``sft_data.meta_info["loss_coef"]`` x its NLL to every optimiser step."""
        engine = self._require(self.engine, "actor", "update_actor")
        actor = self.config.actor
        sp = self.actor_sp  # a Ulysses group trains on its ranks' rows together
        mini_batch = (
            actor.ppo_mini_batch_size * self.config.rollout.n // self.world_size * (sp.size if sp else 1)
        )
        keys = [k for k in UPDATE_ACTOR_KEYS if k in data.tensors.keys()]
        selected = data.select(batch_keys=keys, non_tensor_batch_keys=image_column(data), meta_info_keys=[])
        data = gather_rows(selected, sp)
        self.policy.train()
        extra = []
        if sft_data is not None and len(sft_data):
            coef = float(sft_data.meta_info["loss_coef"])
            extra = [(gather_rows(sft_data, sp), self._sft_loss, coef)]
        metrics = engine.update(
            data,
            mini_batch,
            self._micro_batching(),
            self._policy_loss,
            actor.loss_agg_mode,
            actor.ppo_epochs,
            actor.shuffle,
            self.seed,
            extra,
        )
        self._sync_rollout()
        return DataProto(meta_info={"metrics": metrics})

    def _micro_batching(self) -> MicroBatching:
        """How the actor's updates cut their batch: ``ppo_micro_batch_size_per_gpu`` rows, or with
        ``use_dynamic_bsz`` up to ``ppo_max_token_len_per_gpu`` real tokens per micro-batch."""
        actor = self.config.actor
        return MicroBatching(
            actor.ppo_micro_batch_size_per_gpu,
            actor.ppo_max_token_len_per_gpu * actor.ulysses_sequence_parallel_size
            if actor.use_dynamic_bsz
            else None,
            self.rows.share_prompt,
        )

    # ---------------------------------------------------------------- offline training (SFT, DPO, KTO)
    def _offline_loss(self, micro: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective ``micro.meta_info["offline"]["loss"]`` (``hybridflow.algorithms.preference``) on the
        policy's log-probs of ``responses`` (temperature 1: the model's own distribution)."""
        spec = micro.meta_info["offline"]
        log_prob, _ = self._score(self.policy, micro, self.actor_sp)
        return get_offline_objective(spec["loss"]).fn(log_prob, micro.tensors, spec)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor_offline(self, data: DataProto) -> DataProto:
        """One optimiser step over this rank's shard of an offline batch (laid out like rollouts, plus
        ``ref_log_prob``/``label`` where the objective needs them), micro-batch by micro-batch;
        ``data.meta_info["offline"]`` names the objective and its settings. Metrics in ``meta_info``."""
        engine = self._require(self.engine, "actor", "update_actor_offline")
        objective = get_offline_objective(data.meta_info["offline"]["loss"])
        data = gather_rows(data, self.actor_sp)
        self.policy.train()
        metrics = engine.update(
            data,
            len(data),
            self._micro_batching(),
            self._offline_loss,
            objective.loss_agg_mode,
            seed=self.seed,
        )
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def evaluate_offline(self, data: DataProto) -> DataProto:
        """The offline objective on held-out data without updating: each metric averaged over this shard's
        micro-batches, weighted as the update weighs them (tokens for SFT, rows otherwise)."""
        policy = self._require(self.module, "actor", "evaluate_offline")
        by_tokens = get_offline_objective(data.meta_info["offline"]["loss"]).loss_agg_mode == "token-mean"
        data = gather_rows(data, self.actor_sp)
        was_training = policy.training
        policy.eval()
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        batching = self._micro_batching()
        with torch.no_grad():
            for micro, real in batching.split(data, agreed_count(batching, data, policy)):
                metrics = self._offline_loss(micro)[1]  # a filler's forward keeps sharded ranks in step
                size = float(micro.tensors["response_mask"].sum()) if by_tokens else float(len(micro))
                weight = size if real else 0.0
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + weight * value
                    weights[key] = weights.get(key, 0.0) + weight
        policy.train(was_training)
        return DataProto(meta_info={"metrics": {k: [sums[k] / max(weights[k], 1e-8)] for k in sums}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scale_lr(self, scale: float) -> float:
        engine = self._require(self.engine, "actor", "scale_lr")
        return engine.scale_lr(scale)

    # ---------------------------------------------------------------- checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """``path/huggingface`` (a plain HF model folder) plus optimiser, schedule and RNG state
        (``workers.checkpointing`` has the layout, sharded and LoRA variants included)."""
        engine = self._require(self.engine, "actor", "save_checkpoint")
        save_worker_state(
            path,
            self.policy,
            self.tokenizer,
            engine,
            self.rank,
            self.config.actor.checkpoint.save_lora_only,
            self.processor,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        engine = self._require(self.engine, "actor", "load_checkpoint")
        load_worker_state(path, self.policy, engine, self.rank)
        self._sync_rollout()

    def _require(self, part: T | None, role: str, method: str) -> T:
        """``part`` (the module, engine, rollout... of ``role``), which ``method`` needs; a RuntimeError
        naming the role this worker has when it has none."""
        if part is None:
            raise RuntimeError(
                f"{method} needs the {role!r} role, but this worker was built with role "
                f"{self.role!r} (pid {os.getpid()}); call init_model first if you did not"
            )
        return part

    @property
    def policy(self) -> PreTrainedModel:
        """The policy's module: the actor's, or a rollout-only worker's copy."""
        return self._require(self.module, "actor", "the policy module")
