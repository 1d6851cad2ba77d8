"""``OfflineTrainer``: SFT, DPO, KTO and reward models on the PPO trainer's machinery, one loop for the four.

An offline step is the last stage of a PPO step with another loss: the batch (demonstrations, preference
pairs, or labelled completions, laid out like rollouts by ``hybridflow.data.offline``) gets the reference
policy's log-probs from the reference worker (``compute_ref_log_prob``; with LoRA the actor's workers, adapter
off) when the objective needs them, then the actor takes one optimiser step on it (``update_actor_offline``:
``TrainingEngine``, micro-batches of rows or of a token budget, data-parallel gradient averaging, clipping).
The run around the steps is ``RunLoop``'s, as for RL: the run-folder lock, tracking (the console line shows the
loss, DPO/KTO's reward margin and accuracy, the gradient norm and lr), resuming (refused with other data
settings), validation and save cadence, hooks, the progress bar. Checkpoints' ``global_step_N/actor/huggingface``
is a plain model folder, so it is the next trainer's ``model.partial_pretrain`` or ``actor_rollout_ref.model.path``.

A reward model (``RMConfig``) trains in a ``RewardModelWorker`` instead of the actor (a sequence classifier,
Bradley-Terry on pairs, no reference); its checkpoint's ``global_step_N/reward_model/huggingface`` is what PPO's
``reward_model.model.path`` loads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hybridflow.algorithms import get_offline_objective, kto_kl_estimate, sequence_log_probs
from hybridflow.config.checks import required
from hybridflow.config.offline import DPOConfig, KTOConfig, OfflineConfig, RMConfig, SFTConfig
from hybridflow.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    PolicyModelConfig,
    RefConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    RolloutConfig,
)
from hybridflow.data import PromptLoader
from hybridflow.data.offline import (
    KTODataset,
    OfflineDataset,
    PreferenceDataset,
    RewardPairDataset,
    SFTConversationDataset,
)
from hybridflow.protocol import DataProto
from hybridflow.runs.tracking import ConsoleFields, Tracking
from hybridflow.single_controller import ClassWithInitArgs, Role, WorkerGroup
from hybridflow.trainer.loop import RunLoop
from hybridflow.trainer.metrics import StepTimings, reduce_metrics, timer
from hybridflow.trainer.worker_groups import WorkerGroups, build_worker_groups
from hybridflow.workers import ActorRolloutRefWorker, RewardModelWorker
from hybridflow.workers.modeling import load_image_prompts, load_tokenizer

logger = logging.getLogger(__name__)


#: What matters in an offline step: the loss, the preference margin and accuracy (DPO; KTO's chosen and rejected
#: rewards and KL reference point), and the optimiser's gradient norm and learning rate.
OFFLINE_CONSOLE_FIELDS: ConsoleFields = (
    ("loss", ("train/loss",)),
    ("margin", ("rewards/margins",)),
    ("acc", ("rewards/accuracies",)),
    ("chosen", ("rewards/chosen",)),
    ("rejected", ("rewards/rejected",)),
    ("kl", ("kl",)),
    ("grad_norm", ("actor/grad_norm", "rm/grad_norm")),
    ("lr", ("actor/lr", "rm/lr")),
)


class OfflineTrainer(RunLoop):
    """Trains on a fixed dataset with the objective of ``config``'s type (``SFTConfig``, ``DPOConfig``,
    ``KTOConfig``, ``RMConfig``). ``worker_groups`` may be given (e.g. your own Ray groups); else built on
    ``fit``. The trained model's group is ``wg.actor_rollout`` (a ``RewardModelWorker`` for ``RMConfig``)."""

    console_fields = OFFLINE_CONSOLE_FIELDS

    def __init__(self, config: OfflineConfig, *, worker_groups: WorkerGroups | None = None) -> None:
        self.config = config = config.validate()  # resolved and checked
        super().__init__(config.trainer, config.to_dict(), worker_groups)
        self.name = config.kind
        self.objective = get_offline_objective(config.kind)
        model_path = required(config.model.partial_pretrain, "model.partial_pretrain")
        self.tokenizer = load_tokenizer(model_path, config.model.trust_remote_code)
        self.processor = load_image_prompts(
            model_path, self.tokenizer, config.model.trust_remote_code
        )  # a vision-language model's image processing (TRL's vision formats: an images column)
        d = config.data
        self.train_loader = self._loader(
            required(d.train_files, "data.train_files"), d.train_batch_size, d.shuffle
        )
        self.val_loader = self._loader(d.val_files, d.train_batch_size, False) if d.val_files else None
        self.total_steps = (
            config.trainer.total_training_steps or len(self.train_loader) * config.trainer.total_epochs
        )
        config.optim.total_training_steps = self.total_steps

    def _dataset(self, files: list[str]) -> OfflineDataset:
        cfg, d, tok = self.config, self.config.data, self.tokenizer
        common: dict[str, Any] = {
            "max_length": d.max_length,
            "truncation": d.truncation,
            "prompt_key": d.prompt_key,
            "apply_chat_template": d.apply_chat_template,
            "processor": self.processor,
            "image_key": d.image_key,
        }
        if isinstance(cfg, RMConfig):
            return RewardPairDataset(
                files,
                tok,
                chosen_key=cfg.data.chosen_key,
                rejected_key=cfg.data.rejected_key,
                margin_key=cfg.data.margin_key,
                **common,
            )
        if isinstance(cfg, DPOConfig):
            chosen, rejected = cfg.data.chosen_key, cfg.data.rejected_key
            return PreferenceDataset(files, tok, chosen_key=chosen, rejected_key=rejected, **common)
        if isinstance(cfg, KTOConfig):
            return KTODataset(
                files, tok, completion_key=cfg.data.completion_key, label_key=cfg.data.label_key, **common
            )
        return SFTConversationDataset(
            files, tok, response_key=cfg.data.response_key, messages_key=cfg.data.messages_key, **common
        )

    def _loader(self, files: list[str], batch_size: int, shuffle: bool) -> PromptLoader:
        """Batches of ``batch_size`` rows; a validation set smaller than that is one batch (rounded down to a
        multiple of the workers, so that every worker gets whole pairs)."""
        dataset = self._dataset(files)
        if not shuffle and len(dataset) < batch_size:
            batch_size = max(len(dataset) - len(dataset) % self.config.trainer.n_workers, 1)
        return PromptLoader(
            dataset,
            batch_size,
            shuffle=shuffle,
            seed=required(self.config.data.seed, "data.seed"),
            collate=dataset.collate,
        )

    # ------------------------------------------------------------------ workers
    def worker_config(self) -> ActorRolloutRefConfig:
        """The ``actor_rollout_ref`` section the workers read, from this config: the model (and its LoRA
        adapters), the optimiser, micro-batches in rows (a DPO pair is two rows) or, for SFT, in tokens, and
        temperature 1 for log-probs."""
        cfg, m = self.config, self.config.model
        rows = cfg.data.micro_batch_size_per_gpu * (2 if cfg.kind == "dpo" else 1)
        actor = ActorConfig(
            ppo_micro_batch_size_per_gpu=rows,
            grad_clip=cfg.optim.clip_grad,
            optim=cfg.optim,
            freeze_vision_tower=m.freeze_vision_tower,
        )
        if isinstance(cfg, SFTConfig):  # SFT rows are independent; a DPO pair must stay in one micro-batch
            actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu = (
                cfg.data.use_dynamic_bsz,
                cfg.data.max_token_len_per_gpu,
            )
        return ActorRolloutRefConfig(
            model=PolicyModelConfig(
                path=m.partial_pretrain,
                trust_remote_code=m.trust_remote_code,
                enable_gradient_checkpointing=m.enable_gradient_checkpointing,
                dtype=m.dtype,
                disable_dropout=m.disable_dropout,
                lora_rank=m.lora_rank,
                lora_alpha=m.lora_alpha,
                target_modules=list(m.target_modules),
            ),
            actor=actor,
            # the offline trainers do not split sequences: the reference's group is one rank, as the actor's
            ref=RefConfig(log_prob_micro_batch_size_per_gpu=rows, ulysses_sequence_parallel_size=1),
            rollout=RolloutConfig(temperature=1.0, log_prob_micro_batch_size_per_gpu=rows),
        )

    def init_workers(self) -> None:
        """The actor (no rollout: nothing is generated) and, for DPO/KTO, the frozen reference: a second
        model, or with LoRA the actor's own module with the adapter off (the actor's workers take the role)."""
        if self.wg is not None:
            return
        if isinstance(self.config, RMConfig):
            self.wg = build_worker_groups(self.config, inits={Role.ACTOR_ROLLOUT: self._reward_model_init()})
            return
        arr, seed, device = self.worker_config(), self.config.trainer.seed, self.config.trainer.device
        ref_in_actor = self.objective.needs_ref and arr.model.lora_rank > 0
        inits = {
            Role.ACTOR_ROLLOUT: ClassWithInitArgs(
                ActorRolloutRefWorker,
                arr,
                seed=seed,
                device=device,
                role="actor_ref" if ref_in_actor else "actor",
            )
        }
        if self.objective.needs_ref and not ref_in_actor:
            inits[Role.REF] = ClassWithInitArgs(
                ActorRolloutRefWorker, arr, role="ref", seed=seed, device=device
            )
        self.wg = build_worker_groups(self.config, inits=inits)

    def _reward_model_init(self) -> ClassWithInitArgs:
        """The reward model's worker, training from ``model.partial_pretrain``; ``micro_batch_size_per_gpu`` pairs
        are also its scoring chunk (two sequences each)."""
        cfg = self.config
        scoring = RewardModelConfig(
            enable=True,
            model=RewardModelPathConfig(path=cfg.model.partial_pretrain),
            micro_batch_size_per_gpu=2 * cfg.data.micro_batch_size_per_gpu,
            input_format="chat" if cfg.data.apply_chat_template else "plain",
        )
        return ClassWithInitArgs(
            RewardModelWorker, scoring, device=cfg.trainer.device, train=cfg, seed=cfg.trainer.seed
        )

    # ------------------------------------------------------------------ one step
    def prepare_batch(self, batch: DataProto) -> DataProto:
        """Attach the objective's settings and the reference log-probs; for KTO, split off the mismatched
        pairs and put their KL estimate ``z0`` into the settings."""
        spec = self.config.loss_spec()
        if isinstance(self.config, KTOConfig):
            batch, mismatched = batch.chunk(2)
            spec["kl"] = self._kto_kl(mismatched)
        batch.meta_info["offline"] = spec
        if self.objective.needs_ref:
            batch = batch.union(self._ref().compute_ref_log_prob(batch))
        return batch

    def _ref(self) -> WorkerGroup:
        """The reference policy's group, which an objective that ``needs_ref`` is built with."""
        if self.groups.ref is None:
            raise RuntimeError(
                f"the {self.config.kind} objective needs a reference policy, and none was built"
            )
        return self.groups.ref

    def _kto_kl(self, mismatched: DataProto) -> float:
        """KTO's reference point from the policy's and the reference's log-probs of mismatched pairs
        (gradient-free by definition, so two plain forward passes)."""
        policy = self.groups.actor_rollout.compute_log_prob(mismatched).tensors["old_log_probs"]
        ref = self._ref().compute_ref_log_prob(mismatched).tensors["ref_log_prob"]
        mask = mismatched.tensors["response_mask"].float()
        return float(kto_kl_estimate(sequence_log_probs(policy, mask), sequence_log_probs(ref, mask)))

    def train_step(
        self, batch: DataProto, metrics: dict[str, float], timings: StepTimings | None = None
    ) -> DataProto:
        """One optimiser step; ``train/loss`` plus the objective's metrics (``rewards/*``, ``logps/*``) and the
        optimiser's (``actor/grad_norm``, ``actor/lr``) go into ``metrics``."""
        t = StepTimings() if timings is None else timings
        rm = isinstance(self.config, RMConfig)
        with timer("step", t):
            with timer("ref", t):
                batch = self.prepare_batch(batch)
            with timer("update_rm" if rm else "update_actor", t):
                trained = self.groups.actor_rollout
                out = trained.update_reward_model(batch) if rm else trained.update_actor_offline(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
        metrics["train/loss"] = metrics.pop("loss")
        metrics.update({f"timing_s/{k}": v for k, v in t.items()})
        return batch

    @property
    def has_validation(self) -> bool:
        return self.val_loader is not None

    def validate(self, tracker: Tracking | None = None) -> dict[str, float]:
        """The objective on the validation files without updating: ``val/loss``, ``val/rewards/*``..."""
        if self.val_loader is None:
            return {}
        sums: dict[str, float] = {}
        count = 0
        trained = self.groups.actor_rollout
        evaluate = (
            trained.evaluate_reward_model if isinstance(self.config, RMConfig) else trained.evaluate_offline
        )
        for batch in self.val_loader:
            metrics = reduce_metrics(evaluate(self.prepare_batch(batch)).meta_info["metrics"])
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * len(batch)
            count += len(batch)
        return {f"val/{key}": value / count for key, value in sums.items()}

    # ------------------------------------------------------------------ checkpoints
    @property
    def model_folder(self) -> str:
        """Where a checkpoint keeps the trained model: ``actor`` (SFT, DPO, KTO) or ``reward_model``."""
        return "reward_model" if isinstance(self.config, RMConfig) else "actor"

    def save_state(self, folder: Path) -> dict[str, Any]:
        self.groups.actor_rollout.save_checkpoint(str(folder / self.model_folder))
        return {}

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        self.groups.actor_rollout.load_checkpoint(str(folder / self.model_folder))
