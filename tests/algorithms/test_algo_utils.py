"""Masked statistics, log-probs/entropy from logits, and the shared registry."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridflow.algorithms import utils as algo_utils
from hybridflow.algorithms.registry import Registry

VALUES = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mask", [MASK.float(), MASK.bool()], ids=["float", "bool"])
def test_masked_sum_and_mean_ignore_padding(mask):
    # kept values: row 0 -> 1, 2; row 1 -> 4 (the 100s are padding)
    assert masked_sum(VALUES, mask).item() == 7.0
    assert masked_sum(VALUES, mask, axis=-1).tolist() == [3.0, 4.0]
    assert masked_mean(VALUES, mask).item() == pytest.approx(7 / 3)
    assert masked_mean(VALUES, mask, axis=-1).tolist() == [1.5, 4.0]


def test_masked_mean_of_empty_row_is_zero_not_nan():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # row 0: (1 + 2) / 2; row 1 has no token
    assert masked_mean(VALUES, mask, axis=-1).tolist() == [1.5, 0.0]


def test_masked_var_matches_hand_computation():
    values = torch.tensor([[1.0, 2.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9; biased 42/9 / 3 = 14/9; unbiased 42/9 / 2 = 7/3
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14 / 9)
    assert masked_var(values, mask).item() == pytest.approx(7 / 3)


def test_masked_var_refuses_too_few_tokens():
    with pytest.raises(ValueError, match="at least 2 masked tokens"):
        masked_var(torch.tensor([[3.0, 5.0]]), torch.tensor([[1, 0]]))


def test_masked_whiten():
    values = torch.tensor([[1.0, 2.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # (v - 7/3) / sqrt(7/3): sqrt(7/3) = 1.5275252
    whitened = masked_whiten(values, mask)[0, :3]
    assert whitened.tolist() == pytest.approx([-0.8728716, -0.2182179, 1.0910895], abs=1e-6)
    # shift_mean=False adds the mean 7/3 = 2.3333333 back
    kept_mean = masked_whiten(values, mask, shift_mean=False)[0, :3]
    assert kept_mean.tolist() == pytest.approx([1.4604617, 2.1151154, 3.4244228], abs=1e-6)


def test_logprobs_and_entropy_hand_values():
    # logits [0, ln 3] -> probabilities [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    labels = torch.tensor([[1, 0]])
    assert logprobs_from_logits(logits, labels)[0].tolist() == pytest.approx([math.log(0.75), math.log(0.25)])
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.3465736 + 0.2157616 = 0.5623351; uniform over 4 -> ln 4
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx([0.5623351, 0.5623351], abs=1e-6)
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))


@pytest.mark.parametrize("chunk_elements", [1 << 24, 7], ids=["one-chunk", "many-chunks"])
def test_logprobs_and_entropy_equal_reference_with_gradients(monkeypatch, chunk_elements):
    monkeypatch.setattr(algo_utils, "_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)

    ours = logprobs_from_logits(logits, labels)
    reference = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, reference)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (grad_ref,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(grad_ours, grad_ref)

    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    assert entropy.shape == (3, 5)


def test_logprobs_of_sliced_and_bf16_logits():
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 6, 9, generator=gen)
    logits = full[:, :-1]  # a non-contiguous slice, as when shifting a model's output
    labels = torch.randint(0, 9, (2, 5), generator=gen)
    reference = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), reference)
    # 2-D (tokens, V) input, as in padding-free layouts
    torch.testing.assert_close(
        logprobs_from_logits(logits.reshape(10, 9), labels.reshape(10)), reference.reshape(10)
    )

    low = logits.to(torch.bfloat16).requires_grad_(True)
    ours = logprobs_from_logits(low, labels)
    assert ours.dtype == torch.float32  # computed in fp32 from the bf16 values
    ref_fp32 = low.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, ref_fp32)
    (grad,) = torch.autograd.grad(ours.sum(), low)
    assert grad.dtype == torch.bfloat16
    # d/dz of log p(label) = onehot(label) - softmax(z)
    expected = torch.nn.functional.one_hot(labels, 9) - low.float().softmax(-1)
    torch.testing.assert_close(grad.float(), expected, atol=1e-2, rtol=1e-2)


def test_logprobs_rejects_mismatched_labels():
    with pytest.raises(ValueError, match=r"labels shape \(3, 4\)"):
        logprobs_from_logits(torch.zeros(3, 5, 7), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one leading dimension"):
        entropy_from_logits(torch.zeros(7))


def test_registry_duplicates_and_unknown_names():
    registry = Registry("widget")

    @registry.register("a")
    def first():
        return 1

    registry.register("a")(first)  # the same function again is fine
    with pytest.raises(ValueError, match="widget 'a' is already registered"):

        @registry.register("a")
        def other():
            return 2

    assert registry.get("a") is first
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known: \['a'\]"):
        registry.get("b")
