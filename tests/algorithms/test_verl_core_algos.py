"""verl's core-algorithm surface (``verl.trainer.ppo.core_algos`` -> ``hybridflow.algorithms``) as its docs
and docstrings describe it, on our own cases: the registries under verl's names and rules, the estimators
verl adds (vectorized GRPO and RLOO, OPO, pass@k, GPG), verl's calling conventions (``config``), KL
straight-through, the policy losses and ``agg_loss``'s global normalisation. Values are worked by hand."""

import math
import statistics
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import pytest
import torch

from hybridflow import DataProto
from hybridflow.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    ConfigView,
    agg_loss,
    compute_advantage,
    compute_entropy_loss,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rewards,
    get_adv_estimator_fn,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)


def outcome(scores, uids, estimator, **kw):
    """Run a registered estimator on one-token responses with the given scores; the advantage per row."""
    rewards = torch.tensor(scores, dtype=torch.float32).unsqueeze(-1)
    advantages, returns = get_adv_estimator_fn(estimator)(
        token_level_rewards=rewards,
        response_mask=torch.ones_like(rewards),
        index=np.array(uids, dtype=object),
        **kw,
    )
    assert torch.equal(advantages, returns)
    return advantages.squeeze(-1).tolist()


@pytest.fixture
def scratch_names():
    """Names a test registers, removed afterwards so the registries stay as shipped."""
    added = []
    yield added
    for registry, name in added:
        registry.pop(name, None)


def test_estimator_registry_is_verls_dict_and_takes_enum_members(scratch_names):
    assert isinstance(ADV_ESTIMATOR_REGISTRY, dict) and "grpo_vectorized" in ADV_ESTIMATOR_REGISTRY
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is compute_grpo_outcome_advantage
    assert AdvantageEstimator.RLOO_VECTORIZED == "rloo_vectorized"  # a str Enum, as in verl

    class Mine(Enum):
        TWICE = "test_twice"

    @register_adv_est(Mine.TWICE)
    def twice(token_level_rewards, response_mask):
        return 2 * token_level_rewards, token_level_rewards

    scratch_names.append((ADV_ESTIMATOR_REGISTRY, "test_twice"))
    assert ADV_ESTIMATOR_REGISTRY["test_twice"] is twice and get_adv_estimator_fn("test_twice") is twice
    register_adv_est("test_twice")(twice)  # the same function again: fine
    with pytest.raises(ValueError, match="advantage estimator 'test_twice' is already registered to .*twice"):
        register_adv_est("test_twice")(lambda token_level_rewards, response_mask: None)
    ADV_ESTIMATOR_REGISTRY["test_direct"] = twice  # verl users write into the dict directly
    scratch_names.append((ADV_ESTIMATOR_REGISTRY, "test_direct"))
    assert get_adv_estimator_fn("test_direct") is twice
    with pytest.raises(ValueError, match="unknown advantage estimator 'GRPO'"):
        get_adv_estimator_fn("GRPO")  # names are case-sensitive
    with pytest.raises(ValueError, match="'optimal_token_baseline' is verl's but not provided by hybridflow"):
        get_adv_estimator_fn(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE)


def test_a_second_policy_loss_under_a_taken_name_replaces_it_with_a_warning(scratch_names):
    def first(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        return torch.tensor(1.0), {}

    def second(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        return torch.tensor(2.0), {}

    register_policy_loss("test_swap")(first)
    scratch_names.append((POLICY_LOSS_REGISTRY, "test_swap"))
    with pytest.warns(
        UserWarning, match="policy loss 'test_swap' is already registered to .*first; .*second"
    ):
        register_policy_loss("test_swap")(second)
    assert POLICY_LOSS_REGISTRY["test_swap"] is second  # verl replaces (silently); so do we, out loud


def test_grpo_vectorized_floors_the_group_variance_where_grpo_does_not():
    # group a: scores 1 and 1.0002 -> mean 1.0001, unbiased var 2e-8, std 1.414e-4
    a = [1.0, 1.0002]
    std = statistics.stdev(a)
    plain = outcome(a, ["a", "a"], "grpo")
    assert plain == pytest.approx([-1e-4 / (std + 1e-6), 1e-4 / (std + 1e-6)], rel=1e-3)  # about +-0.70
    # vectorized: var floored at epsilon = 1e-6, std 1e-3 -> +-1e-4 / 1.001e-3, about +-0.1
    floored = outcome(a, ["a", "a"], "grpo_vectorized")
    assert floored == pytest.approx([-1e-4 / 1.001e-3, 1e-4 / 1.001e-3], rel=1e-3)
    # a spread group is the same in both: scores 0, 1, 2 have mean 1 and std 1; a lone response keeps its score
    for name in ("grpo", "grpo_vectorized"):
        got = outcome([0.0, 1.0, 2.0, 5.0], ["g", "g", "g", "alone"], name)
        assert got == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 5 / (1 + 1e-6)], abs=1e-6)


