"""``TrainingEngine``: the optimisation machinery the actor and the critic share.

One engine owns one model's optimiser (AdamW), learning-rate schedule (warmup, then constant or cosine,
times a user scale that callbacks may change), micro-batch gradient accumulation, data-parallel gradient
averaging and gradient clipping, and the model's checkpoint state.

Data parallelism is DDP-style by default: every rank holds the whole model, computes gradients on its shard,
and one all-reduce sums them before the step. A module sharded with FSDP2 (``sharding.shard_module``)
reduce-scatters its own gradients in the backward (averaged over ranks, so the engine scales the loss by
the world size to keep the sum), and the optimiser steps over each rank's shards only. Each micro-batch's
loss is weighted by its share of the *global* mini-batch (tokens for ``token-mean``, non-empty
responses otherwise),
so an update on 2 ranks equals the update on 1 rank over the same global batch, up to float rounding.
Under FSDP2 the ranks first agree on how many micro-batches each mini-batch is cut into (a token budget
gives each shard its own count; ``sharding.agreed_count``), since every forward and backward is a collective.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.config import OptimConfig
from hybridflow.protocol import DataProto
from hybridflow.utils.errors import UserError
from hybridflow.workers.packing import MicroBatching, as_micro_batching
from hybridflow.workers.sharding import agreed_count, broadcast_module, collective_device, is_sharded

logger = logging.getLogger(__name__)

LossFn = Callable[[DataProto], tuple[torch.Tensor, dict[str, float]]]


class DivergedError(UserError, FloatingPointError):
    """The weights (or what the model computes from them) stopped being finite: an input problem (a
    learning rate far too high, NaN in the rewards), reported naming the step and the learning rate."""


# optimiser settings a checkpoint holds that the config may have changed since (applied on resume)
_OPTIM_SETTINGS = ("initial_lr", "betas", "weight_decay")


def _as_list(value: Any) -> Any:
    """Betas compare equal whether a checkpoint kept them as a tuple or a list."""
    return list(value) if isinstance(value, tuple | list) else value


def _full_float(value: torch.Tensor) -> float:
    """A norm as a float; over FSDP2 shards it is a DTensor, whose full value needs the other ranks."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


