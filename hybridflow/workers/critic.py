"""``CriticWorker``: a value head on a causal LM, trained with the clipped value loss.

The model is ``AutoModelForTokenClassification`` with one label: the causal LM's backbone plus a fresh
linear head, so the critic starts from the policy's (or any) checkpoint and saves as a Hugging Face folder.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.algorithms import compute_value_loss, masked_mean
from hybridflow.config import CriticConfig
from hybridflow.config.checks import required
from hybridflow.models.vision import freeze_vision_tower
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.checkpointing import load_worker_state, save_worker_state
from hybridflow.workers.engine import TrainingEngine
from hybridflow.workers.modeling import load_model, load_tokenizer, response_values
from hybridflow.workers.packing import MicroBatching, batched
from hybridflow.workers.row_layouts import RowLayout, image_column
from hybridflow.workers.sharding import (
    agreed_count,
    load_placement,
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

T = TypeVar("T")


class CriticWorker(Worker):
    """``config``: the ``critic`` config section (its ``model.path`` already resolved by the trainer);
    ``rollout_n``: samples per prompt, since ``ppo_mini_batch_size`` counts prompts; ``device``: ``trainer.device``."""

    def __init__(
        self, config: CriticConfig, rollout_n: int = 1, seed: int = 42, device: str = "auto"
    ) -> None:
        super().__init__(device)
        self.config, self.rollout_n, self.seed = config, rollout_n, seed
        self._module: PreTrainedModel | None = None
        self._engine: TrainingEngine | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.sp: SequenceParallel | None = (
            None  # the Ulysses group (critic.ulysses_sequence_parallel_size > 1)
        )
        self.rows = RowLayout()  # the layouts the value model's forwards take (set with the model)

    @property
    def module(self) -> PreTrainedModel:
        """The value model (``init_model`` loads it)."""
        return _loaded(self._module)

    @property
    def engine(self) -> TrainingEngine:
        return _loaded(self._engine)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return _loaded(self._tokenizer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.seed)  # the same fresh value head on every rank
        self.init_process_group()
        model_cfg = self.config.model
        model_path = required(model_cfg.path, "critic.model.path")
        self._tokenizer = load_tokenizer(model_path, model_cfg.trust_remote_code)
        critic = self.config
        strategy = resolve_strategy(critic.strategy, self.world_size, "critic.strategy")
        module = load_model(
            model_path,
            *load_placement(strategy, model_cfg.dtype, self.device),
            auto_cls=AutoModelForTokenClassification,
            num_labels=1,
            trust_remote_code=model_cfg.trust_remote_code,
            new_head="the critic's value head",
            disable_dropout=model_cfg.disable_dropout,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            on_meta=not reads_weights(strategy),
        )
        module.config.pad_token_id = self.tokenizer.pad_token_id
        self.sp = sequence_parallel(
            critic.ulysses_sequence_parallel_size, "critic.ulysses_sequence_parallel_size"
        )
        if self.sp is not None:
            enable_ulysses(module, self.sp.size, "critic.ulysses_sequence_parallel_size")
        self.rows = RowLayout.of(
            module, model_cfg.share_prompt_prefix, model_cfg.use_remove_padding, "critic.model"
        )
        for part in module.modules():  # transformers puts a 0.1 dropout before the head: the update would fit
            if isinstance(
                part, torch.nn.Dropout
            ):  # noisy values, not those compute_values returned (eval mode)
                part.p = 0.0
        if model_cfg.freeze_vision_tower:
            freeze_vision_tower(module)
        self._module = wrap_model(module, strategy, model_cfg.fsdp_config, self.device)
        self._engine = TrainingEngine(
            self.module,
            critic.optim,
            critic.grad_clip,
            "critic",
            self.world_size,
            model_cfg.fsdp_config.optimizer_offload,
            critic.ulysses_sequence_parallel_size,
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` ``(bs, L)``, zero outside the response mask."""
        self.module.eval()
        rows = self.rows
        micro = self._micro_batching()
        union = gather_rows(data, self.sp)  # a Ulysses group scores its ranks' rows together
        values = batched(
            lambda d: response_values(self.module, d, rows.share_prompt, self.sp, rows.remove_padding),
            union,
            micro,
            agreed_count(micro, union, self.module),
        )
        self.module.train()
        return DataProto.from_dict({"values": own_rows(values, self.sp) * data.tensors["response_mask"]})

    def _micro_batching(self) -> MicroBatching:
        critic = self.config
        budget = critic.ppo_max_token_len_per_gpu * critic.ulysses_sequence_parallel_size
        return MicroBatching(
            critic.ppo_micro_batch_size_per_gpu,
            budget if critic.use_dynamic_bsz else None,
            self.rows.share_prompt,
        )

    def _value_loss(self, micro: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro.tensors["response_mask"].float()
        rows = self.rows
        vpreds = response_values(self.module, micro, rows.share_prompt, self.sp, rows.remove_padding)
        vf_loss, clipfrac = compute_value_loss(
            vpreds,
            micro.tensors["returns"],
            micro.tensors["values"],
            mask,
            self.config.cliprange_value,
            self.config.loss_agg_mode,
        )
        return vf_loss, {
            "critic/vf_loss": vf_loss.item(),
            "critic/vf_clipfrac": float(clipfrac.detach()),
            "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask)),
        }

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        critic = self.config
        groups = critic.ulysses_sequence_parallel_size  # a Ulysses group trains on its ranks' rows together
        mini_batch = (
            required(critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size")
            * self.rollout_n
            // self.world_size
            * groups
        )
        keys = [
            "responses",
            "response_mask",
            "input_ids",
            "attention_mask",
            "position_ids",
            "values",
            "returns",
        ]
        selected = data.select(batch_keys=keys, non_tensor_batch_keys=image_column(data), meta_info_keys=[])
        data = gather_rows(selected, self.sp)
        self.module.train()
        metrics = self.engine.update(
            data,
            mini_batch,
            self._micro_batching(),
            self._value_loss,
            critic.loss_agg_mode,
            required(critic.ppo_epochs, "critic.ppo_epochs"),
            seed=self.seed,
        )
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        save_worker_state(path, self.module, self.tokenizer, self.engine, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        load_worker_state(path, self.module, self.engine, self.rank)


def _loaded(part: T | None) -> T:
    """A part of the critic that ``init_model`` builds; a RuntimeError before it ran."""
    if part is None:
        raise RuntimeError("CriticWorker: call init_model first")
    return part
