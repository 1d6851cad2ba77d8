"""Vision-language models: the families hybridflow runs with images, and what a forward pass takes from them.

An image travels beside its prompt as an ``ImageInput``: the image processor's arrays for that image alone,
how many placeholder tokens it takes in the prompt, its encoded bytes (for vLLM, agents and report
thumbnails) and a content key (``hybridflow.data.images`` makes them from data rows). Forward passes take
``model_image_inputs`` (every image of the batch's rows, in row order, concatenated the way the family's
forward expects them) and, for Qwen's families, 3-D rotary positions (``vision_positions``, through the
model's own ``get_rope_index``): the rollout, the actor, the reference and the critic all get their
positions from that one function, so the rollout's log-probs and the trainer's agree.

A family is one entry of ``VISION_FAMILIES`` (``register_vision_family``): Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
LLaVA are registered. Families whose processors lay images out per row (Idefics3/SmolVLM's
``(batch, images, ...)`` tensors) or whose attention differs inside an image (Gemma 3's bidirectional image
blocks) do not fit the per-image concatenation and the packed 4-D masks here, and are not registered.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch

logger = logging.getLogger(__name__)

IMAGES = "image_inputs"  # the DataProto column (non_tensor_batch) of each row's images: a tuple of ImageInput


@dataclass(frozen=True)
class VisionFamily:
    """How one model family takes images. ``image_token``: the placeholder token repeated once per image
    feature; ``keys``: the image processor's outputs the forward takes (concatenated along dim 0 over the
    batch's images); ``tokens``: an image's placeholder count from its arrays and the model config;
    ``mrope``: Qwen's 3-D rotary positions (``get_rope_index``); ``tower``: the vision tower's module name and
    ``projector`` the names of its modules that map its features into the language model (trained when the
    tower is frozen)."""

    image_token: str
    keys: tuple[str, ...]
    tokens: Callable[[dict[str, np.ndarray], Any], int]
    tower: str
    projector: tuple[str, ...] = ()
    mrope: bool = False


def _qwen_tokens(arrays: dict[str, np.ndarray], config: Any) -> int:
    merge = config.vision_config.spatial_merge_size
    return int(np.prod(arrays["image_grid_thw"][0])) // merge**2


def _llava_tokens(arrays: dict[str, np.ndarray], config: Any) -> int:
    patch = config.vision_config.patch_size
    height, width = arrays["pixel_values"].shape[-2:]
    # the CLS feature is dropped by the "default" strategy, kept by "full"
    return (height // patch) * (width // patch) + (config.vision_feature_select_strategy == "full")


_QWEN = VisionFamily(
    "<|image_pad|>",
    ("pixel_values", "image_grid_thw"),
    _qwen_tokens,
    tower="visual",
    projector=("merger", "deepstack_merger_list"),
    mrope=True,
)
VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    # LLaVA's projector (multi_modal_projector) sits beside its tower
    "llava": VisionFamily("<image>", ("pixel_values",), _llava_tokens, tower="vision_tower"),
}


def register_vision_family(model_type: str, family: VisionFamily) -> None:
    """Run models whose ``config.model_type`` is ``model_type`` with images, as ``family`` says."""
    VISION_FAMILIES[model_type] = family


def vision_family(hf_settings: Any) -> VisionFamily | None:
    """The family of a Hugging Face model config, or None for a text model."""
    model_type = getattr(hf_settings, "model_type", None)
    return VISION_FAMILIES.get(model_type) if isinstance(model_type, str) else None


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the model takes it. ``arrays``: the image processor's outputs for this image alone;
    ``num_tokens``: its placeholder tokens in the prompt; ``data``: the encoded image (PNG/JPEG bytes);
    ``key``: a digest of ``arrays``, equal for images the model cannot tell apart (what prefix sharing
    compares). Equal when the keys are equal (a batch's columns compare this way after a round trip)."""

    arrays: dict[str, np.ndarray]
    num_tokens: int
    data: bytes
    key: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageInput) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def pil(self) -> Any:
        from PIL import Image

        return Image.open(io.BytesIO(self.data)).convert("RGB")


