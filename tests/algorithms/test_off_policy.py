"""Off-policy masking: hand-computed ratios at token and sequence level, and the metrics of how often each acts."""

import math

import pytest
import torch

from hybridflow.algorithms import off_policy_mask

LN = math.log

# Two samples of 3 tokens. Sample 0: token ratios 1, 3, 1 (one token above high=2); its geometric mean
# ratio is 3^(1/3) = 1.44, in bounds. Sample 1 (2 real tokens): ratios 0.25, 0.25, geometric mean 0.25: the
# whole sample is out of bounds, and each of its tokens too. The padded third token of sample 1 has a huge
# ratio that must count for nothing.
TRAINER = torch.tensor([[LN(0.5), LN(0.3), LN(0.2)], [LN(0.1), LN(0.1), LN(0.9)]])
ROLLOUT = torch.tensor([[LN(0.5), LN(0.1), LN(0.2)], [LN(0.4), LN(0.4), LN(1e-6)]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "level, kept",
    [
        ("off", [[1, 1, 1], [1, 1, 1]]),
        ("token", [[1, 0, 1], [0, 0, 1]]),
        ("sequence", [[1, 1, 1], [0, 0, 1]]),
        ("token_and_sequence", [[1, 0, 1], [0, 0, 1]]),
    ],
)
def test_mask_levels(level, kept):
    keep, metrics = off_policy_mask(TRAINER, ROLLOUT, MASK, level, 0.5, 2.0)
    assert keep.tolist() == [[float(v) for v in row] for row in kept]
    # each level's own rate is reported whatever is applied: 3 of 5 response tokens, 1 of 2 samples
    assert metrics["off_policy/token_masked_frac"] == pytest.approx(3 / 5)
    assert metrics["off_policy/seq_masked_frac"] == pytest.approx(1 / 2)
    dropped = {"off": 0, "token": 3, "sequence": 2, "token_and_sequence": 3}[level]
    assert metrics["off_policy/masked_frac"] == pytest.approx(dropped / 5)
    assert metrics["off_policy/ratio_max"] == pytest.approx(3.0)
    assert metrics["off_policy/ratio_min"] == pytest.approx(0.25)
    assert metrics["off_policy/ratio_mean"] == pytest.approx((1 + 3 + 1 + 0.25 + 0.25) / 5)


def test_sequence_level_is_length_normalised():
    # ten tokens each at ratio 1.2: the product 1.2^10 = 6.2 would be out of [0.5, 2], the geometric mean 1.2 is not
    trainer = torch.full((1, 10), LN(0.6))
    rollout = torch.full((1, 10), LN(0.5))
    keep, metrics = off_policy_mask(trainer, rollout, torch.ones(1, 10), "sequence", 0.5, 2.0)
    assert keep.sum() == 10 and metrics["off_policy/seq_masked_frac"] == 0.0


def test_on_policy_keeps_everything():
    lp = torch.randn(4, 5)
    keep, metrics = off_policy_mask(lp, lp.clone(), torch.ones(4, 5), "token_and_sequence", 0.9, 1.1)
    assert keep.eq(1).all() and metrics["off_policy/masked_frac"] == 0.0
    assert metrics["off_policy/ratio_mean"] == 1.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="level 'tokens'"):
        off_policy_mask(TRAINER, ROLLOUT, MASK, "tokens", 0.5, 2.0)
    with pytest.raises(ValueError, match=r"\[2.0, 3.0\]"):
        off_policy_mask(TRAINER, ROLLOUT, MASK, "token", 2.0, 3.0)
