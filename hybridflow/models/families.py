"""The text model families hybridflow is checked on, each as a tiny random model built from its own config.

Why: the models users train differ in what the fast paths must get right (sliding windows, attention sinks,
hybrid linear attention, latent attention, routed experts), and a family is only supported once every path
has run on it. Real checkpoints cannot be downloaded here and take minutes per operation on a CPU, so each
family is built from its transformers config at test size (2-4 layers, width 64, the tiny BPE tokenizer's
~1k-token vocabulary): the very modeling code a real checkpoint runs, in milliseconds a forward.

``TINY_FAMILIES`` maps a name (the model type) to the config keys that shrink it and make its peculiarity
show at test lengths (a 16-token window, 4 experts with 2 per token); ``tiny_config`` builds the config.
``hybridflow make-tiny-model --family NAME`` writes one to a folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import AutoConfig, PretrainedConfig

#: the tiny shape every family shares (the Llama test model's); families override keys where they must
BASE_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
}

#: a window shorter than a demo prompt plus its answer, so a wrong window changes the log-probs
TINY_WINDOW = 16

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
# DeepSeek's latent attention has as many key/value heads as query heads, and rotary dims of its own
_LATENT = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 8,
}
_GROUPED_EXPERTS = {  # DeepSeek-V3 and GLM-4-MoE: the first layer dense, sigmoid routing over one group
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}


@dataclass(frozen=True)
class TinyFamily:
    """One family at test size: ``label`` names it for people; ``settings`` are its config keys over
    ``BASE_SHAPE``; ``pattern``: the layer types its layers cycle through (``layer_types``), if it lists them."""

    label: str
    settings: dict[str, Any] = field(default_factory=dict)
    pattern: tuple[str, ...] = ()


_SLIDING = ("sliding_attention", "full_attention")
_HYBRID = ("linear_attention", "full_attention")

TINY_FAMILIES: dict[str, TinyFamily] = {
    "llama": TinyFamily("Llama 3"),
    "qwen2": TinyFamily("Qwen2 / Qwen2.5"),
    "qwen3": TinyFamily("Qwen3"),
    "mistral": TinyFamily("Mistral (sliding window)", {"sliding_window": TINY_WINDOW}),
    "phi3": TinyFamily("Phi-3"),
    "olmo2": TinyFamily("OLMo 2"),
    "gemma2": TinyFamily("Gemma 2 (sliding + full)", {"sliding_window": TINY_WINDOW}, _SLIDING),
    "gemma3_text": TinyFamily("Gemma 3 (sliding + full)", {"sliding_window": TINY_WINDOW}, _SLIDING),
    "gemma4_text": TinyFamily(
        "Gemma 4 (sliding + full, per-layer inputs)",
        {"sliding_window": TINY_WINDOW, "per_layer_config": {}, "hidden_size_per_layer_input": 16},
        _SLIDING,
    ),
    "gpt_oss": TinyFamily(
        "gpt-oss (sinks, sliding + full, MoE)",
        {
            "sliding_window": TINY_WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        },
        _SLIDING,
    ),
    "qwen3_moe": TinyFamily("Qwen3-MoE", _MOE),
    "glm4_moe": TinyFamily("GLM-4.5 (MoE)", _GROUPED_EXPERTS),
    "deepseek_v3": TinyFamily("DeepSeek-V3 (latent attention, MoE)", {**_LATENT, **_GROUPED_EXPERTS}),
    "qwen3_5_text": TinyFamily("Qwen3.5 / 3.6 (Gated DeltaNet + attention)", _LINEAR, _HYBRID),
    "qwen3_5_moe_text": TinyFamily(
        "Qwen3.5-MoE (Gated DeltaNet + attention, MoE)",
        {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32},
        _HYBRID,
    ),
    "qwen3_next": TinyFamily(
        "Qwen3-Next (Gated DeltaNet + attention, MoE)",
        {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32},
        _HYBRID,
    ),
}


def tiny_config(
    family: str, vocab_size: int, num_layers: int, special_tokens: dict[str, int], **overrides: Any
) -> PretrainedConfig:
    """The config of a tiny ``family`` model: ``BASE_SHAPE``, then the family's settings, then ``overrides``;
    ``special_tokens``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of: {', '.join(TINY_FAMILIES)}")
    spec = TINY_FAMILIES[family]
    keys: dict[str, Any] = {**BASE_SHAPE, **spec.settings, **overrides}
    if spec.pattern:
        keys["layer_types"] = [spec.pattern[i % len(spec.pattern)] for i in range(num_layers)]
    if family == "gemma4_text":  # its per-layer input embeddings are as wide as the vocabulary
        keys["vocab_size_per_layer_input"] = vocab_size
    return AutoConfig.for_model(
        family, vocab_size=vocab_size, num_hidden_layers=num_layers, **keys, **special_tokens
    )