def test_rloo_and_rloo_vectorized_differ_only_for_a_lone_response():
    # group a: 1, 3, 5 -> each minus the mean of the other two: 1 - 4, 3 - 3, 5 - 2
    assert outcome([1.0, 3.0, 5.0, 4.0], ["a", "a", "a", "b"], "rloo") == [-3.0, 0.0, 3.0, 4.0]
    assert outcome([1.0, 3.0, 5.0, 4.0], ["a", "a", "a", "b"], "rloo_vectorized") == [-3.0, 0.0, 3.0, 0.0]


def test_opo_baseline_weights_scores_by_response_length():
    rewards = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])  # lengths 1 and 3
    advantages, _ = get_adv_estimator_fn("opo")(rewards, mask, np.array(["q", "q"], dtype=object))
    # baseline (1 * 2 + 3 * 0) / 4 = 0.5: advantages 1.5 and -0.5 on each response token
    assert advantages.tolist() == [[1.5, 0.0, 0.0], [-0.5, -0.5, -0.5]]


def test_grpo_passk_rewards_only_the_best_by_its_margin():
    scores, uids = [0.2, 0.9, 0.5, 1.0, 1.0], ["p", "p", "p", "q", "q"]
    margin = 0.9 - 0.5
    expected = [0.0, margin / (statistics.stdev(scores[:3]) + 1e-6), 0.0, 0.0, 0.0]  # q's tie: margin 0
    assert outcome(scores, uids, "grpo_passk") == pytest.approx(expected, abs=1e-6)
    no_std = ConfigView(norm_adv_by_std_in_grpo=False)  # verl reads the switch from config
    assert outcome(scores, uids, "grpo_passk", config=no_std) == pytest.approx([0, margin, 0, 0, 0], abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 responses per group; group 'r' has 1"):
        outcome([1.0], ["r"], "grpo_passk")


def test_gpg_scales_centred_scores_by_the_share_of_non_zero_ones():
    # 2 of 4 scores are non-zero: alpha = 4 / 2 = 2; both groups have mean 0.5
    assert outcome([1.0, 0.0, 0.0, 1.0], ["g", "g", "h", "h"], "gpg") == [1.0, -1.0, -1.0, 1.0]


@dataclass
class KLCtrl:
    type: str = "adaptive"
    kl_coef: float = 0.2
    target_kl: float = 1.0
    horizon: int = 100


@dataclass
class Algo:
    """Stands in for the algorithm section compute_advantage is handed (ours, or verl's AlgoConfig)."""

    gamma: float = 0.5
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = False
    kl_ctrl: KLCtrl = field(default_factory=KLCtrl)


def test_compute_advantage_hands_verl_style_estimators_their_config(scratch_names):
    seen = {}

    @register_adv_est("test_reads_config")
    def reads_config(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        seen.update(gamma=config.gamma, norm=config.get("norm_adv_by_std_in_grpo"), ctrl=config.kl_ctrl.type)
        seen["index"] = list(index)
        return token_level_rewards, token_level_rewards

    scratch_names.append((ADV_ESTIMATOR_REGISTRY, "test_reads_config"))
    data = DataProto.from_dict(
        {"token_level_rewards": torch.ones(2, 2), "response_mask": torch.ones(2, 2)}, {"uid": ["a", "b"]}
    )
    compute_advantage(data, "test_reads_config", config=Algo())
    assert seen == {"gamma": 0.5, "norm": False, "ctrl": "adaptive", "index": ["a", "b"]}


def test_compute_advantage_takes_verls_positional_order_and_derives_the_response_mask():
    # verl: (data, adv_estimator, gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config)
    data = DataProto.from_dict(
        {
            "token_level_rewards": torch.tensor([[1.0, 0.0], [3.0, 0.0]]),
            "responses": torch.zeros(2, 2, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),  # prompt 2 + response 2
        },
        {"uid": ["a", "a"]},
    )
    compute_advantage(data, AdvantageEstimator.GRPO, 1.0, 1.0, 1, False)
    assert data.batch["response_mask"].tolist() == [[1, 0], [1, 1]]
    assert data.batch["advantages"].tolist() == [[-1.0, 0.0], [1.0, 1.0]]  # Dr.GRPO: scores minus mean 2


def test_reinforce_plus_plus_reads_gamma_from_config_as_verl_does():
    rewards, mask = torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2)
    _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=ConfigView(gamma=0.5))
    assert returns.tolist() == [[0.5, 1.0], [0.0, 0.0]]  # G_0 = 0 + 0.5 * 1
    with pytest.raises(ValueError, match="needs a discount"):
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


