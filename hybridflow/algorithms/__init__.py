"""Pure algorithm library: advantage estimators, policy/value/SFT losses (Clip-Cov and KL-Cov in
``covariance``), KL penalties, masked stats, DAPO's group filter and overlong shaping (``dapo``), on-policy
distillation's signal (``distillation``), and the offline objectives (SFT, DPO and its loss types, KTO) in
``preference``.

Everything here is a tensor function (plus two DataProto helpers, ``compute_advantage`` and
``apply_kl_penalty``); estimators and policy losses are looked up by name in registries that users can
extend with ``register_adv_est`` / ``register_policy_loss``. Names and signatures follow verl's.

May import: ``utils``, ``protocol``, ``models``. Nothing here knows about configs, workers or trainers.
"""

from hybridflow.algorithms.advantages import (
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.covariance import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    token_covariance,
)
from hybridflow.algorithms.dapo import (
    first_groups,
    group_std,
    informative_groups,
    overlong_penalty,
    truncated,
)
from hybridflow.algorithms.distillation import distillation_rewards, reverse_kl
from hybridflow.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from hybridflow.algorithms.losses import (
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_sft_loss,
    compute_value_loss,
    get_policy_loss_fn,
    policy_loss_options,
    register_policy_loss,
    truncated_importance_weights,
)
from hybridflow.algorithms.off_policy import MASK_LEVELS, off_policy_mask
from hybridflow.algorithms.preference import (
    dpo_loss,
    get_offline_objective,
    get_preference_loss_fn,
    kto_kl_estimate,
    kto_loss,
    register_preference_loss,
    sequence_log_probs,
)
from hybridflow.algorithms.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    sequence_to_token_scores,
)

__all__ = [
    "AdaptiveKLController",
    "MASK_LEVELS",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_sft_loss",
    "compute_value_loss",
    "distillation_rewards",
    "dpo_loss",
    "entropy_from_logits",
    "first_groups",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_offline_objective",
    "get_policy_loss_fn",
    "get_preference_loss_fn",
    "group_std",
    "informative_groups",
    "kl_penalty",
    "kto_kl_estimate",
    "kto_loss",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "off_policy_mask",
    "overlong_penalty",
    "policy_loss_options",
    "sequence_log_probs",
    "sequence_to_token_scores",
    "register_adv_est",
    "register_policy_loss",
    "register_preference_loss",
    "reverse_kl",
    "token_covariance",
    "truncated",
    "truncated_importance_weights",
]
