"""Masked statistics and log-probability helpers shared by estimators and losses.

Token tensors are ``(bs, response_length)``; masks are 1 on response tokens and 0 on padding (float or
bool; bool is converted to the values' dtype). All reductions weight each position by its mask value,
so padding never contributes.
"""

from __future__ import annotations

from typing import Any

import torch

# Logits handled at once by the log-prob/entropy helpers (whole slices along dim 0, at least one): about
# 16 M elements (64 MiB in fp32) keep the temporaries of logsumexp/softmax small at little per-chunk cost.
_CHUNK_ELEMENTS = 1 << 24


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``axis`` (all elements when None)."""
    weighted = values * _float_mask(mask, values)
    return weighted.sum() if axis is None else weighted.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set, along ``axis`` (all when None).

    An empty mask gives 0 rather than NaN, so a fully padded row cannot poison a batch statistic.
    """
    count = masked_sum(torch.ones_like(values), mask, axis)
    return masked_sum(values, mask, axis) / count.clamp_min(1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked ``values`` (scalar); ``unbiased`` applies Bessel's correction.

    Raises ValueError when the mask holds too few tokens for the requested estimate.
    """
    mask = _float_mask(mask, values)
    count = mask.sum()
    if count == 0 or (unbiased and count == 1):
        raise ValueError(
            f"masked_var needs at least {2 if unbiased else 1} masked tokens (unbiased={unbiased}), "
            f"got mask sum {count.item()} for values of shape {tuple(values.shape)}"
        )
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    return variance * count / (count - 1) if unbiased else variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to unit variance over the mask; zero mean too unless ``shift_mean`` is False.

    Whitening advantages over the whole batch keeps the policy-gradient scale independent of the reward
    scale. Positions outside the mask are transformed too; callers multiply by the mask where needed.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def _chunk_size(logits: torch.Tensor) -> int:
    """How many slices along dim 0 of ``logits`` ``(..., V)`` to process at once (at least one)."""
    per_slice = logits[0].numel() if logits.shape[0] > 0 else 1
    return max(1, _CHUNK_ELEMENTS // max(per_slice, 1))


def _check_logits(logits: torch.Tensor, labels: torch.Tensor | None = None) -> None:
    if logits.dim() < 2:
        raise ValueError(
            f"logits must be (..., V) with at least one leading dimension, got {tuple(logits.shape)}"
        )
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocabulary "
            f"dimension {tuple(logits.shape[:-1])}"
        )


class _GatherMinusLogsumexp(torch.autograd.Function):
    """``logits[label] - logsumexp(logits)`` with a hand-written, chunked backward.

    Autograd through ``gather`` and ``logsumexp`` would build several vocabulary-sized temporaries in
    the backward (the softmax, a zero tensor for the scatter, their sum); here the gradient
    ``onehot(label) - softmax(logits)`` is written chunk by chunk straight into the output buffer.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = _chunk_size(logits)
        lse = torch.cat([torch.logsumexp(chunk.float(), dim=-1) for chunk in torch.split(logits, rows)])
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits, labels, lse)
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        rows = _chunk_size(logits)
        for start in range(0, logits.shape[0], rows):
            part = slice(start, start + rows)
            target = grad[part]
            # fp32 math even for low-precision logits; fp32 logits are written in place
            work = target if target.dtype == torch.float32 else torch.empty_like(target, dtype=torch.float32)
            g = grad_out[part].unsqueeze(-1)
            torch.sub(logits[part].float(), lse[part].unsqueeze(-1), out=work)
            work.exp_().mul_(-g).scatter_add_(-1, labels[part].unsqueeze(-1), g)
            if work is not target:
                target.copy_(work)
        return grad, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits``: ``(bs, T, V), (bs, T) -> (bs, T)`` (any leading dims).

    Computed as ``logits[label] - logsumexp(logits)`` in float32, in chunks along dim 0: unlike
    ``log_softmax(...).gather(...)`` it never builds a second full-vocabulary tensor, which measured
    1.5x faster on CPU and saves the memory of one more copy of the logits.
    """
    _check_logits(logits, labels)
    # torch leaves autograd.Function.apply unannotated
    log_probs: torch.Tensor = _GatherMinusLogsumexp.apply(logits, labels)  # type: ignore[no-untyped-call]
    return log_probs


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: ``(bs, T, V) -> (bs, T)``, in float32.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)`` (no log-softmax tensor), in chunks along dim 0 so
    the softmax temporary stays one chunk large.
    """
    _check_logits(logits)
    return torch.cat([_chunk_entropy(chunk) for chunk in torch.split(logits, _chunk_size(logits))])


def _chunk_entropy(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def sequence_to_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last valid response token: the usual ``token_level_scores``.

    ``scores``: ``(bs,)``; ``response_mask``: ``(bs, response_length)`` with 1 on response tokens.
    Returns ``(bs, response_length)`` in the dtype of ``scores``, zero everywhere else.  A row whose mask
    is all zero has nowhere to put its score and raises (naming the rows)."""
    if scores.shape != response_mask.shape[:1] or response_mask.dim() != 2:
        raise ValueError(
            f"sequence_to_token_scores: scores {tuple(scores.shape)} do not match "
            f"response_mask {tuple(response_mask.shape)}; expected (bs,) and (bs, response_length)"
        )
    valid = response_mask.bool()
    empty = torch.nonzero(~valid.any(dim=-1)).flatten()
    if empty.numel():
        raise ValueError(f"sequence_to_token_scores: rows {empty[:10].tolist()} have no response token")
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    last = (valid * positions).argmax(dim=-1)
    token_scores = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    token_scores[torch.arange(len(scores), device=scores.device), last] = scores
    return token_scores
