"""The experts an MoE model's rollout routed each token to, laid out in the columns of the batch it returns.

The Hugging Face rollout runs a generation as several forwards of other shapes than its result: the prompts'
common prefix once, each prompt's remainder once for its ``n`` samples, then one token per live row per step
(and, after a weight update in flight, the live rows again from the start). ``RoutingLog`` takes each
forward's routing (``hybridflow.models.routing``) with where its tokens belong in the ``(bs * n, P + L)``
result, so the trainer can replay exactly the choices that sampled each token (verl's router replay, R3).
A response's last token is never fed back to the model, so nothing routed it: it stays -1 (the trainer's
router chooses for it, which no log-prob depends on).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridflow.models.routing import RoutingCapture, routers


class RoutingLog:
    """Chosen experts ``(rows, width, layers, top_k)`` int16 (-1: nothing recorded) of a generation's ``rows``
    samples of ``width`` columns (prompt + response), recorded through the model's router hooks."""

    def __init__(self, model: nn.Module, rows: int, width: int, top_k: int) -> None:
        self.capture = RoutingCapture.attached(model)
        self.width = width
        self.grid = torch.full((rows * width, len(routers(model)), top_k), -1, dtype=torch.int16)

    def start(self) -> None:
        """Record the next forward of the model."""
        self.capture.start()

    def record(self, places: torch.Tensor) -> None:
        """After a forward over input ``(B, S)``: ``places`` ``(B, S, c)`` says where in the result each input
        token's routing goes (flat ``row * width + column``, ``c`` copies: a prompt's token is all its ``n``
        samples' token), -1 for input tokens that are not the result's (padding)."""
        chosen = self.capture.chosen().cpu().to(torch.int16)  # (B * S, layers, k)
        self.capture.stop()
        copies = places.shape[-1]
        flat = places.reshape(-1, copies).cpu()
        source = torch.arange(len(flat))[:, None].expand(-1, copies)
        where = flat >= 0
        self.grid[flat[where]] = chosen[source[where]]

    def rows_places(self, rows: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Places ``(B, S, c)`` for an input whose row ``b`` holds columns ``columns[b]`` ``(B, S)`` of the
        result rows ``rows[b]`` ``(B, c)``; ``valid`` ``(B, S)``: the input tokens that are real."""
        places = rows[:, None, :] * self.width + columns[:, :, None]
        return places.masked_fill(~valid.bool()[:, :, None], -1)

    def result(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(rows, width, layers, k)``, -1 wherever ``attention_mask`` ``(rows, width)`` is 0."""
        grid = self.grid.view(*attention_mask.shape, *self.grid.shape[1:])
        return grid.masked_fill(~attention_mask.bool().cpu()[:, :, None, None], -1)
