"""DPO (sigmoid, IPO, hinge, label smoothing) and KTO losses against hand-computed values."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    dpo_loss,
    get_preference_loss_fn,
    kto_kl_estimate,
    kto_loss,
    sequence_log_probs,
)

# One pair: policy log-probs chosen -1, rejected -3; reference -2 for both, so h = (-1 + 3) - 0 = 2.
PAIR = [torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])]


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_policy_equal_to_reference_gives_ln2():
    logps = torch.tensor([-5.0, -7.5, -1.25])
    losses, chosen, rejected = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.3)
    assert losses.tolist() == pytest.approx([math.log(2)] * 3)
    assert chosen.abs().sum() == 0 and rejected.abs().sum() == 0


def test_sigmoid_and_label_smoothing_by_hand():
    # beta h = 0.5 * 2 = 1: -log sigmoid(1) = softplus(-1); the smoothed term -log sigmoid(-1) = softplus(1).
    losses, chosen, rejected = dpo_loss(*PAIR, beta=0.5)
    assert losses.item() == pytest.approx(softplus(-1))
    assert (chosen.item(), rejected.item()) == pytest.approx((0.5, -0.5))
    smoothed, _, _ = dpo_loss(*PAIR, beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * softplus(-1) + 0.1 * softplus(1))


def test_ipo_and_hinge_by_hand():
    # IPO: (h - 1 / (2 beta))^2 = (2 - 1)^2; hinge: max(0, 1 - beta h) = max(0, 1 - 1) and at beta 0.25: 0.5.
    assert dpo_loss(*PAIR, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(1.0)
    assert dpo_loss(*PAIR, beta=0.25, loss_type="ipo")[0].item() == pytest.approx(0.0)
    assert dpo_loss(*PAIR, beta=0.5, loss_type="hinge")[0].item() == pytest.approx(0.0)
    assert dpo_loss(*PAIR, beta=0.25, loss_type="hinge")[0].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="label_smoothing=0.1 only applies to loss_type 'sigmoid'"):
        dpo_loss(*PAIR, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="unknown preference loss 'dpo'.*hinge.*ipo.*sigmoid"):
        get_preference_loss_fn("dpo")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_gradient_raises_chosen_and_lowers_rejected(loss_type):
    chosen, rejected = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _, _ = dpo_loss(
        chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1, loss_type=loss_type
    )
    loss.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # descent raises chosen, lowers rejected
    assert chosen.grad.item() == pytest.approx(-rejected.grad.item())


def test_sequence_log_probs_sums_the_masked_tokens():
    log_prob = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert sequence_log_probs(log_prob, mask).tolist() == [-3.0, -9.5]


def test_kto_by_hand():
    # r = logps - ref = [1, -1]; z0 = 0.5, beta 1: desirable 1 - sigmoid(1 - 0.5), undesirable weighted 2:
    # 2 (1 - sigmoid(0.5 - (-1))).
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    losses, rewards = kto_loss(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-2.0, -1.0]),
        torch.tensor([True, False]),
        kl=0.5,
        beta=1.0,
        desirable_weight=1.0,
        undesirable_weight=2.0,
    )
    assert losses.tolist() == pytest.approx([1 - sig(0.5), 2 * (1 - sig(1.5))])
    assert rewards.tolist() == [1.0, -1.0]
    # at policy = reference with z0 = 0 every row costs its weight times 1 - sigmoid(0) = 0.5
    same = torch.tensor([-3.0, -4.0])
    assert kto_loss(same, same, torch.tensor([1, 0]), 0.0, 0.1, 1.0, 3.0)[0].tolist() == [0.5, 1.5]


def test_kto_gradient_raises_desirable_and_lowers_undesirable():
    logps = torch.tensor([-2.0, -2.0], requires_grad=True)
    loss, _ = kto_loss(logps, torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), kl=0.0)
    loss.sum().backward()
    assert logps.grad[0] < 0 < logps.grad[1]


def test_kto_kl_estimate_is_the_clamped_mean_log_ratio_without_gradient():
    logps = torch.tensor([-1.0, -3.0, -2.0], requires_grad=True)
    assert kto_kl_estimate(logps, torch.tensor([-2.0, -2.0, -2.5])).item() == pytest.approx((1 - 1 + 0.5) / 3)
    assert not kto_kl_estimate(logps, torch.zeros(3)).requires_grad
    assert kto_kl_estimate(logps, torch.zeros(3)).item() == 0.0  # negative mean clamps to 0