# ------------------------------------------------------------------------------------------- forward inputs
def model_image_inputs(images: Sequence[ImageInput], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every image's arrays concatenated along dim 0, in order, as the forward's keyword arguments (the
    order must be that of their placeholder tokens in the flattened batch)."""
    if not images:
        return {}
    keys = images[0].arrays
    return {k: torch.from_numpy(np.concatenate([im.arrays[k] for im in images])).to(device) for k in keys}


class _RopeIndex(Protocol):
    """The part of a Qwen vision-language model that places its 3-D rotary positions."""

    config: Any

    def get_rope_index(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


def _rope_module(model: torch.nn.Module) -> _RopeIndex:
    for module in model.modules():
        if hasattr(type(module), "get_rope_index") and hasattr(module, "config"):
            return cast(_RopeIndex, module)  # it has both members, checked just now
    raise TypeError(f"{type(model).__name__} has no get_rope_index: not a Qwen vision-language model")


def uses_mrope(model: torch.nn.Module) -> bool:
    family = vision_family(_base_config(model))
    return family is not None and family.mrope


def _base_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", None)  # a peft wrapper's config is the base model's anyway
    return config if config is not None or base is None else base().config


def vision_positions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    images: Sequence[ImageInput],
) -> torch.Tensor | None:
    """Qwen's 3-D rotary positions ``(3, bs, T)`` of left/right-padded rows (padding at 0) whose images, in
    row order, are ``images``; None for a family with 1-D positions (the batch's ``position_ids`` hold)."""
    if not uses_mrope(model):
        return None
    rope = _rope_module(model)
    grids = [im.arrays["image_grid_thw"] for im in images]
    grid = torch.from_numpy(np.concatenate(grids)).to(input_ids.device) if grids else None
    token_type = (input_ids == rope.config.image_token_id).int()
    positions, _ = rope.get_rope_index(
        input_ids=input_ids, mm_token_type_ids=token_type, image_grid_thw=grid, attention_mask=attention_mask
    )
    return positions


def image_token_keys(
    input_ids: torch.Tensor, rows_images: Sequence[Sequence[ImageInput]], image_token_id: int
) -> torch.Tensor:
    """``(bs, T)`` int64: 0 at text tokens, at an image token a number drawn from its image's key. Two
    image tokens that are the same token at the same position still differ here when their images do,
    which is what sharing a prefix of tokens must compare."""
    keys = torch.zeros_like(input_ids, dtype=torch.long)
    for r, images in enumerate(rows_images):
        if not images:
            continue
        columns = (input_ids[r] == image_token_id).nonzero().flatten()
        numbers = [int(im.key[:15], 16) + 1 for im in images for _ in range(im.num_tokens)]
        if len(numbers) != len(columns):
            raise ValueError(
                f"row {r} has {len(columns)} image tokens but its images take {len(numbers)}: the images do "
                "not belong to this row"
            )
        keys[r, columns] = torch.tensor(numbers, dtype=torch.long)
    return keys


# the score given to tokens a policy never writes: finite, so softmax gives them 0 and entropy stays finite
UNWRITTEN = -1e9


def placeholder_token_ids(hf_settings: Any) -> list[int]:
    """The image (and video) placeholder tokens of a vision-language model (its Hugging Face config), [] for a
    text model: a policy never writes them (a sampled placeholder would be taken for an image without one in
    every later pass)."""
    if vision_family(hf_settings) is None:
        return []
    return [
        int(i)
        for i in (getattr(hf_settings, "image_token_id", None), getattr(hf_settings, "video_token_id", None))
        if i is not None
    ]


def without_placeholders(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` ``(..., V)`` with the placeholder tokens' scores set to ``UNWRITTEN`` (out of place, so
    gradients flow): the rollout samples from this distribution and the trainer scores with it."""
    if not token_ids:
        return logits
    index = torch.tensor(list(token_ids), device=logits.device)
    return logits.index_fill(-1, index, UNWRITTEN)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Fix the vision tower's weights (``requires_grad`` off), its projector excepted: the language model and
    the projector train (verl's ``freeze_vision_tower``). Returns how many parameters were frozen; 0 for a
    text model."""
    family = vision_family(_base_config(model))
    if family is None:
        logger.warning(
            "freeze_vision_tower is set but %s is a text model: it has no vision tower to freeze",
            type(model).__name__,
        )
        return 0
    frozen = 0
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if family.tower in parts and not set(family.projector) & set(parts):
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def lora_targets(model: torch.nn.Module, targets: list[str] | str) -> list[str] | str:
    """LoRA's target modules for ``model``: for a vision-language model asked for ``all-linear``, every linear
    layer of its language model (the vision tower and projector keep their weights, as the base does); other
    targets as given."""
    if vision_family(_base_config(model)) is None or targets != "all-linear":
        return targets
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and "language_model" in name.split(".")
    ]
