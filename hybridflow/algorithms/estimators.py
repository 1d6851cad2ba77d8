"""The advantage-estimator registry under verl's names: ``AdvantageEstimator``, ``ADV_ESTIMATOR_REGISTRY``,
``register_adv_est`` and ``get_adv_estimator_fn`` (the estimators themselves live in ``advantages`` and
``group_advantages``)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from hybridflow.algorithms.registry import Name, Registry, name_of

AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AdvantageEstimator(str, Enum):
    """verl's estimator names as an Enum (a member equals its string: ``AdvantageEstimator.GRPO == "grpo"``);
    ``register_adv_est`` and ``get_adv_estimator_fn`` take either. New estimators need no member: register
    them under a string."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"


# verl estimators with a member above but no implementation here, and why.
NOT_PROVIDED = {
    "optimal_token_baseline": "it needs the actor's per-token sum of squared probabilities (sum_pi_squared)",
    "tir_optimal_token_baseline": "it needs the actor's per-token sum of squared probabilities (sum_pi_squared)",
}

_ADV_ESTIMATORS: Registry[AdvEstimatorFn] = Registry("advantage estimator")

#: verl's name for the registry: a live dict, name -> estimator (what you put in is registered).
ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = _ADV_ESTIMATORS.entries


def register_adv_est(name_or_enum: Name) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under a name or ``AdvantageEstimator`` member (see
    ``advantages`` for how ``compute_advantage`` calls it). A different function under a taken name is a
    ValueError, as in verl; the same function again is fine."""
    return _ADV_ESTIMATORS.register(name_or_enum)


def get_adv_estimator_fn(name_or_enum: Name) -> AdvEstimatorFn:
    """The estimator registered under a name or ``AdvantageEstimator`` member; ValueError listing the known
    names otherwise (and saying why, for verl's estimators that hybridflow does not provide)."""
    name = name_of(name_or_enum)
    if name in NOT_PROVIDED and name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"advantage estimator {name!r} is verl's but not provided by hybridflow: {NOT_PROVIDED[name]}; "
            f"known: {_ADV_ESTIMATORS.names()}"
        )
    return _ADV_ESTIMATORS.get(name)