class TrainingEngine:
    """Optimises ``module``; ``name`` (e.g. ``actor``) prefixes error messages and metrics.

    ``optim``: an ``OptimConfig`` (``actor_rollout_ref.actor.optim`` or ``critic.optim``), read as is:
    its defaults are the schema's, not the engine's. ``optimizer_offload`` keeps the AdamW moments in CPU
    memory except during the step (for a CUDA model; a CPU model's state is in CPU memory anyway).
    ``sequence_parallel``: how many ranks hold each batch (a Ulysses group, ``workers.ulysses``: its ranks
    train on the group's rows together), so a batch's weight is counted once, not once per rank."""

    def __init__(
        self,
        module: torch.nn.Module,
        optim: OptimConfig,
        grad_clip: float | None,
        name: str,
        world_size: int = 1,
        optimizer_offload: bool = False,
        sequence_parallel: int = 1,
    ) -> None:
        self.module = module
        self.name = name
        self.sequence_parallel = sequence_parallel
        self.grad_clip = grad_clip
        self.world_size = world_size if dist.is_initialized() else 1
        self.sharded = is_sharded(module)
        if self.world_size > 1 and not self.sharded:  # shard_module already broadcast a sharded module
            broadcast_module(
                module
            )  # identical starting weights on every rank (a fresh value head is random)
        device = next(module.parameters()).device
        self._offload = optimizer_offload and device.type == "cuda"
        beta1, beta2 = optim.betas
        self.optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(beta1, beta2),
            weight_decay=optim.weight_decay,
        )
        self.lr_scale = 1.0
        total, warmup = optim.total_training_steps, optim.lr_warmup_steps
        if warmup < 0:
            warmup = int(optim.lr_warmup_steps_ratio * max(total, 0))
        self._warmup, self._total = warmup, total
        self._style = optim.warmup_style
        self._min_lr_ratio = optim.min_lr_ratio
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        """Warmup then constant or cosine decay to ``min_lr_ratio``, times the callbacks' ``lr_scale``."""
        if step < self._warmup:
            factor = (step + 1) / self._warmup
        elif self._style == "cosine" and self._total > self._warmup:
            progress = min(1.0, (step - self._warmup) / (self._total - self._warmup))
            factor = self._min_lr_ratio + (1 - self._min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        else:
            factor = 1.0
        return factor * self.lr_scale

    def scale_lr(self, scale: float) -> float:
        """Multiply the learning rate by ``scale`` from the next update on; returns the new lr."""
        self.lr_scale *= scale
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(self.scheduler.last_epoch)
        return self.optimizer.param_groups[0]["lr"]

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _global_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t)
        return float(t.item())

    def update(
        self,
        data: DataProto,
        mini_batch_size: int,
        micro_batch_size: int | MicroBatching,
        loss_fn: LossFn,
        loss_agg_mode: str = "token-mean",
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 42,
        extra_terms: Sequence[tuple[DataProto, LossFn, float]] = (),
    ) -> dict[str, list[float]]:
        """One training step's update: ``epochs`` passes over ``data`` (this rank's shard) in mini-batches,
        one optimiser step each, then the learning-rate schedule advances once. Returns every
        mini-batch's metrics plus ``<name>/lr``, the rate these steps used."""
        metrics: dict[str, list[float]] = {}
        for mini in data.make_iterator(mini_batch_size, epochs=epochs, shuffle=shuffle, seed=seed):
            for key, value in self.train_mini_batch(
                mini, micro_batch_size, loss_fn, loss_agg_mode, extra_terms
            ).items():
                metrics.setdefault(key, []).append(value)
        metrics[f"{self.name}/lr"] = [self.lr]
        self.scheduler.step()
        return metrics

    def train_mini_batch(
        self,
        mini_batch: DataProto,
        micro_batch_size: int | MicroBatching,
        loss_fn: LossFn,
        loss_agg_mode: str = "token-mean",
        extra_terms: Sequence[tuple[DataProto, LossFn, float]] = (),
    ) -> dict[str, float]:
        """One optimiser step over ``mini_batch`` (this rank's shard), accumulating micro-batches.

        ``micro_batch_size``: rows per micro-batch, or a ``MicroBatching`` (a token budget). ``loss_fn(micro)``
        returns the micro-batch loss aggregated with ``loss_agg_mode`` and its metrics; the engine reweights
        it by the micro-batch's share of the global mini-batch, so how the batch is cut does not matter. ``extra_terms``
        adds ``coef * loss`` over other data to the same step (supervised data mixed into RL)."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, list[float]] = {}
        for data, fn, coef in [(mini_batch, loss_fn, 1.0), *extra_terms]:
            self._accumulate(data, micro_batch_size, fn, loss_agg_mode, coef, metrics)
        grad_norm = self._reduce_and_clip()
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise DivergedError(
                f"{self.name}: the gradient norm is {grad_norm} at training step "
                f"{self.steps_done + 1} (lr {self.lr:g}); no update was applied. Lower {self.name} "
                "optim.lr or check the inputs for NaN."
            )
        self._step()
        self.optimizer.zero_grad(set_to_none=True)  # spent: not held through the next generation and passes
        self._check_finite_weights()
        out = {key: sum(values) / len(values) for key, values in metrics.items()}
        out[f"{self.name}/grad_norm"] = grad_norm
        return out

    def _check_finite_weights(self) -> None:
        """Stop at the update that broke the weights, not in the next step's sampling ("probability tensor
        contains inf/nan"): the weights' norm is NaN or inf when one weight is (or when their squares
        overflow, ~1e19: broken too). The 2-norm, not the largest weight: an FSDP2 shard may be empty (the
        critic's one-row value head on 2 ranks), and the inf-norm of an empty tensor is an error."""
        params = [p.detach() for p in self.module.parameters() if p.requires_grad]
        norm = _full_float(torch.nn.utils.get_total_norm(params))
        if not math.isfinite(norm):
            raise DivergedError(
                f"{self.name}: the weights' norm is {norm} after the update of training step "
                f"{self.steps_done + 1} with lr {self.lr:g}; lower {self.name} optim.lr"
            )

    @property
    def steps_done(self) -> int:
        """Training steps (``update`` calls) completed, resumes included."""
        return self.scheduler.last_epoch

    def _accumulate(
        self,
        data: DataProto,
        micro_batch_size: int | MicroBatching,
        loss_fn: LossFn,
        loss_agg_mode: str,
        coef: float,
        metrics: dict[str, list[float]],
    ) -> None:
        """Backward every micro-batch's loss, weighted by its share of the global batch."""

        def weight(d: DataProto) -> float:  # what the loss averages over: tokens, or responses with a token
            mask = d.tensors["response_mask"]
            return float(mask.sum() if loss_agg_mode == "token-mean" else (mask.sum(dim=-1) > 0).sum())

        total_weight = self._global_sum(weight(data)) / self.sequence_parallel
        batching = as_micro_batching(micro_batch_size)
        for micro, real in batching.split(data, agreed_count(batching, data, self.module)):
            loss, micro_metrics = loss_fn(micro)
            if not torch.isfinite(loss):
                details = ", ".join(f"{k}={v:.4g}" for k, v in micro_metrics.items())
                raise DivergedError(
                    f"{self.name}: the loss is {loss.item()} ({details}) at training step "
                    f"{self.steps_done + 1} (lr {self.lr:g}); no update was applied. Lower "
                    f"{self.name} optim.lr or check the rewards for NaN."
                )
            # FSDP2 averages gradients over ranks where the weights above need their sum; a filler micro-batch
            # only keeps this rank's collectives in step with the others' and adds nothing
            scale = coef * weight(micro) / max(total_weight, 1e-8) * (self.world_size if self.sharded else 1)
            (loss * (scale if real else 0.0)).backward()
            for key, value in micro_metrics.items():
                if real:
                    metrics.setdefault(key, []).append(value)

    def _reduce_and_clip(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.world_size > 1 and not self.sharded:
            grads = [p.grad for p in params if p.grad is not None]  # the same ones, typed without None
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        return _full_float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _step(self) -> None:
        if self._offload:
            self._move_optimizer_state(next(self.module.parameters()).device)
        self.optimizer.step()
        if self._offload:
            self._move_optimizer_state(torch.device("cpu"))

    def _move_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    def state_dict(self, with_optimizer: bool = True) -> dict[str, Any]:
        """Schedule state, plus the optimiser's unless ``with_optimizer`` is false (a sharded checkpoint
        saves the optimiser per rank through torch.distributed.checkpoint instead)."""
        state = {"scheduler": self.scheduler.state_dict(), "lr_scale": self.lr_scale}
        return {"optimizer": self.optimizer.state_dict(), **state} if with_optimizer else state

    def optimizer_settings(self) -> list[dict[str, Any]]:
        """The configured base lr, betas and weight decay of each parameter group."""
        return [{k: group[k] for k in _OPTIM_SETTINGS} for group in self.optimizer.param_groups]

    def load_state_dict(self, state: dict[str, Any], configured: list[dict[str, Any]] | None = None) -> None:
        """Restore the optimiser moments (unless ``state`` has none: a sharded checkpoint restores them
        through torch.distributed.checkpoint first), the schedule position and ``lr_scale``. Settings in the
        config (``configured``, default: the optimiser's now; base lr, betas, weight decay; the warmup and
        decay shape are never saved) win over the checkpoint's: a changed value is applied from the next step
        on, the schedule continuing from the new base lr, and logged."""
        configured = configured or self.optimizer_settings()
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scale = state["lr_scale"]
        self.scheduler.load_state_dict(state["scheduler"])
        for group, wanted in zip(self.optimizer.param_groups, configured):
            for key, value in wanted.items():
                if _as_list(group[key]) != _as_list(value):
                    logger.warning(
                        "%s: resuming with %s %s instead of the checkpoint's %s: applied from this step on",
                        self.name,
                        "lr" if key == "initial_lr" else key,
                        value,
                        group[key],
                    )
                    group[key] = value
        self.scheduler.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(self.scheduler.last_epoch)
