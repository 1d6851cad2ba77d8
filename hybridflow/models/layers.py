"""What a model's layers need from the code that runs them, read from its Hugging Face config.

Fast paths that rewrite a forward (prefix-tree packing, padding-free rows, the rollout's shared prompt
cache) are exact only for the attention they were written for. A causal mask over one row is right for full
attention; a sliding-window layer sees only its last ``window`` tokens; a linear-attention or state-space layer
(Qwen3.5's Gated DeltaNet, Mamba) carries a state from token to token, which no attention mask can shape; a
mixture-of-experts layer routes each token to ``top_k`` of its experts. ``layer_layout`` reads these from a
config once, so each path asks the layout rather than the model type, and a family that transformers adds
later with the same ``layer_types`` vocabulary works without an entry here.

May import: torch, transformers (config objects only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: layer types whose mixing is softmax attention under a mask (transformers' ``layer_types`` vocabulary):
#: everything else (``linear_attention``, ``mamba``, ``conv``, ``hybrid``...) keeps a recurrent state
ATTENTION_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerLayout:
    """A model's layers as the fast paths see them.

    ``types``: each decoder layer's type (``full_attention``, ``sliding_attention``, ``linear_attention``...);
    ``window``: the sliding layers' window in tokens (a token sees itself and the ``window - 1`` before it);
    ``keyed_masks``: the model takes its attention masks as a dict keyed by layer type (its config lists
    ``layer_types``); ``experts`` / ``top_k``: routed experts per MoE layer and how many each token uses (0:
    dense); ``latent_attention``: DeepSeek's multi-head latent attention (compressed keys and values)."""

    model_type: str
    types: tuple[str, ...]
    window: int | None = None
    keyed_masks: bool = False
    experts: int = 0
    top_k: int = 0
    latent_attention: bool = False

    @property
    def recurrent(self) -> tuple[str, ...]:
        """The layer types that keep a state from token to token (no attention mask shapes them)."""
        return tuple(sorted({t for t in self.types if t not in ATTENTION_TYPES}))

    @property
    def windows(self) -> dict[str, int | None]:
        """Each attention layer type present and the window its mask needs (None: full causal)."""
        return {
            t: self.window if t == "sliding_attention" else None for t in self.types if t in ATTENTION_TYPES
        }

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def describe(self) -> str:
        """One phrase for messages: ``qwen3_5_text (linear_attention + full_attention layers, 4 experts)``."""
        kinds = " + ".join(dict.fromkeys(self.types))
        parts = [f"{kinds} layers"]
        if self.window is not None and "sliding_attention" in self.types:
            parts.append(f"window {self.window}")
        if self.latent_attention:
            parts.append("latent attention")
        if self.is_moe:
            parts.append(f"{self.experts} experts, top {self.top_k}")
        return f"{self.model_type} ({', '.join(parts)})"


def _layer_types(text: Any) -> tuple[tuple[str, ...], bool]:
    """Each layer's type, and whether the config lists them (the model then takes masks keyed by type)."""
    listed = getattr(text, "layer_types", None)
    if listed:
        return tuple(listed), True
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    window = getattr(text, "sliding_window", None)
    sliding = window is not None and getattr(text, "use_sliding_window", True) is not False
    return ("sliding_attention" if sliding else "full_attention",) * layers, False


def _experts(text: Any) -> tuple[int, int]:
    """Routed experts per MoE layer and experts per token, under the names the families use (0, 0: dense)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        count = getattr(text, key, None)
        if isinstance(count, int) and count > 1:
            return count, int(
                getattr(text, "num_experts_per_tok", 0) or getattr(text, "top_k_experts", 0) or 1
            )
    return 0, 0


def layer_layout(hf_config: Any) -> LayerLayout:
    """The layout of the model a Hugging Face config describes (its text model's, for a vision-language one)."""
    text = hf_config.get_text_config()
    types, keyed = _layer_types(text)
    experts, top_k = _experts(text)
    return LayerLayout(
        model_type=str(text.model_type),
        types=types,
        window=getattr(text, "sliding_window", None) if "sliding_attention" in types else None,
        keyed_masks=keyed,
        experts=experts,
        top_k=top_k,
        latent_attention=getattr(text, "kv_lora_rank", None) is not None,
    )
