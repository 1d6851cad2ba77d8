"""Mixture-of-experts routing: what each token chose, choosing it again, and how evenly the experts are used.

Why: an MoE layer sends each token to ``top_k`` of its experts by a top-k over router scores, and a tiny
difference in those scores (another kernel, another batch shape, the rollout engine against the trainer)
flips near-tied choices; the token's log-prob then comes from other experts, and the flips compound over the
layers. RL runs on MoE models collapse from it (Megatron-LM#4168), so peers replay the rollout's choices in the
trainer (R3: verl, slime, NeMo-RL, ...). Only the choice is replayed: the weights of the chosen experts are
computed from the live router's scores, so its gradient still flows.

transformers' MoE routers (``*TopKRouter`` modules) return ``(router_logits, weights, indices)``; a forward
hook here records the indices, or swaps in given ones and recomputes the weights for them by the router's own
rule. Which rule (softmax then top-k, top-k then softmax, sigmoid with a scaling factor, normalised or not) is
found on the router's first replayed call, as the rule that reproduces the weights it computed itself, so a
router whose rule is none of these is refused instead of replayed wrongly (``replay_rule``).

``RoutingCapture`` is the one set of hooks every user drives: the rollout records, the trainer's log-prob and
update passes replay (``forced``), and both get per-layer expert loads and the load-balancing loss from it.

May import: torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

#: ``routed_experts``: the DataProto column of each token's chosen experts, ``(bs, T, layers, top_k)``
#: (-1 where nothing was recorded: padding, a response's last token, which no forward of the rollout saw)
ROUTED_EXPERTS = "routed_experts"

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _scaled(router: nn.Module) -> float:
    return float(getattr(router, "routed_scaling_factor", 1.0))


def _normalised(weights: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return weights / (weights.sum(dim=-1, keepdim=True) + eps)


#: the ways transformers' routers turn logits ``(N, E)`` and chosen ``indices`` ``(N, k)`` into weights ``(N, k)``
RULES: dict[str, Rule] = {
    "softmax": lambda r, logits, idx: logits.float().softmax(-1).gather(1, idx).to(logits.dtype),
    "softmax, normalised": lambda r, logits, idx: _normalised(logits.float().softmax(-1).gather(1, idx)).to(
        logits.dtype
    ),
    "top-k then softmax": lambda r, logits, idx: logits.gather(1, idx).softmax(-1),
    "sigmoid, scaled": lambda r, logits, idx: logits.float().sigmoid().gather(1, idx) * _scaled(r),
    "sigmoid, normalised, scaled": lambda r, logits, idx: (
        _normalised(logits.float().sigmoid().gather(1, idx), 1e-20) * _scaled(r)
    ),
}


class RoutingError(ValueError):
    """A router whose weights none of ``RULES`` reproduces: its choices cannot be replayed exactly."""


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (transformers' ``*Router`` modules with a ``top_k``)."""
    return [
        module
        for module in model.modules()
        if type(module).__name__.lower().endswith("router")
        and isinstance(getattr(module, "top_k", None), int)
    ]


_RULE_OF: dict[type, str] = {}
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, RoutingCapture] = weakref.WeakKeyDictionary()


def replay_rule(
    router: nn.Module, logits: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
) -> Rule:
    """The rule in ``RULES`` that gives ``router``'s own ``weights`` for its own ``indices`` from its
    ``logits`` (one call's outputs), found on the first call of each router class; ``RoutingError`` when none
    does."""
    kind = type(router)
    if kind not in _RULE_OF:
        tolerance = 1e-5 if weights.dtype == torch.float32 else 1e-2
        for name, rule in RULES.items():
            if torch.allclose(rule(router, logits, indices).float(), weights.float(), atol=tolerance, rtol=0):
                _RULE_OF[kind] = name
                break
        else:
            raise RoutingError(
                f"{kind.__name__} weighs its chosen experts by a rule hybridflow does not know, so its choices "
                "cannot be replayed exactly"
            )
    return RULES[_RULE_OF[kind]]


