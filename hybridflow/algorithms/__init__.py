"""Pure algorithm library: advantage estimators, policy/value/SFT losses (Clip-Cov and KL-Cov in
``covariance``), KL penalties, masked stats, DAPO's group filter and overlong shaping (``dapo``), on-policy
distillation's signal (``distillation``), and the offline objectives (SFT, DPO and its loss types, KTO) in
``preference``.

Everything here is a tensor function (plus the DataProto helpers ``compute_advantage``,
``compute_response_mask`` and ``apply_kl_penalty``); estimators and policy losses are looked up by name in
registries that users can extend with ``register_adv_est`` / ``register_policy_loss``. Names, signatures
and calling conventions are verl's: ``verl.trainer.ppo.core_algos`` -> ``hybridflow.algorithms`` (the
README's "Coming from verl" lists each name).

May import: ``utils``, ``protocol``, ``models``. Nothing here knows about configs, workers or trainers.
"""

from hybridflow.algorithms.advantages import (
    compute_advantage,
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_response_mask,
)
from hybridflow.algorithms.config_view import ConfigView
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
from hybridflow.algorithms.estimators import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridflow.algorithms.group_advantages import (
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from hybridflow.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from hybridflow.algorithms.losses import (
    POLICY_LOSS_REGISTRY,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_sft_loss,
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
    truncated_importance_weights,
)
from hybridflow.algorithms.off_policy import MASK_LEVELS, off_policy_mask
from hybridflow.algorithms.preference import (
    bradley_terry_loss,
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
    "ADV_ESTIMATOR_REGISTRY",
    "AdvantageEstimator",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_response_mask",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_sft_loss",
    "compute_value_loss",
    "ConfigView",
    "dpo_loss",
    "entropy_from_logits",
    "FixedKLController",
    "distillation_rewards",
    "first_groups",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_offline_objective",
    "get_policy_loss_fn",
    "get_preference_loss_fn",
    "bradley_terry_loss",
    "group_std",
    "informative_groups",
    "kl_penalty",
    "kl_penalty_forward",
    "KLController",
    "kto_kl_estimate",
    "kto_loss",
    "logprobs_from_logits",
    "MASK_LEVELS",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "off_policy_mask",
    "POLICY_LOSS_REGISTRY",
    "register_adv_est",
    "register_policy_loss",
    "register_preference_loss",
    "sequence_log_probs",
    "sequence_to_token_scores",
    "overlong_penalty",
    "reverse_kl",
    "token_covariance",
    "truncated",
    "truncated_importance_weights",
]
