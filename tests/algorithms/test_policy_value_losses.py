"""Loss aggregation, PPO/GSPO policy losses, value and SFT losses against hand-worked numbers."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    ConfigView,
    agg_loss,
    compute_policy_loss,
    compute_sft_loss,
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
    truncated_importance_weights,
)

# Five response tokens (row 1 has one padding token) with known ratios pi / pi_old and advantages:
#   token  A    ratio  -A*r   -A*clip(r, 0.8, 1.2)  max    dual clip (A < 0: min with -A * 3)
#   0     +1    1.5    -1.5   -1.2                 -1.2   (ratio clip active)
#   1     +1    0.5    -0.5   -0.8                 -0.5
#   2     -1    0.5     0.5    0.8                  0.8   (ratio clip active), min(0.8, 3) = 0.8
#   3     -1    5.0     5.0    1.2                  5.0   -> capped at 3 (dual clip active)
#   4     +2    1.1    -2.2   -2.2                 -2.2
RATIOS = torch.tensor([[1.5, 0.5, 0.5], [5.0, 1.1, 1.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 100.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
TOKEN_LOSSES = torch.tensor([[-1.2, -0.5, 0.8], [3.0, -2.2, 0.0]])


def ppo_call(loss_agg_mode="token-mean", **overrides):
    """The keyword form, ``compute_policy_loss``."""
    old = torch.zeros(2, 3)
    log_prob = RATIOS.log().requires_grad_(True)
    kwargs = dict(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=ADVANTAGES,
        response_mask=MASK,
        loss_agg_mode=loss_agg_mode,
        cliprange=0.2,
        cliprange_low=None,
        cliprange_high=None,
        clip_ratio_c=3.0,
    )
    kwargs.update(overrides)
    return compute_policy_loss(**kwargs), log_prob


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", -0.02),  # (-1.2 - 0.5 + 0.8 + 3 - 2.2) / 5 = -0.1 / 5
        ("seq-mean-token-sum", -0.05),  # rows -0.9 and 0.8 -> mean -0.05
        ("seq-mean-token-mean", 0.05),  # rows -0.9 / 3 = -0.3 and 0.8 / 2 = 0.4 -> mean 0.05
        ("seq-mean-token-sum-norm", -0.1 / 6),  # rows -0.9 / 3 and 0.8 / 3 (horizon T = 3) -> mean
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(TOKEN_LOSSES, MASK, mode).item() == pytest.approx(expected, abs=1e-6)


def test_agg_loss_seq_modes_skip_empty_rows_and_reject_unknown_modes():
    losses = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    # only row 0 counts: token mean (2 + 4) / 2 = 3
    assert agg_loss(losses, mask, "seq-mean-token-mean").item() == 3.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-sum'"):
        agg_loss(losses, mask, "token-sum")


def test_vanilla_ppo_loss_hand_values():
    (pg_loss, clipfrac, ppo_kl, clipfrac_lower), _ = ppo_call()
    assert pg_loss.item() == pytest.approx(-0.02, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 5)  # tokens 0 and 2
    assert clipfrac_lower.item() == pytest.approx(1 / 5)  # token 3
    # ppo_kl = mean(old - new) = -mean(ln r) = -ln(1.5 * 0.5 * 0.5 * 5 * 1.1) / 5 = -ln(2.0625) / 5
    assert ppo_kl.item() == pytest.approx(-math.log(2.0625) / 5, abs=1e-6)


def test_registered_vanilla_is_the_same_loss_in_verls_form():
    log_prob = RATIOS.log()
    config = ConfigView(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0)
    pg_loss, metrics = get_policy_loss_fn("vanilla")(
        old_log_prob=torch.zeros(2, 3),
        log_prob=log_prob,
        advantages=ADVANTAGES,
        response_mask=MASK,
        loss_agg_mode="token-mean",
        config=config,
    )
    assert pg_loss.item() == pytest.approx(-0.02, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(2.0625) / 5, abs=1e-6)
    # rollout_is_weights scale each token's loss: doubling token 4 (-2.2) adds -2.2 to the sum
    weights = torch.ones(2, 3)
    weights[1, 1] = 2.0
    weighted, _ = get_policy_loss_fn("vanilla")(
        torch.zeros(2, 3), log_prob, ADVANTAGES, MASK, "token-mean", config, rollout_is_weights=weights
    )
    assert weighted.item() == pytest.approx((-0.1 - 2.2) / 5, abs=1e-6)


def test_clip_higher_uses_its_own_upper_bound():
    # token 0 is now clipped at 1.28: -1.28 instead of -1.2 -> sum -0.18 over 5 tokens
    (pg_loss, *_), _ = ppo_call(cliprange_high=0.28)
    assert pg_loss.item() == pytest.approx(-0.18 / 5, abs=1e-6)


def test_clip_gives_zero_gradient_outside_the_range_for_positive_advantage():
    (pg_loss, *_), log_prob = ppo_call()
    (grad,) = torch.autograd.grad(pg_loss, log_prob)
    # d(-A r)/d(log r) = -A r, divided by the 5 tokens of the token mean
    assert grad[0, 0].item() == 0.0  # A > 0, r = 1.5 > 1.2: clipped, no push further up
    assert grad[0, 1].item() == pytest.approx(-1 * 0.5 / 5)  # A > 0, r = 0.5: pessimistic bound is unclipped
    assert grad[0, 2].item() == 0.0  # A < 0, r = 0.5 < 0.8: clipped
    assert grad[1, 0].item() == 0.0  # dual clip: constant cap
    assert grad[1, 1].item() == pytest.approx(-2 * 1.1 / 5)
    assert grad[1, 2].item() == 0.0  # padding


def test_dual_clip_caps_the_loss_of_a_huge_ratio():
    log_prob = torch.tensor([[12.0]])  # ratio e^12, negative advantage
    args = dict(old_log_prob=torch.zeros(1, 1), log_prob=log_prob, response_mask=torch.ones(1, 1))
    loss, _, _, lower = compute_policy_loss(advantages=torch.tensor([[-2.0]]), clip_ratio_c=3.0, **args)
    assert loss.item() == pytest.approx(6.0)  # -A * c = 2 * 3, not 2 * e^12
    assert lower.item() == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(advantages=torch.tensor([[-2.0]]), clip_ratio_c=1.0, **args)


def test_extreme_log_ratio_stays_finite():
    args = dict(old_log_prob=torch.zeros(1, 2), advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2))
    loss, *_ = compute_policy_loss(log_prob=torch.tensor([[200.0, -200.0]]), **args)
    # ratios clamp to e^20 and e^-20; A > 0: clipped to 1.2 and unclipped e^-20 -> mean of -1.2 and ~0
    assert loss.item() == pytest.approx(-0.6, abs=1e-6)


def gspo(log_prob, mask, clip, **kwargs):
    return get_policy_loss_fn("gspo")(
        old_log_prob=torch.zeros_like(log_prob),
        log_prob=log_prob,
        advantages=torch.ones_like(log_prob),
        response_mask=mask,
        config=ConfigView(clip_ratio=clip, clip_ratio_low=None, clip_ratio_high=None),
        **kwargs,
    )


def test_gspo_sequence_ratio_hand_values():
    # row 0 log-ratios [0.2, 0.0] -> s = e^0.1 = 1.1051709; row 1 [-0.1, pad] -> s = e^-0.1 = 0.9048374
    log_prob = torch.tensor([[0.2, 0.0], [-0.1, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    # loss_agg_mode is ignored as in verl: GSPO always takes the sequence-level mean
    pg_loss, metrics = gspo(log_prob, mask, clip=0.05, loss_agg_mode="token-mean")
    # A = 1, clip range [0.95, 1.05]: row 0 -> max(-1.1051709, -1.05) = -1.05 (clipped, both tokens);
    # row 1 -> max(-0.9048374, -0.95) = -0.9048374. Sequence mean: (-1.05 - 0.9048374) / 2
    assert pg_loss.item() == pytest.approx((-1.05 - 0.9048374) / 2, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.2 + 0.0 - 0.1) / 3, abs=1e-6)
    (grad,) = torch.autograd.grad(pg_loss, log_prob)
    # token gradient is -A * s_i (the sequence ratio) times the 1/2 of the sequence mean; row 0 clipped
    expected = torch.tensor([[0.0, 0.0], [-0.9048374 / 2, 0.0]])
    torch.testing.assert_close(grad, expected)


def test_gspo_token_gradient_uses_the_sequence_ratio():
    # unclipped: s = exp((0.3 + 0.1) / 2) = e^0.2; every token's gradient is -A * s / 2 (token mean of 2)
    log_prob = torch.tensor([[0.3, 0.1]], requires_grad=True)
    pg_loss, _ = gspo(log_prob, torch.ones(1, 2), clip=0.5)
    assert pg_loss.item() == pytest.approx(-math.exp(0.2))
    (grad,) = torch.autograd.grad(pg_loss, log_prob)
    assert grad.tolist()[0] == pytest.approx([-math.exp(0.2) / 2] * 2)


def test_policy_loss_registry():
    with pytest.raises(
        ValueError,
        match=r"unknown policy loss 'ppo'; known: \['cispo', 'clip_cov', 'geo_mean', 'gpg', 'gspo', 'kl_cov', 'vanilla'.*\]",
    ):
        get_policy_loss_fn("ppo")

    @register_policy_loss("test_plain_pg")
    def plain_pg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", **_clip_args):
        """REINFORCE-style -A * log pi in the keyword form: registered wrapped into verl's form."""
        loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
        zero = torch.zeros(())
        return loss, zero, zero, zero

    config = ConfigView(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0)
    loss, metrics = get_policy_loss_fn("test_plain_pg")(
        torch.zeros(2, 3), RATIOS.log(), ADVANTAGES, MASK, config=config
    )
    # -A * ln r over the 5 tokens: -(ln 1.5 + ln 0.5) + (ln 0.5) + (ln 5) - 2 ln 1.1 = ln(5 / (1.5 * 1.21))
    assert loss.item() == pytest.approx(math.log(5 / (1.5 * 1.21)) / 5, abs=1e-6)
    assert metrics == {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
    register_policy_loss("test_plain_pg")(plain_pg)  # re-registering the same function is harmless


def test_value_loss_hand_values():
    # cliprange_value 0.5:
    #   V_new  V_old  R   clip(V_new, V_old +- 0.5)  (V_new - R)^2  (clipped - R)^2  max
    #   2.0    1.0    2   1.5                        0              0.25             0.25 (clip active)
    #   1.2    1.0    0   1.2                        1.44           1.44             1.44
    #   0.0    1.0    3   0.5                        9              6.25             9
    vpreds = torch.tensor([[2.0, 1.2, 0.0, 8.0]])
    values = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.5 * (0.25 + 1.44 + 9) / 3)  # 1.7816667
    assert clipfrac.item() == pytest.approx(1 / 3)