@dataclass
class LayerRouting:
    """One router's calls in a forward: the experts each input token was sent to ``(N, k)``, the ones it
    would have chosen itself where they were replayed, and the logits (with their graph) for the balancing
    loss."""

    chosen: list[torch.Tensor] = field(default_factory=list)
    own: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class RoutingCapture:
    """Hooks on a model's routers (``attached``: one set per model, for its lifetime).

    ``start`` arms them for the model's next forward: they record what each router chose until ``stop``, and
    with ``forced`` ``(N, layers, k)`` (N: the tokens of that forward, row-major over its ``(rows, columns)``
    input) they make the routers use those experts, -1 where a token keeps its own choice. The forcing outlives
    ``stop``: a backward that recomputes layers (gradient checkpointing) must route as the forward did. It ends
    when the model's next forward begins unarmed (a hook on the model itself, which a recomputation of its
    layers does not call). ``keep_logits``: hold the router logits for ``balance``."""

    def __init__(self, model: nn.Module) -> None:
        self.forced: torch.Tensor | None = None
        self.keep_logits = False
        self.recording = False
        self.armed = False
        found = routers(model)
        self.layers = [LayerRouting() for _ in found]
        model.register_forward_pre_hook(self._new_forward)
        for i, router in enumerate(found):
            router.register_forward_hook(self._hook(i))

    def _new_forward(self, model: nn.Module, inputs: tuple) -> None:
        if not self.armed:  # a forward nobody asked routing of: no stale forcing, no recording
            self.forced, self.recording, self.keep_logits = None, False, False
        self.armed = False

    @classmethod
    def attached(cls, model: nn.Module) -> RoutingCapture:
        """The capture on ``model``'s routers, made the first time it is asked for."""
        if model not in _ATTACHED:
            _ATTACHED[model] = cls(model)
        return _ATTACHED[model]

    def start(self, forced: torch.Tensor | None = None, keep_logits: bool = False) -> None:
        self.forced, self.keep_logits, self.recording, self.armed = forced, keep_logits, True, True
        self.layers = [LayerRouting() for _ in self.layers]

    def stop(self) -> None:
        self.recording = self.keep_logits = False

    def _hook(self, layer: int) -> Callable:
        def hook(router: nn.Module, inputs: tuple, output: tuple) -> tuple | None:
            if self.forced is None and not self.recording:
                return None
            logits, weights, indices = output
            record = self.layers[layer]
            if self.keep_logits:
                record.logits.append(logits)
            if self.forced is None:
                record.chosen.append(indices.detach())
                return None
            forced = self.forced[:, layer].to(indices.device, indices.dtype)
            if forced.shape != indices.shape:
                raise ValueError(
                    f"replayed routing covers {forced.shape[0]} tokens x {forced.shape[1]} experts; the "
                    f"router saw {indices.shape[0]} x {indices.shape[1]}"
                )
            rule = replay_rule(router, logits, weights, indices)
            keep = (forced < 0).any(dim=-1, keepdim=True)
            chosen = torch.where(keep, indices, forced)
            replayed = rule(router, logits, chosen)
            if self.recording:
                record.chosen.append(chosen.detach())
                record.own.append(indices.detach())
            return logits, torch.where(keep, weights, replayed.to(weights.dtype)), chosen

        return hook

    def chosen(self) -> torch.Tensor:
        """The experts each token of the last forward used ``(N, layers, k)`` (the last call of each router:
        a recomputation under gradient checkpointing sees the same tokens)."""
        return torch.stack([layer.chosen[-1] for layer in self.layers], dim=1)

    def differed(self, real: torch.Tensor) -> float:
        """Of the replayed ``(real token, layer)`` pairs, the share whose own choice (as a set of experts) was
        another than the one replayed: how often the trainer alone would have routed otherwise."""
        forced = self.forced
        if forced is None or not self.layers or not self.layers[0].own:
            return 0.0
        own = torch.stack([layer.own[-1] for layer in self.layers], dim=1).sort(dim=-1).values
        used = self.chosen().sort(dim=-1).values
        replayed = (forced.to(own.device) >= 0).all(dim=-1) & real.to(own.device)[:, None]
        differs = (own != used).any(dim=-1)
        return float(differs[replayed].float().mean()) if replayed.any() else 0.0

    def balance(self, real: torch.Tensor, experts: int) -> torch.Tensor:
        """The load-balancing loss (``balance_loss``) over the real tokens, averaged over the layers."""
        losses = [
            balance_loss(layer.logits[-1][real.to(layer.logits[-1].device)], layer.chosen[-1][real], experts)
            for layer in self.layers
        ]
        return torch.stack(losses).mean()


def expert_load(chosen: torch.Tensor, experts: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """Each layer's share of its real tokens' expert slots per expert, ``(layers, experts)``: ``chosen``
    ``(N, layers, k)``; ``real`` ``(N,)`` bool, the tokens that count (not padding)."""
    if real is not None:
        chosen = chosen[real.to(chosen.device)]
    layers = chosen.shape[1]
    counts = torch.zeros(layers, experts, device=chosen.device)
    flat = chosen.transpose(0, 1).reshape(layers, -1)
    counts.scatter_add_(1, flat.clamp(min=0), (flat >= 0).float())
    return counts / counts.sum(dim=1, keepdim=True).clamp(min=1)


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """Each layer's most-used expert's share over the even share ``(layers,)``: 1 is perfectly even, ``E``
    (experts) is every token on one expert."""
    return load.max(dim=1).values * load.shape[1]


def balance_loss(logits: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss of one layer, as transformers computes it for MoE models:
    ``experts * sum_e f_e * P_e``, ``f_e`` the share of the tokens' expert slots that went to expert ``e``
    (``chosen`` ``(N, k)``), ``P_e`` its mean routing probability (softmax of ``logits`` ``(N, E)``). 1 when
    both are even; gradients reach the router through ``P``."""
    slots = chosen.flatten().to(logits.device)
    share = torch.zeros(experts, device=logits.device).scatter_add_(
        0, slots, torch.ones_like(slots, dtype=torch.float)
    )
    share = share / max(1, slots.numel())
    probability = logits.float().softmax(-1).mean(dim=0)
    return experts * (share * probability).sum()
