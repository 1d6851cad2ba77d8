"""KL estimators and controllers, and the two DataProto entry points: apply_kl_penalty, compute_advantage."""

import math

import numpy as np
import pytest
import torch

from hybridflow import DataProto
from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_advantage,
    compute_rloo_outcome_advantage,
    get_kl_controller,
    kl_penalty,
    register_adv_est,
)

LOGPROB = torch.tensor([[0.0, -1.0]])
REF = torch.tensor([[-1.0, 0.0]])  # logprob - ref = [1, -1]


@pytest.mark.parametrize(
    "names, expected",
    [
        (("k1", "kl"), [1.0, -1.0]),
        (("abs",), [1.0, 1.0]),
        (("k2", "mse"), [0.5, 0.5]),  # 0.5 * (+-1)^2
        # x = ref - logprob = [-1, 1]: e^-1 + 1 - 1 = 0.3678794; e^1 - 1 - 1 = 0.7182818
        (("k3", "low_var_kl"), [math.exp(-1), math.e - 2]),
    ],
)
def test_kl_estimators_hand_values(names, expected):
    for name in names:
        assert kl_penalty(LOGPROB, REF, name)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_is_non_negative_and_clamped():
    gen = torch.Generator().manual_seed(0)
    logprob, ref = torch.randn(64, 16, generator=gen) * 3, torch.randn(64, 16, generator=gen) * 3
    assert kl_penalty(logprob, ref, "k3").min().item() >= 0
    # x = ref - logprob = 30 would give e^30 - 31: clamped to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0


def test_unknown_kl_penalty_lists_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown kl penalty 'full'; known: \['abs', 'k1', 'k2', 'k3', 'kl'"
    ):
        kl_penalty(LOGPROB, REF, "full")


def test_kl_controllers():
    fixed = get_kl_controller("fixed", kl_coef=0.05)
    fixed.update(current_kl=100.0, n_steps=10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05

    adaptive = get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    # error 9 / 6 - 1 = 0.5, clipped to 0.2: beta *= 1 + 0.2 * 1000 / 10000 = 1.02 -> 0.102
    adaptive.update(current_kl=9.0, n_steps=1000)
    assert adaptive.value == pytest.approx(0.102)
    # error 5.4 / 6 - 1 = -0.1: beta *= 1 - 0.1 * 0.1 = 0.99 -> 0.10098
    adaptive.update(current_kl=5.4, n_steps=1000)
    assert adaptive.value == pytest.approx(0.10098)

    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        get_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown kl_ctrl_type 'pid'"):
        get_kl_controller("pid", kl_coef=0.1)


def test_apply_kl_penalty_hand_values():
    data = DataProto.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 2.0, 0.0]]),
            "old_log_probs": torch.tensor([[-1.0, -1.0, -9.0], [-2.0, -1.0, -9.0]]),
            "ref_log_prob": torch.tensor([[-1.5, -0.5, 0.0], [-1.0, -1.0, 0.0]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 0]]),
        }
    )
    controller = AdaptiveKLController(init_kl_coef=0.5, target_kl=1.0, horizon=4)
    data, metrics = apply_kl_penalty(data, controller, kl_penalty="kl")
    # k1 = old - ref: row 0 [0.5, -0.5, pad], row 1 [-1, 0, pad]; rewards = scores - 0.5 * k1
    torch.testing.assert_close(
        data.batch["token_level_rewards"], torch.tensor([[-0.25, 1.25, 0.0], [0.5, 2.0, 0.0]])
    )
    # sequence means 0 and -0.5 -> batch KL -0.25; metrics report the beta that was used
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(-0.25), "actor/reward_kl_penalty_coeff": 0.5}
    # error -0.25 / 1 - 1 = -1.25, clipped to -0.2: beta *= 1 - 0.2 * 2 / 4 = 0.9 -> 0.45
    assert controller.value == pytest.approx(0.45)


def test_apply_kl_penalty_names_missing_keys():
    data = DataProto.from_dict(
        tensors={"token_level_scores": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)}
    )
    with pytest.raises(KeyError, match=r"needs \['old_log_probs', 'ref_log_prob'\]"):
        apply_kl_penalty(data, FixedKLController(0.1))


def outcome_batch(**extra_tensors) -> DataProto:
    # two prompts, two responses each; reward on the last response token; scores [1, 0] and [2, 2]
    return DataProto.from_dict(
        tensors={
            "token_level_rewards": torch.tensor(
                [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0], [2.0, 0.0, 0.0]]
            ),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]]),
            **extra_tensors,
        },
        non_tensors={"uid": ["p0", "p0", "p1", "p1"]},
    )