def test_kl_straight_through_keeps_the_value_and_takes_k2s_gradient():
    logprob = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    for name in ("k1", "k3", "low_var_kl"):
        plus = kl_penalty(logprob, ref, f"{name}+")
        assert torch.allclose(plus, kl_penalty(logprob, ref, name))
        (grad,) = torch.autograd.grad(plus.sum(), logprob)
        assert grad.tolist() == [1.0, -1.0]  # d/dx 0.5 (x - ref)^2 = x - ref
    # token rewards with the k1 penalty: 1 - 0.1 * (-1 - -2) = 0.9 and 1 - 0.1 * (-2 - -1) = 1.1
    rewards = compute_rewards(torch.ones(2), logprob.detach(), ref, kl_ratio=0.1)
    assert rewards.tolist() == pytest.approx([0.9, 1.1])


def test_get_kl_controller_takes_verls_config_section():
    controller = get_kl_controller(KLCtrl())
    controller.update(current_kl=2.0, n_steps=50)  # error clipped to 0.2: 0.2 * (1 + 0.2 * 50 / 100)
    assert controller.value == pytest.approx(0.22)
    assert get_kl_controller(KLCtrl(type="fixed", kl_coef=0.3)).value == 0.3


def test_agg_loss_global_normalisation():
    losses, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 1], [1, 0]])
    # token-mean over the whole batch of 12 tokens on 2 ranks: (1 + 2 + 3) / 12 * 2
    assert agg_loss(losses, mask, "token-mean", dp_size=2, batch_num_tokens=12).item() == pytest.approx(1.0)
    # seq-mean-token-sum over 8 sequences on 2 ranks: (3 + 3) / 8 * 2
    assert agg_loss(losses, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=8).item() == 1.5
    # Dr.GRPO's constant: token sums 3 and 3 divided by 4, averaged over the 2 sequences
    assert agg_loss(losses, mask, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == 0.75


def test_more_of_verls_policy_losses_hand_values():
    config = ConfigView(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    log_prob = torch.tensor([[math.log(1.5), math.log(0.9)]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0]])
    # gpg: -A * log pi, token mean: -(ln 1.5 + ln 0.9) / 2
    loss, metrics = get_policy_loss_fn("gpg")(old, log_prob, advantages, mask, config=config)
    assert loss.item() == pytest.approx(-(math.log(1.5) + math.log(0.9)) / 2) and metrics == {}
    # cispo: -sg[clip(r, 0.8, 1.2)] * A * log pi: -(1.2 ln 1.5 + 0.9 ln 0.9) / 2; token 0's ratio is clipped
    loss, metrics = get_policy_loss_fn("cispo")(old, log_prob, advantages, mask, config=config)
    assert loss.item() == pytest.approx(-(1.2 * math.log(1.5) + 0.9 * math.log(0.9)) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.5
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad.tolist()[0] == pytest.approx([-1.2 / 2, -0.9 / 2])  # a clipped token still has a gradient
    # geo_mean: A > 0 clips each log-ratio above at 0.2: exp((0.2 + ln 0.9) / 2), times -A
    loss, _ = get_policy_loss_fn("geo_mean")(old, log_prob, advantages, mask, config=config)
    assert loss.item() == pytest.approx(-math.exp((0.2 + math.log(0.9)) / 2), rel=1e-6)


def test_entropy_loss_and_config_view():
    logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens: entropy ln 4 each
    assert compute_entropy_loss(logits, torch.ones(1, 2)).item() == pytest.approx(math.log(4))
    view = ConfigView(Algo(), extra=1)
    assert (
        view.kl_ctrl.horizon == 100
        and view["gamma"] == 0.5
        and view.get("missing", 7) == 7
        and view.extra == 1
    )
    with pytest.raises(AttributeError, match="config has no setting 'gama'"):
        _ = view.gama
    with pytest.raises(AttributeError, match="read-only"):
        view.gamma = 1.0


def test_every_policy_loss_reads_our_actor_section_under_verls_names():
    from hybridflow.config.schema import ActorConfig

    actor = ConfigView(ActorConfig(clip_ratio=0.2, clip_ratio_high=0.28), global_batch_info={})
    assert actor.policy_loss.loss_mode == "vanilla" and actor.clip_ratio_c == 3.0  # what verl's losses read
    args = (torch.zeros(1, 2), torch.tensor([[0.1, -0.1]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    for name in ("vanilla", "gspo", "gpg", "geo_mean", "cispo"):
        loss, metrics = get_policy_loss_fn(name)(*args, loss_agg_mode="token-mean", config=actor)
        assert (
            loss.dim() == 0 and math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
        )
    # ratios e^0.1 (A = 1) and e^-0.1 (A = -1) are inside [0.8, 1.28]: vanilla is -mean(A * r)
    vanilla, _ = get_policy_loss_fn("vanilla")(*args, loss_agg_mode="token-mean", config=actor)
    assert vanilla.item() == pytest.approx(-(math.exp(0.1) - math.exp(-0.1)) / 2)
