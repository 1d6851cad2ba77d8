"""The actor's own subsections: which registered policy loss it minimises, how an MoE policy's expert routing
is replayed, and what its checkpoints hold beyond the model (``actor_rollout_ref.actor.policy_loss``,
``.router_replay``, ``.checkpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class PolicyLossConfig:
    """Which registered policy loss (``hybridflow.algorithms.get_policy_loss_fn``) the actor uses."""

    #: registered policy loss: vanilla | gspo | gpg | geo_mean | cispo | clip_cov | kl_cov (entropy
    #: control) | your own (register_policy_loss)
    loss_mode: str = "vanilla"
    #: clip_cov: share of response tokens whose gradient is cut (drawn among covariance in (lb, ub))
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0  #: clip_cov: lower bound of the covariance of the tokens it may cut
    clip_cov_ub: float = 5.0  #: clip_cov: upper bound of the covariance of the tokens it may cut
    kl_cov_ratio: float = 2e-4  #: kl_cov: share of response tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 1.0  #: kl_cov: weight of |log pi - log pi_old| on those tokens


@dataclass
class CheckpointContentsConfig:
    """What a checkpoint holds beyond the model, optimizer and trainer state it always holds."""

    #: with LoRA, skip the merged huggingface/ folder (a full model's size) and keep only lora_adapter/
    save_lora_only: bool = False


@dataclass
class RouterReplayConfig:
    """Mixture-of-experts routing replay (verl's ``router_replay``): the trainer's forwards use the experts each
    token was routed to before, instead of choosing again, so a near-tie that flips between the rollout and
    the trainer (another kernel, another batch) does not change the token's log-prob. Only the choice is
    replayed; the chosen experts' weights come from the live router, which still trains."""

    #: disabled | R2 (the old-log-prob pass records the trainer's routing, the updates replay it) | R3 (the
    #: rollout records each token's experts, the log-prob and update passes replay them; hf and vllm rollouts)
    mode: Literal["disabled", "R2", "R3"] = "disabled"
