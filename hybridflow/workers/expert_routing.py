"""Expert routing in the trainer's forward passes: replaying recorded choices, recording the trainer's own, and
the load-balancing loss, whatever layout the forward gave the batch's tokens.

The batch holds each token's chosen experts as ``routed_experts`` ``(bs, T, layers, k)``, in the columns of its
``input_ids``; a forward sees the tokens elsewhere (a prefix tree's node is several rows' token, a padding-free
row is the rows end to end). ``TokenPlaces`` says where each token went, so ``Routing.around`` can hand each
router the choices of the tokens it sees, in its own order (``hybridflow.models.routing``), and put what the
routers chose back into the batch's columns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.config import ActorConfig
from hybridflow.models.layers import LayerLayout, layer_layout
from hybridflow.models.routing import ROUTED_EXPERTS, RoutingCapture, expert_load, imbalance
from hybridflow.protocol import DataProto
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenPlaces:
    """Where a batch's tokens sit in one forward's input of ``size`` positions (``G * W``, row-major):
    ``places`` ``(bs, T)``, each real token's position there, -1 at padding. Tokens that share a prefix-tree
    node share its position."""

    places: torch.Tensor
    size: int

    def tokens(self) -> torch.Tensor:
        """``(size,)``: for each input position, the flat batch index (``row * T + column``) of the first
        token placed there, -1 where none is (padding)."""
        flat = self.places.flatten()
        where = (flat >= 0).nonzero().flatten()
        first = torch.full((self.size,), len(flat), dtype=torch.long)
        first.scatter_reduce_(0, flat[where], where, reduce="amin")
        return first.masked_fill_(first == len(flat), -1)


def rows_places(mask: torch.Tensor, width: int) -> TokenPlaces:
    """Places of the tokens of padded rows run as they are over their first ``width`` columns: real token
    ``(r, c)`` at ``r * width + c``."""
    rows, total = mask.shape
    columns = torch.arange(total)
    places = torch.arange(rows)[:, None] * width + columns
    return TokenPlaces(places.masked_fill(~mask.bool() | (columns >= width), -1), rows * width)


def flat_places(mask: torch.Tensor) -> TokenPlaces:
    """Places of the tokens of padding-free rows (the real tokens end to end, row-major)."""
    real = mask.bool()
    places = torch.full(mask.shape, -1, dtype=torch.long)
    places[real] = torch.arange(int(real.sum()))
    return TokenPlaces(places, int(real.sum()))


@dataclass
class Routing:
    """Routing asked of one forward, and what it found.

    ``experts``: routed experts per layer; ``replay`` ``(bs, T, layers, k)``: the experts each token is to use
    (-1: its router's own choice), e.g. those the rollout chose; ``balance``: keep what the load-balancing loss
    needs. After the forward (``around``): ``chosen`` ``(bs, T, layers, k)`` what each real token used (-1
    elsewhere); ``load`` ``(layers, experts)`` each expert's share of the real tokens' slots; ``loss`` the
    load-balancing loss over the real tokens (with its graph; ``balance`` only); ``differed``: the share of
    replayed (token, layer) choices the trainer's own routing would have made otherwise."""

    experts: int
    replay: torch.Tensor | None = None
    balance: bool = False
    chosen: torch.Tensor | None = None
    load: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    differed: float = 0.0

    @contextlib.contextmanager
    def around(self, model: nn.Module, places: TokenPlaces) -> Iterator[None]:
        """Route the forward run inside the block as asked, the batch's tokens at ``places``."""
        capture = RoutingCapture.attached(model)  # its routers found once per model, not every forward
        if not capture.layers:
            yield
            return
        tokens = places.tokens()
        forced = None
        if self.replay is not None:
            forced = self.replay.flatten(0, 1)[tokens.clamp(min=0)].long()
            forced[tokens < 0] = -1
        capture.start(forced, keep_logits=self.balance)
        try:
            yield
            self._found(capture, places, tokens >= 0)
        finally:
            capture.stop()

    def _found(self, capture: RoutingCapture, places: TokenPlaces, real: torch.Tensor) -> None:
        chosen = capture.chosen().cpu()  # (N, layers, k)
        grid = places.places.flatten()
        back = torch.full((len(grid), *chosen.shape[1:]), -1, dtype=torch.int16)
        back[grid >= 0] = chosen[grid[grid >= 0]].to(torch.int16)
        self.chosen = back.view(*places.places.shape, *chosen.shape[1:])
        self.load = expert_load(chosen, self.experts, real)
        self.differed = capture.differed(real)
        if self.balance:
            self.loss = capture.balance(real, self.experts)


class PolicyRouting:
    """An MoE policy's routing in the actor's passes, as ``actor.router_replay`` and
    ``actor.router_aux_loss_coef`` ask: which routing each pass asks of its forwards (``Routing``), what the
    old-log-prob pass hands on (R2: the trainer's own choices), and the metrics and loss term it yields.

    ``experts``: routed experts per layer (0: a dense model, for which every method asks nothing);
    ``records``: whether the rollout engine returns each token's experts (``Capabilities.records_routing``)."""

    @classmethod
    def of(cls, config: ActorConfig, policy: nn.Module, records: bool, sp: object | None) -> PolicyRouting:
        """For ``policy`` (its config's layout), under a Ulysses group ``sp`` or none."""
        return cls(config, layer_layout(policy.config), records, sp is not None)

    def __init__(
        self, config: ActorConfig, layout: LayerLayout, records: bool, sequence_parallel: bool
    ) -> None:
        self.mode, self.coef = config.router_replay.mode, config.router_aux_loss_coef
        self.experts = layout.experts
        asked = [f"router_replay.mode={self.mode}"] * (self.mode != "disabled")
        asked += [f"router_aux_loss_coef={self.coef:g}"] * (self.coef != 0)
        if asked and not layout.is_moe:
            logger.warning(
                "actor_rollout_ref.actor.%s: %s has no routed experts; it does nothing",
                asked[0],
                layout.model_type,
            )
        if layout.is_moe and asked and sequence_parallel:
            raise UserError(
                f"actor_rollout_ref.actor.{asked[0]} does not combine with ulysses_sequence_parallel_size > 1"
            )
        if layout.is_moe and self.mode == "R3" and not records:
            raise UserError(
                "actor_rollout_ref.actor.router_replay.mode=R3 replays the rollout's expert choices, which this "
                "rollout engine does not return; use rollout.name=hf or vllm, or mode=R2"
            )
        # under sequence parallelism a forward sees a slice of the columns: routing is left alone there
        self.active = layout.is_moe and not sequence_parallel

    def for_log_probs(self, data: DataProto) -> Routing | None:
        """The old-log-prob pass: R3 replays the rollout's choices; R2 records the trainer's own."""
        if not self.active:
            return None
        recorded = self.mode == "R3" and ROUTED_EXPERTS in data.tensors.keys()
        return Routing(self.experts, replay=data.tensors[ROUTED_EXPERTS] if recorded else None)

    def for_update(self, micro: DataProto) -> Routing | None:
        """An update's forward: replays what the batch carries (the rollout's choices, or R2's from the
        old-log-prob pass), keeping what the balancing loss needs."""
        if not self.active:
            return None
        replay = None
        if self.mode != "disabled" and ROUTED_EXPERTS in micro.tensors.keys():
            replay = micro.tensors[ROUTED_EXPERTS]
        return Routing(self.experts, replay=replay, balance=self.coef != 0)

    def hands_on(self) -> bool:
        """Whether the old-log-prob pass returns the trainer's choices for the updates to replay (R2)."""
        return self.active and self.mode == "R2"

    def loss(self, routing: Routing | None) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The update's loss term (``router_aux_loss_coef`` x the balancing loss) and its routing metrics."""
        if routing is None:
            return None, {}
        metrics = routing_metrics([routing])
        if routing.loss is None:
            return None, metrics
        metrics["moe/aux_loss"] = float(routing.loss.detach())
        return self.coef * routing.loss, metrics


def routing_metrics(routings: list[Routing]) -> dict[str, float]:
    """``moe/imbalance`` (each layer's busiest expert over the even share, averaged over layers and forwards;
    1 is even), its worst layer, and ``moe/replay_differed`` where choices were replayed."""
    loads = [imbalance(r.load) for r in routings if r.load is not None]
    if not loads:
        return {}
    per_layer = torch.stack(loads).mean(dim=0)
    metrics = {"moe/imbalance": float(per_layer.mean()), "moe/imbalance_max_layer": float(per_layer.max())}
    replayed = [r.differed for r in routings if r.replay is not None]
    if replayed:
        metrics["moe/replay_differed"] = sum(replayed) / len(replayed)
    return metrics