EXTRA_INPUTS = {
    "gae": {"values": torch.zeros(4, 3)},
    "remax": {"reward_baselines": torch.tensor([0.5, 0.5, 1.0, 1.0])},
}


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
)
def test_compute_advantage_writes_outputs_for_every_builtin(name):
    data = compute_advantage(outcome_batch(**EXTRA_INPUTS.get(name, {})), name, gamma=1.0, lam=1.0)
    mask = data.batch["response_mask"].bool()
    for key in ("advantages", "returns"):
        assert data.batch[key].shape == (4, 3)
        assert data.batch[key][~mask].abs().max().item() == 0.0
    # prompt p1's scores are equal (2, 2): group estimators treat its responses alike (GRPO and RLOO give
    # them nothing; REINFORCE++-baseline's batch whitening shifts them off 0); p0 (1 vs 0) is signed
    first = data.batch["advantages"][:, 0].tolist()
    if name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert first[2] == first[3]
    if name in ("grpo", "rloo"):
        assert first[2] == 0.0
    assert first[0] > first[1]


def test_compute_advantage_grpo_values_and_extra_config():
    # p0 scores [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-0.7071068 (epsilon 0.1 given)
    data = compute_advantage(outcome_batch(), "grpo", epsilon=0.1)
    expected = 0.5 / (math.sqrt(0.5) + 0.1)
    assert data.batch["advantages"][:2, 0].tolist() == pytest.approx([expected, -expected])
    dr = compute_advantage(outcome_batch(), "grpo", norm_adv_by_std_in_grpo=False)
    assert dr.batch["advantages"][:2, 0].tolist() == [0.5, -0.5]


def test_a_reward_per_sequence_is_placed_on_the_last_response_token():
    """A (bs,) reward where token-level rewards belong used to raise IndexError: too many indices."""
    per_sequence = outcome_batch()
    per_sequence.batch["token_level_rewards"] = torch.tensor([1.0, 0.0, 2.0, 2.0])
    placed = compute_advantage(per_sequence, "grpo")
    assert (
        placed.batch["token_level_rewards"].tolist() == outcome_batch().batch["token_level_rewards"].tolist()
    )
    assert torch.equal(
        placed.batch["advantages"], compute_advantage(outcome_batch(), "grpo").batch["advantages"]
    )
    wrong = outcome_batch()
    wrong.batch["token_level_rewards"] = torch.zeros(4, 2)
    with pytest.raises(
        ValueError,
        match=r"token_level_rewards has shape \(4, 2\); give one reward per sequence "
        r"\(4,\) or one per response token \(4, 3\)",
    ):
        compute_advantage(wrong, "grpo")


def test_user_registered_estimator_runs_through_compute_advantage():
    @register_adv_est("test_best_of_group")
    def best_of_group(token_level_rewards, response_mask, index, bonus=0.0):
        """+1 (+ bonus) on every token of a response whose score is its group's maximum, else 0."""
        scores = (token_level_rewards * response_mask).sum(-1)
        best = {uid: max(s for s, u in zip(scores.tolist(), index) if u == uid) for uid in set(index)}
        winner = torch.tensor([s == best[u] for s, u in zip(scores.tolist(), index)], dtype=torch.float32)
        advantages = (winner + bonus)[:, None] * response_mask
        return advantages, advantages

    data = compute_advantage(outcome_batch(), "test_best_of_group", bonus=0.5)
    # p0: score 1 wins over 0; p1: both 2 win
    torch.testing.assert_close(
        data.batch["advantages"],
        torch.tensor([[1.5, 1.5, 0.0], [0.5, 0.5, 0.5], [1.5, 1.5, 1.5], [1.5, 0.0, 0.0]]),
    )


def test_compute_advantage_errors_name_the_culprit():
    with pytest.raises(KeyError, match=r"advantage estimator 'gae' needs 'values'"):
        compute_advantage(outcome_batch(), "gae")
    no_uid = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(2, 2), "response_mask": torch.ones(2, 2)}
    )
    with pytest.raises(KeyError, match=r"advantage estimator 'grpo' needs 'uid' \(parameter 'index'\)"):
        compute_advantage(no_uid, "grpo")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; known: \[.*'rloo'"):
        compute_advantage(outcome_batch(), "ppo")


def test_group_index_accepts_any_hashable_ids():
    uids = np.empty(4, dtype=object)
    uids[:] = [("q", 1), ("q", 1), ("q", 2), ("q", 2)]  # tuple ids in a 1-D object column
    data = outcome_batch()
    data.non_tensor_batch["uid"] = uids
    grouped = compute_advantage(data, "rloo")
    # p0 [1, 0] -> 1 - 0 = 1 and 0 - 1 = -1; p1 [2, 2] -> 0
    assert grouped.batch["advantages"][:, 0].tolist() == [1.0, -1.0, 0.0, 0.0]
    # a plain list of ids works as well when calling an estimator directly
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    direct, _ = compute_rloo_outcome_advantage(rewards, mask, [("q", 1), ("q", 1), ("q", 2), ("q", 2)])
    torch.testing.assert_close(direct, grouped.batch["advantages"])