def test_sft_loss_is_masked_negative_log_likelihood():
    log_prob = torch.tensor([[-1.0, -2.0], [-3.0, -50.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert compute_sft_loss(log_prob, mask).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert compute_sft_loss(log_prob, mask, "seq-mean-token-mean").item() == pytest.approx(
        2.25
    )  # (1.5 + 3) / 2


def test_truncated_importance_weights_hand_values():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))  # ratios 2, 0.5, 9 (the last off the mask)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, clipfrac = truncated_importance_weights(old, rollout, mask, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.5, 0.5, 1.0]]))  # capped, kept, 1 off the mask
    assert clipfrac.item() == pytest.approx(0.5)
    # weighting the advantages scales each token's clipped surrogate by the weight
    log_prob = old + torch.tensor([[0.1, -0.3, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    plain = compute_policy_loss(old, log_prob, adv * weights, mask, loss_agg_mode="seq-mean-token-sum")[0]
    ratio = (log_prob - old).exp()
    # token 0: A' = 1.5, r = e^0.1 inside the clip range; token 1: A' = -1, r = e^-0.3 clipped up to 0.8
    by_hand = -1.5 * ratio[0, 0] + 1.0 * 0.8
    assert plain.item() == pytest.approx(by_hand.item(), rel=1e-6)
