"""Advantage estimators against hand-worked numbers, plus their group and padding properties."""

import inspect
import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
)


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-5)


def whiten(raw: list[float]) -> list[float]:
    """Reference whitening written out: (x - mean) / unbiased std."""
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / (len(raw) - 1))
    return [(x - mean) / std for x in raw]


# Outcome batch: groups a = rows 0-2, b = rows 3-4, c = row 5 (alone). The reward sits on the last
# response token; row 1 is one token long so its reward is at t = 0. The 9s are on padding: never counted.
OUTCOME_REWARDS = torch.tensor(
    [[0.0, 0.0, 1.0], [0.0, 9.0, 9.0], [0.0, 0.0, 2.0], [0.0, 3.0, 9.0], [0.0, 0.0, 5.0], [4.0, 9.0, 9.0]]
)
OUTCOME_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
OUTCOME_INDEX = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
# scores: a -> [1, 0, 2], b -> [3, 5], c -> [4]


def per_row(advantages: torch.Tensor) -> list[float]:
    """The per-sequence advantage: value on the first token (every row has one)."""
    return advantages[:, 0].tolist()


def test_gae_hand_values_and_masked_carry():
    # gamma = 0.5, lam = 0.5 -> gamma * lam = 0.25
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 9.0, 2.0]])
    values = torch.tensor([[1.0, 2.0, 4.0], [3.0, 7.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])  # row 1: t = 1 is not a response token (e.g. tool output)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0: t2: delta = 1 + 0 - 4 = -3, A = -3
    #        t1: delta = 0 + 0.5 * 4 - 2 = 0, A = 0 + 0.25 * -3 = -0.75
    #        t0: delta = 0 + 0.5 * 2 - 1 = 0, A = 0.25 * -0.75 = -0.1875
    # row 1: t2: delta = 2 + 0 - 1 = 1, A = 1; t1 skipped (carries V = 1, A = 1 through)
    #        t0: delta = 0 + 0.5 * 1 - 3 = -2.5, A = -2.5 + 0.25 * 1 = -2.25
    # returns = A + V, 0 on the skipped token
    close(returns, [[0.8125, 1.25, 1.0], [0.75, 0.0, 2.0]])
    white = whiten([-0.1875, -0.75, -3.0, -2.25, 1.0])
    close(advantages, [white[:3], [white[3], 0.0, white[4]]])


GRPO_EPS = 1e-6


def test_grpo_hand_values():
    advantages, returns = compute_grpo_outcome_advantage(OUTCOME_REWARDS, OUTCOME_MASK, OUTCOME_INDEX)
    # a: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> [0, -1, 1] / (1 + eps)
    # b: mean 4, std sqrt((1 + 1) / 1) = sqrt 2 -> [-1, 1] / (sqrt 2 + eps)
    # c: alone -> mean 0, std 1 -> 4 / (1 + eps)
    b = 1 / (math.sqrt(2) + GRPO_EPS)
    expected = [0.0, -1 / (1 + GRPO_EPS), 1 / (1 + GRPO_EPS), -b, b, 4 / (1 + GRPO_EPS)]
    assert per_row(advantages) == pytest.approx(expected, abs=1e-6)
    # broadcast over response tokens, 0 on padding
    close(advantages * OUTCOME_MASK, advantages.tolist())
    assert advantages[3].tolist() == pytest.approx([-b, -b, 0.0], abs=1e-6)
    torch.testing.assert_close(returns, advantages)


def test_dr_grpo_differs_from_grpo_only_by_std():
    grpo, _ = compute_grpo_outcome_advantage(OUTCOME_REWARDS, OUTCOME_MASK, OUTCOME_INDEX)
    dr_grpo, _ = compute_grpo_outcome_advantage(
        OUTCOME_REWARDS, OUTCOME_MASK, OUTCOME_INDEX, norm_adv_by_std_in_grpo=False
    )
    # score - group mean: a -> [0, -1, 1], b -> [-1, 1], c -> [4]
    assert per_row(dr_grpo) == pytest.approx([0.0, -1.0, 1.0, -1.0, 1.0, 4.0])
    group_std = torch.tensor([1.0, 1.0, 1.0, math.sqrt(2), math.sqrt(2), 1.0])
    close(grpo * (group_std[:, None] + GRPO_EPS), dr_grpo.tolist())


def test_grpo_group_properties():
    advantages, _ = compute_grpo_outcome_advantage(OUTCOME_REWARDS, OUTCOME_MASK, OUTCOME_INDEX)
    scores = per_row(advantages)
    assert sum(scores[0:3]) == pytest.approx(0.0, abs=1e-6)
    assert sum(scores[3:5]) == pytest.approx(0.0, abs=1e-6)
    equal = torch.tensor([[0.0, 0.7], [0.0, 0.7], [0.0, 0.7]])
    zero, _ = compute_grpo_outcome_advantage(equal, torch.ones(3, 2), np.array([1, 1, 1], dtype=object))
    assert zero.abs().max().item() == 0.0


def test_rloo_hand_values():
    advantages, returns = compute_rloo_outcome_advantage(OUTCOME_REWARDS, OUTCOME_MASK, OUTCOME_INDEX)
    # a [1, 0, 2]: 1 - (0 + 2) / 2 = 0; 0 - (1 + 2) / 2 = -1.5; 2 - (1 + 0) / 2 = 1.5
    # b [3, 5]: 3 - 5 = -2; 5 - 3 = 2;  c alone keeps its score 4
    assert per_row(advantages) == pytest.approx([0.0, -1.5, 1.5, -2.0, 2.0, 4.0])
    assert advantages[3].tolist() == [-2.0, -2.0, 0.0]
    torch.testing.assert_close(returns, advantages)


def test_reinforce_plus_plus_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5;  row 1: G1 = 4, G0 = 0 + 0.5 * 4 = 2
    close(returns, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    # whitened over the 5 tokens: mean 2.1, unbiased var 5.2 / 4 = 1.3
    white = whiten([1.5, 1.0, 2.0, 2.0, 4.0])
    close(advantages, [white[:3], [white[3], white[4], 0.0]])
    assert white[0] == pytest.approx(-0.6 / math.sqrt(1.3))


def test_reinforce_plus_plus_baseline_hand_values():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    index = np.array(["a", "a", "b", "b"], dtype=object)
    advantages, returns = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    # scores a [1, 3] - mean 2 -> [-1, 1]; b [2, 2] -> [0, 0]; broadcast over 2, 1, 3, 2 tokens:
    # token values [-1, -1, 1, 0, 0, 0, 0, 0], whitened over those 8 tokens
    w = whiten([-1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    close(advantages, [[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], w[4], w[5]], [w[6], w[7], 0.0]])
    # mean -1/8, unbiased var (2 * 0.875^2 + 1.125^2 + 5 * 0.125^2) / 7 = 2.875 / 7
    assert w[2] == pytest.approx(1.125 / math.sqrt(2.875 / 7))
    torch.testing.assert_close(returns, advantages)


def test_remax_hand_values():
    rewards = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    baselines = torch.tensor([2.0, 0.5])
    advantages, returns = compute_remax_outcome_advantage(rewards, baselines, mask)
    # reward-to-go: row 0 [3, 3, 2], row 1 [1, 0, pad]; minus the greedy baselines 2 and 0.5
    close(returns, [[3.0, 3.0, 2.0], [1.0, 0.0, 0.0]])
    close(advantages, [[1.0, 1.0, 0.0], [0.5, -0.5, 0.0]])


# name -> keyword inputs; every estimator is called through the registry with only what it names
PADDED_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
CLEAN_REWARDS = torch.tensor(
    [[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.2, 0.0, 0.3, 0.0], [0, 0, 0, 2.0]]
)
CLEAN_VALUES = torch.tensor(
    [[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.0, 0.0], [0.6, 0.0, 0.7, 0.0], [0, 0.1, 0, 0.2]]
)
INPUTS = {
    "index": np.array([0, 0, 1, 1], dtype=object),
    "reward_baselines": torch.tensor([0.5, 0.1, 0.2, 1.0]),
    "gamma": 0.9,
    "lam": 0.95,
}


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_padding_never_gets_advantage_nor_leaks(name, mask_dtype):
    fn = get_adv_estimator_fn(name)
    params = inspect.signature(fn).parameters

    def run(rewards, values):
        inputs = {
            **INPUTS,
            "token_level_rewards": rewards,
            "values": values,
            "response_mask": PADDED_MASK.to(mask_dtype),
        }
        return fn(**{k: v for k, v in inputs.items() if k in params})

    garbage = (1 - PADDED_MASK) * 50.0
    clean_adv, clean_ret = run(CLEAN_REWARDS, CLEAN_VALUES)
    dirty_adv, dirty_ret = run(CLEAN_REWARDS + garbage, CLEAN_VALUES - garbage)
    padding = PADDED_MASK == 0
    assert dirty_adv[padding].abs().max().item() == 0.0
    assert dirty_ret[padding].abs().max().item() == 0.0
    torch.testing.assert_close(dirty_adv, clean_adv)
    torch.testing.assert_close(dirty_ret, clean_ret)
    assert clean_adv[~padding].abs().sum().item() > 0  # the estimator produced a real signal


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo2'; known: \[.*'gae'.*'grpo'.*\]"):
        get_adv_estimator_fn("ppo2")
