"""KL divergence between the policy and the reference model: per-token estimators and the coefficient.

Token tensors are ``(bs, response_length)`` log-probabilities of the sampled tokens. The estimators follow
Schulman's "Approximating KL divergence" note: k1 is unbiased but noisy and can be negative, k2 is a
low-bias square, k3 is unbiased and always >= 0 (lowest variance in practice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from hybridflow.algorithms.registry import Registry
from hybridflow.algorithms.utils import masked_mean

if TYPE_CHECKING:
    from hybridflow.protocol import DataProto

_KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("kl penalty")


@_KL_ESTIMATORS.register("k1")
@_KL_ESTIMATORS.register("kl")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@_KL_ESTIMATORS.register("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


@_KL_ESTIMATORS.register("k2")
@_KL_ESTIMATORS.register("mse")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@_KL_ESTIMATORS.register("k3")
@_KL_ESTIMATORS.register("low_var_kl")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # With x = log(pi_ref / pi): exp(x) - x - 1 >= 0. The clamps keep exp finite and bound the penalty of
    # a token the reference model finds very unlikely.
    ref_over_policy = (-log_ratio).clamp(-20.0, 20.0)
    return (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10.0, 10.0)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference: ``(bs, T), (bs, T) -> (bs, T)``.

    ``kl_penalty`` is one of "k1"/"kl" (``logprob - ref_logprob``), "abs", "k2"/"mse"
    (``0.5 * (logprob - ref_logprob)^2``), "k3"/"low_var_kl" (``exp(ref - logprob) - (ref - logprob) - 1``,
    clamped to [-10, 10]); anything else is a ValueError listing them (verl's "full", which needs the whole
    vocabulary's log-probabilities, is not provided: verl does not implement it either).
    """
    return _KL_ESTIMATORS.get(kl_penalty)(logprob - ref_logprob)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """``kl_penalty_forward``, plus verl's straight-through variants: a name ending in "+" ("k1+", "k3+", ...)
    has the value of its estimator and the gradient of k2, ``0.5 * (logprob - ref_logprob)^2``, whose
    expected gradient is the true KL's (k1's and k3's are not, though their values are unbiased)."""
    base = kl_penalty.removesuffix("+")
    forward = kl_penalty_forward(logprob, ref_logprob, base)
    if base == kl_penalty or base in ("k2", "mse"):
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """Token rewards with a k1 KL penalty: ``scores - kl_ratio * (old_log_prob - ref_log_prob)``, ``(bs, T)``."""
    return token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)


class KLController(Protocol):
    """The KL coefficient ``value`` (beta) and how it reacts to the KL measured on a batch."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt: the coefficient stays fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences").

    Steers the measured KL towards ``target_kl``: ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``
    after ``n`` samples; the clip limits how fast beta moves on a noisy estimate.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}"
            )
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class KLControlSettings(Protocol):
    """What verl's ``get_kl_controller`` reads from ``algorithm.kl_ctrl``."""

    type: str
    kl_coef: float
    target_kl: float
    horizon: float


def get_kl_controller(
    kl_ctrl_type: str | KLControlSettings,
    kl_coef: float | None = None,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> KLController:
    """Build the controller named ``kl_ctrl_type``: "fixed" or "adaptive" (which needs target_kl, horizon).
    verl's call, ``get_kl_controller(config.algorithm.kl_ctrl)``, passes the section itself: its ``type``,
    ``kl_coef``, ``target_kl`` and ``horizon`` are read from it."""
    if not isinstance(kl_ctrl_type, str):
        section = kl_ctrl_type
        kl_ctrl_type, kl_coef = section.type, section.kl_coef
        target_kl, horizon = section.target_kl, section.horizon
    if kl_coef is None:
        raise ValueError(f"{kl_ctrl_type} KL controller needs kl_coef")
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"adaptive KL controller needs target_kl and horizon, got {target_kl}, {horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl_type {kl_ctrl_type!r}; known: ['adaptive', 'fixed']")


def apply_kl_penalty(
    data: DataProto, kl_ctrl: KLController, kl_penalty: str = "kl"
) -> tuple[DataProto, dict[str, float]]:
    """Put the KL penalty into the reward: ``token_level_rewards = token_level_scores - beta * kl``.

    Reads ``token_level_scores``, ``old_log_probs``, ``ref_log_prob`` and ``response_mask`` (all
    ``(bs, T)``) from ``data.batch``, writes ``token_level_rewards`` ``(bs, T)``, then updates ``kl_ctrl``
    with the batch mean of the per-sequence mean KL. Returns ``data`` and the metrics
    ``actor/reward_kl_penalty`` (that mean KL) and ``actor/reward_kl_penalty_coeff`` (the beta used).
    """
    needed = ("token_level_scores", "old_log_probs", "ref_log_prob", "response_mask")
    present = set(data.batch.keys()) if data.batch is not None else set()
    missing = [key for key in needed if key not in present]
    if missing:
        raise KeyError(
            f"apply_kl_penalty({kl_penalty!r}) needs {missing} in data.batch; it has {sorted(present)}"
        )
    batch = data.tensors
    mask = batch["response_mask"].to(batch["token_level_scores"].dtype)
    kld = _KL_ESTIMATORS.get(kl_penalty)(batch["old_log_probs"] - batch["ref_log_prob"]) * mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * kld
    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
