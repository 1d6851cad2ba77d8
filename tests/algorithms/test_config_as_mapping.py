"""Estimators typed ``config: Mapping`` read it as one: a plain dict works as verl's config object does (they
read ``config.gamma``, an AttributeError on a dict, before the type checker pointed at it)."""

import numpy as np
import torch

from hybridflow.algorithms import (
    compute_grpo_passk_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
)


def test_reinforce_plus_plus_reads_gamma_from_a_dict():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    # reward-to-go with gamma 0.5: 0.25, 0.5, 1 on the first row
    assert torch.allclose(returns[0], torch.tensor([0.25, 0.5, 1.0]))
    _, by_keyword = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert torch.equal(returns, by_keyword)


def test_passk_reads_its_switch_from_a_dict():
    rewards = torch.tensor([[1.0], [0.0], [0.5], [0.0]])
    mask = torch.ones(4, 1)
    index = np.array(["a", "a", "b", "b"], dtype=object)
    plain, _ = compute_grpo_passk_outcome_advantage(
        rewards, mask, index, config={"norm_adv_by_std_in_grpo": False}
    )
    # the best of each group gets its margin over the second best, unscaled: 1 - 0 and 0.5 - 0
    assert torch.allclose(plain.flatten(), torch.tensor([1.0, 0.0, 0.5, 0.0]))
