"""DAPO's group filter and overlong shaping, Clip-Cov and KL-Cov, sequence-level TIS and the distillation
reward, each against values worked out by hand from the papers' formulas."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    distillation_rewards,
    first_groups,
    get_policy_loss_fn,
    group_std,
    informative_groups,
    overlong_penalty,
    token_covariance,
    truncated,
    truncated_importance_weights,
)


def test_groups_whose_samples_all_scored_the_same_are_filtered():
    uids = ["a", "a", "b", "b", "c", "c", "d"]
    # a varies (1, 0); b all right; c all wrong; d is a single sample (kept, as in verl)
    rows, groups = informative_groups(uids, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 5.0]))
    assert rows.tolist() == [True, True, False, False, False, False, True]
    assert groups.tolist() == [True, False, False, True]
    # groups in order of first appearance, whatever order their rows come in
    rows, groups = informative_groups(["x", "y", "x", "y"], torch.tensor([0.5, 2.0, 0.5, 3.0]))
    assert rows.tolist() == [False, True, False, True] and groups.tolist() == [False, True]


def test_the_first_groups_are_kept_in_order_and_whole():
    assert first_groups(["p", "p", "q", "q", "r", "r"], 2).tolist() == [True] * 4 + [False] * 2
    assert first_groups(["q", "p", "q", "r", "p"], 2).tolist() == [True, True, True, False, True]


def test_reward_spread_within_groups():
    std = group_std(["a", "a", "b", "b", "b"], torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0]))
    assert std.tolist() == [0.5, 0.0]


def test_overlong_penalty_is_linear_over_the_buffer():
    # max 20 tokens, buffer 4: no penalty up to 16, then -1/4 per token, -1 at 20
    lengths = torch.tensor([10, 16, 17, 18, 20])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    with pytest.raises(ValueError, match="overlong buffer length"):
        overlong_penalty(lengths, 20, 0, 1.0)


def test_truncated_samples_are_those_cut_at_the_budget_without_eos():
    eos, pad = 2, 0
    responses = torch.tensor([[5, 6, 7], [5, 6, 2], [5, 2, pad], [pad, pad, pad]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # cut at 3 tokens; ended exactly at 3 with EOS; ended early; empty
    assert truncated(responses, mask, 3, [eos]).tolist() == [True, False, False, False]


def covariance_case():
    """One row of 4 tokens: log pi [0, -2, -4, -6] (mean -3), A [1, 0.5, 0, -1.5] (mean 0), so
    cov = (3 * 1, 1 * 0.5, -1 * 0, -3 * -1.5) = (3, 0.5, 0, 4.5): tokens 0 and 3 lie in (1, 5)."""
    log_prob = torch.tensor([[0.0, -2.0, -4.0, -6.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 0.5, 0.0, -1.5]])
    return log_prob, advantages, torch.ones(1, 4)


def test_token_covariance_is_the_centred_product():
    log_prob, advantages, mask = covariance_case()
    assert token_covariance(log_prob, advantages, mask).tolist() == [[3.0, 0.5, 0.0, 4.5]]


def covariance_loss(name, old, log_prob, advantages, mask, **policy_loss):
    """``(loss, pg_clipfrac, ppo_kl)`` of the registered loss ``name``, called as the actor calls it (verl's
    form), with PPO's default clip and ``policy_loss`` over the covariance keys' defaults."""
    options = {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-4}
    config = {
        "clip_ratio": 0.2,
        "clip_ratio_low": None,
        "clip_ratio_high": None,
        "clip_ratio_c": 3.0,
        "policy_loss": {**options, "ppo_kl_coef": 1.0, **policy_loss},
    }
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=None,
    )
    return loss, metrics["actor/pg_clipfrac"], metrics["actor/ppo_kl"]


def test_clip_cov_cuts_the_gradient_of_tokens_drawn_within_the_bounds():
    log_prob, advantages, mask = covariance_case()
    # ratio 1 everywhere: PPO clips nothing. clip_cov_ratio 0.5 of 4 tokens = 2: both candidates cut
    loss, clipfrac, ppo_kl = covariance_loss(
        "clip_cov", log_prob.detach(), log_prob, advantages, mask, clip_cov_ratio=0.5
    )
    loss.backward()
    # the loss of the others is -A * ratio: (-0.5 + 0) / 4
    assert loss.item() == pytest.approx(-0.125) and clipfrac == 0.5 and ppo_kl == 0.0
    assert log_prob.grad.tolist() == [[0.0, -0.125, 0.0, 0.0]]
    # one token of the two, drawn at random
    torch.manual_seed(0)
    loss, clipfrac, _ = covariance_loss(
        "clip_cov", log_prob.detach(), log_prob, advantages, mask, clip_cov_ratio=0.25
    )
    assert clipfrac == 0.25
    assert loss.item() in (pytest.approx((-0.5 + 1.5) / 4), pytest.approx((-1.0 - 0.5) / 4))


def test_clip_cov_leaves_tokens_ppo_already_clips_alone():
    log_prob, advantages, mask = covariance_case()
    old = log_prob.detach().clone()
    old[0, 0] -= 0.5  # token 0: ratio e^0.5 = 1.65 > 1.2 with A > 0, so PPO clips it
    loss, clipfrac, _ = covariance_loss("clip_cov", old, log_prob, advantages, mask, clip_cov_ratio=0.5)
    loss.backward()
    # only token 3 is cut; token 0 keeps PPO's clipped loss -1 * 1.2 (constant: no gradient)
    assert clipfrac == 0.25
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.0) / 4)
    assert log_prob.grad.tolist() == [[0.0, -0.125, 0.0, 0.0]]


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    log_prob, advantages, mask = covariance_case()
    log_ratio = torch.tensor([[0.1, -0.2, 0.3, -0.4]])
    old = log_prob.detach() - log_ratio
    # kl_cov_ratio 0.25 of 4 tokens = 1: token 3 (cov 4.5) gets + 2 * |log ratio|; no ratio clip anywhere
    loss, clipfrac, ppo_kl = covariance_loss(
        "kl_cov", old, log_prob, advantages, mask, kl_cov_ratio=0.25, ppo_kl_coef=2.0
    )
    by_hand = [-a * math.exp(r) for a, r in zip([1.0, 0.5, 0.0, -1.5], [0.1, -0.2, 0.3, -0.4])]
    by_hand[3] += 2.0 * 0.4
    assert loss.item() == pytest.approx(sum(by_hand) / 4)
    assert clipfrac == 0.25 and ppo_kl == pytest.approx(0.05)
    # 0.5 of them: tokens 3 and 0 (cov 3)
    loss, clipfrac, _ = covariance_loss(
        "kl_cov", old, log_prob, advantages, mask, kl_cov_ratio=0.5, ppo_kl_coef=2.0
    )
    by_hand[0] += 2.0 * 0.1
    assert loss.item() == pytest.approx(sum(by_hand) / 4) and clipfrac == 0.5


def test_the_covariance_losses_read_their_keys_from_the_actor_section():
    """The actor hands its section as ``config`` (verl's form): the schema's ``policy_loss`` keys feed them."""
    from hybridflow.algorithms import ConfigView
    from hybridflow.config import ActorConfig

    log_prob, advantages, mask = covariance_case()
    actor = ActorConfig()
    actor.policy_loss.kl_cov_ratio = 0.5
    _, metrics = get_policy_loss_fn("kl_cov")(
        log_prob.detach(), log_prob, advantages, mask, "token-mean", ConfigView(actor), None
    )
    assert metrics["actor/pg_clipfrac"] == 0.5


def test_sequence_level_tis_weights_a_sample_by_its_whole_ratio():
    old = torch.tensor([[0.1, 0.2, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    weights, clipfrac = truncated_importance_weights(old, rollout, mask, cap=1.2, level="sequence")
    # row 0: exp(0.1 + 0.2) = 1.35, capped at 1.2 (the padding keeps 1); row 1: exp(-0.5) = 0.61
    assert weights[0].tolist() == pytest.approx([1.2, 1.2, 1.0])
    assert weights[1].tolist() == pytest.approx([math.exp(-0.5)] * 3)
    assert clipfrac.item() == 0.5
    token, _ = truncated_importance_weights(old, rollout, mask, cap=1.2)
    assert token[0].tolist() == pytest.approx([math.exp(0.1), 1.2, 1.0])


def test_the_distillation_reward_is_the_negative_reverse_kl_mixed_with_the_task_reward():
    task = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    student = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, metrics = distillation_rewards(task, student, teacher, mask, kl_coef=2.0, task_reward_coef=0.5)
    # per token -2 * (log pi_s - log pi_t) on the mask, + 0.5 * task
    assert rewards.tolist() == [[-1.0, 2.0 + 0.5], [0.0, 0.0]]
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert metrics["distill/reverse_kl_seq"] == pytest.approx((-0.5 + 0.0) / 2)
