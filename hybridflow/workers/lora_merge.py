"""A LoRA model's full weights with the adapters merged in, tensor by tensor as they stream from the shards.

peft adapts two kinds of weights: linear layers (``lora.Linear``: ``W + s * B @ A``) and parameters targeted
directly (``ParamWrapper``), which on transformers' mixture-of-experts models are the experts' stacked 3-D
weights (``gate_up_proj``, ``down_proj``) and the router's weight: peft targets them whenever a config names
the layers they were fused from, ``all-linear`` included. A parameter's adapter holds one rank-``r`` pair per
expert, stacked (``A`` ``(E * r, in)``, ``B`` ``(out, r * E)``), and wrappers nest when one module holds two
targeted parameters (the experts' ``base_layer.base_layer.gate_up_proj`` under an inner wrapper and
``...down_proj`` under the outer one). ``LoraMerge`` pairs each base tensor with its adapter by the wrapper
that owns it, so merging needs only the whole tensors, never the wrapped modules (which are sharded).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

#: ``.base_layer`` segments peft inserts between a wrapped module and its base tensors (nested: several)
_WRAPPED = re.compile(r"(\.base_layer)+(?=\.)")


def base_name(name: str) -> str:
    """A state-dict name of a peft model as the base Hugging Face model names it."""
    return _WRAPPED.sub("", name).removeprefix("base_model.model.")


@dataclass(frozen=True)
class _Adapter:
    """What merging one wrapper's adapter needs: ``scaling`` (alpha / r), the stacked ``experts`` of a
    parameter target (1: a matrix), and whether that parameter stores ``(experts, out, in)``."""

    scaling: float
    experts: int = 1
    out_first: bool = False

    def delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The update ``B A`` scaled, in the base tensor's shape (peft's ``get_delta_weight``)."""
        if self.experts == 1:
            return (b @ a) * self.scaling
        a = a.reshape(self.experts, -1, a.shape[-1])  # (E, r, in)
        b = b.reshape(b.shape[0], -1, self.experts)  # (out, r, E)
        pattern = "o r e, e r i -> e o i" if self.out_first else "o r e, e r i -> e i o"
        return torch.einsum(pattern, b, a) * self.scaling


class LoraMerge:
    """Feed a LoRA model's whole state-dict tensors in any order (``feed``); out come the base model's
    tensors under its names, each adapted one as soon as it and its adapter's two matrices have come."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer, ParamWrapper

        self.adapters: dict[str, _Adapter] = {}  # the wrapper's module name -> how to merge it
        self.owner: dict[str, str] = {}  # a base tensor's base name -> the wrapper that adapts it
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            scaling = float(module.scaling["default"])
            if isinstance(module, ParamWrapper):
                adapter = _Adapter(scaling, module.num_experts, bool(module._did_swap_in_out_features))
                self.owner[base_name(f"{name}.{module.parameter_name}")] = name
            else:
                adapter = _Adapter(scaling)
                self.owner[base_name(f"{name}.weight")] = name
            self.adapters[name] = adapter
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Take one state-dict tensor; yield the base tensors it completes."""
        if ".lora_A." in name or ".lora_B." in name:
            wrapper, part = name.split(".lora_")[0], "A" if ".lora_A." in name else "B"
            yield from self._complete(wrapper, part, tensor)
            return
        base = base_name(name)
        if base not in self.owner:
            yield base, tensor
            return
        yield from self._complete(self.owner[base], base, tensor)

    def _complete(self, wrapper: str, part: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        parts = self.pending.setdefault(wrapper, {})
        parts[part] = tensor
        if len(parts) < 3:
            return
        a, b = parts.pop("A"), parts.pop("B")
        ((base, weight),) = parts.items()
        del self.pending[wrapper]
        yield base, weight + self.adapters[wrapper].delta(a, b).to(weight.dtype)

    def finish(self) -> None:
        """Every adapted tensor must have been completed (a RuntimeError names the first that was not)."""
        if self.pending:
            wrapper, parts = next(iter(self.pending.items()))
            raise RuntimeError(f"LoRA merge of {wrapper} never got {sorted({'A', 'B', 'base'} - set(parts))}")
