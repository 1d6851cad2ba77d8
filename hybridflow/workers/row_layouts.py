"""How rows are laid out for one forward pass, and the model's outputs that predict their response tokens.

A batch arrives as the rollout lays it out: ``(bs, prompt_length + response_length)``, each prompt left-padded
and each response right-padded. Scoring it so costs every padding column and recomputes what rows share,
so a forward takes one of these layouts, each exact for the models it is used on:

- **prefix trees** (``share_prompt``, ``hybridflow.workers.packing``): every run of tokens several rows begin
  with is one set of columns, under a 4-D mask per attention layer type (a sliding-window layer gets its own
  window, ``tree_masks``); for models whose attention takes a 4-D mask and whose layers keep no state from
  token to token (``packs_as_tree``);
- **padding-free rows** (``remove_padding``, verl's ``use_remove_padding``): the rows' real tokens end to end,
  each row a chain of its own in the same masks, or for flash-attention kernels (which take no 4-D mask) with
  positions from 0 per row that transformers reads row boundaries from; never for layers with a state;
- **padded rows**, without the columns past the longest response (``trimmed``): always exact;
- any of them split by columns over a sequence-parallel group (``workers.ulysses``).

Only the outputs that predict a real response token are computed by the output layer (``logits_to_keep``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from hybridflow.models.layers import LayerLayout, layer_layout
from hybridflow.models.vision import (
    IMAGES,
    ImageInput,
    image_token_keys,
    model_image_inputs,
    vision_positions,
)
from hybridflow.protocol import DataProto
from hybridflow.workers.expert_routing import Routing, TokenPlaces, flat_places, rows_places
from hybridflow.workers.packing import PackedBatch, TokenInputs, flatten_rows, pack_prefix_tree
from hybridflow.workers.ulysses import (
    SequenceParallel,
    causal_mask,
    left_aligned,
    split_columns,
    takes_4d_mask,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowLayout:
    """Which layouts a role's forwards may use on its model: ``share_prompt`` prefix trees, ``remove_padding``
    padding-free rows (``predictor_outputs`` falls back to padded rows batch by batch where they do not
    apply). ``of`` turns the config's two keys into what the model can take exactly."""

    share_prompt: bool = True
    remove_padding: bool = False

    @classmethod
    def of(cls, model: PreTrainedModel, share_prompt: bool, remove_padding: bool, key: str) -> RowLayout:
        """The layouts ``model`` takes of those asked for, ``key`` the config section asking (e.g.
        ``actor_rollout_ref.model``); a padding-free request it cannot honour is said in one warning line."""
        layout = layer_layout(model.config)
        if remove_padding and layout.recurrent:
            logger.warning(
                "%s.use_remove_padding: %s has %s layers, whose state would run from one row into the next "
                "in a padding-free row; its rows are scored padded",
                key,
                layout.model_type,
                " and ".join(layout.recurrent),
            )
        return cls(share_prompt and packs_as_tree(model, layout), remove_padding and not layout.recurrent)


def trimmed(data: DataProto) -> DataProto:
    """``data``'s ``input_ids``, ``attention_mask``, ``position_ids`` and ``responses`` (and its images)
    without the response columns that no row attends to (the right padding past its longest response)."""
    length = data.tensors["responses"].shape[1]
    attended = data.tensors["attention_mask"][:, -length:].any(dim=0).nonzero()
    cut = length - (int(attended.max()) + 1 if len(attended) else 1)
    images = {IMAGES: data.non_tensor_batch[IMAGES]} if IMAGES in data.non_tensor_batch else {}
    if cut == 0:
        return data
    tensors = {k: data.tensors[k][..., :-cut] for k in ("input_ids", "attention_mask", "position_ids")}
    return DataProto.from_dict({**tensors, "responses": data.tensors["responses"][:, :-cut]}, images)


def row_images(data: DataProto) -> list[Sequence[ImageInput]] | None:
    """Each row's images (``non_tensor_batch["image_inputs"]``), or None when no row has one."""
    column = data.non_tensor_batch.get(IMAGES)
    return list(column) if column is not None and any(len(images) for images in column) else None


def image_column(data: DataProto) -> list[str]:
    """``["image_inputs"]`` when ``data`` has the images column, else ``[]``: what a pass that selects its
    columns keeps of the non-tensor ones."""
    return [IMAGES] if IMAGES in data.non_tensor_batch else []


def image_inputs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list
) -> TokenInputs:
    """Rows' images as the packing sees them: 3-D positions (Qwen) and each token's image key."""
    flat = [im for row in images for im in row]
    config = model.config
    return TokenInputs(
        vision_positions(model, input_ids, attention_mask, flat),
        image_token_keys(input_ids, images, config.image_token_id),
        images,
    )


def _forward(
    model: PreTrainedModel,
    inputs: Mapping[str, torch.Tensor | dict[str, torch.Tensor]],
    images: list,
    keep: Any,
    keeps_logits: bool,
    routing: tuple[Routing, TokenPlaces] | None = None,
):
    """The model's outputs over ``inputs`` (ids, mask, positions; the mask may be one per layer type) with
    ``images`` (in token order) fed to its vision tower; ``keep``: ``logits_to_keep`` for models that take
    it; ``routing``: the experts' routing asked of this forward, the batch's tokens at those places in it."""
    device = next(model.parameters()).device
    routed = routing[0].around(model, routing[1]) if routing is not None else contextlib.nullcontext()
    with routed:
        return model(
            **inputs,
            **model_image_inputs(images, device),
            use_cache=False,
            **({"logits_to_keep": keep} if keeps_logits else {}),
        ).logits


def predictor_outputs(
    model: PreTrainedModel,
    data: DataProto,
    share_prompt: bool,
    keeps_logits: bool,
    sp: SequenceParallel | None,
    remove_padding: bool = False,
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``response_outputs``, or with ``sp`` (a sequence-parallel group, ``workers.ulysses``) only the outputs
    this rank's columns predict, ``(m, ...)``, with ``index`` ``(m,)``: which of the ``M`` tokens they are
    (``ulysses.spread`` assembles them); ``index`` is None without ``sp``. ``routing``: the experts' routing
    asked of the forward (replayed, recorded; ``workers.expert_routing``), filled in by it."""
    length = data.tensors["responses"].shape[1]
    real = data.tensors["attention_mask"][:, -length:].bool()
    images = row_images(data)
    if sp is not None and (images is not None or routing is not None):
        what = "rows with images" if images is not None else "replayed or balanced expert routing"
        raise ValueError(f"sequence parallelism (ulysses_sequence_parallel_size > 1) does not cover {what}")
    layout = layer_layout(model.config)
    remove_padding = remove_padding and not layout.recurrent  # a state would run from one row into the next
    if (share_prompt or remove_padding) and packs_as_tree(model, layout):
        found = _tree_outputs(
            model, data, layout, keeps_logits, sp, real, share_prompt, remove_padding, routing
        )
        if found is not None:
            return found
    mask = data.tensors["attention_mask"]
    data = trimmed(data)
    width = data.tensors["responses"].shape[1]
    if sp is not None:
        return (*_rows_split_outputs(model, data, real[:, :width], keeps_logits, sp), real)
    flat = flatten_rows(data) if remove_padding and images is None else None
    if flat is not None:  # flash attention: transformers finds the rows from their positions
        device = next(model.parameters()).device
        inputs = {"input_ids": flat.input_ids.to(device), "position_ids": flat.position_ids.to(device)}
        keep = flat.keep.to(device)
        routed = None if routing is None else (routing, flat_places(mask))
        outputs = _forward(model, inputs, [], keep, keeps_logits, routed)
        return (outputs if keeps_logits else outputs[:, keep])[0], None, real
    routed = None if routing is None else (routing, rows_places(mask, data.tensors["input_ids"].shape[1]))
    return _row_outputs(model, data, images, keeps_logits, real[:, :width], routed), None, real


def packs_as_tree(model: PreTrainedModel, layout: LayerLayout | None = None) -> bool:
    """Whether a prefix tree's 4-D masks express ``model`` exactly: its attention takes a 4-D mask (eager
    and SDPA do, flash-attention kernels do not) and no layer carries a state from token to token (a
    linear-attention or state-space layer would run down the tree's columns as one sequence)."""
    layout = layout or layer_layout(model.config)
    return takes_4d_mask(model) and not layout.recurrent


def tree_masks(
    packed: PackedBatch, layout: LayerLayout, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask a packed forward takes: one ``(G, 1, W, W)`` mask when every attention layer sees
    the same tokens, else one per layer type, each with its own window (transformers' models that list
    ``layer_types`` take them as a dict keyed by type)."""
    windows = layout.windows
    by_window = {window: packed.attention_mask(dtype, window) for window in set(windows.values())}
    if len(by_window) == 1:
        return next(iter(by_window.values()))
    return {kind: by_window[window] for kind, window in windows.items()}


def _tree_outputs(
    model: PreTrainedModel,
    data: DataProto,
    layout: LayerLayout,
    keeps_logits: bool,
    sp: SequenceParallel | None,
    real: torch.Tensor,
    share: bool,
    always: bool,
    routing: Routing | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """``_outputs`` of ``data`` packed as prefix trees (``share``: what rows begin alike with computed once;
    else each row a chain of its own, padding-free); None when nothing is shared and not ``always``."""
    images = row_images(data)
    extra = None
    if images is not None:
        extra = image_inputs(model, data.tensors["input_ids"], data.tensors["attention_mask"], images)
    packed = pack_prefix_tree(data, extra=extra, share=share, always=always)
    if packed is None:
        return None
    if sp is not None:  # sequence parallelism refuses sliding windows (enable_ulysses): one full mask
        rows, cols = packed.predictors(real)
        outputs = _split_outputs(
            model, packed.input_ids, packed.position_ids, packed.allowed[:, None], packed.keep, sp
        )
        return (*outputs(rows, cols, keeps_logits), real)
    parameter = next(model.parameters())
    masks = tree_masks(packed, layout, parameter.dtype)
    device = parameter.device
    inputs = {
        "input_ids": packed.input_ids.to(device),
        "attention_mask": {k: m.to(device) for k, m in masks.items()}
        if isinstance(masks, dict)
        else masks.to(device),
        "position_ids": packed.position_ids.to(device),
    }
    keep = packed.keep.to(device)
    routed = None if routing is None else (routing, TokenPlaces(packed.places, packed.input_ids.numel()))
    outputs = _forward(model, inputs, packed.images, keep, keeps_logits, routed)
    return packed.gather(outputs if keeps_logits else outputs[:, keep], real), None, real


def _row_outputs(
    model: PreTrainedModel,
    data: DataProto,
    images: list | None,
    keeps_logits: bool,
    real: torch.Tensor,
    routing: tuple[Routing, TokenPlaces] | None,
) -> torch.Tensor:
    """``_outputs`` of plain (``trimmed``) rows, padded as they are; ``real`` ``(bs, width)``."""
    device = next(model.parameters()).device
    width = real.shape[1]
    inputs = {k: data.tensors[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
    flat = [im for row in images or [] for im in row]
    positions = vision_positions(model, inputs["input_ids"], inputs["attention_mask"], flat) if flat else None
    if positions is not None:
        inputs["position_ids"] = positions
    outputs = _forward(model, inputs, flat, width + 1, keeps_logits, routing)
    return outputs[:, -width - 1 : -1][real.to(device)]


def _rows_split_outputs(
    model: PreTrainedModel, data: DataProto, real: torch.Tensor, keeps_logits: bool, sp: SequenceParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_outputs`` of plain (unpacked, ``trimmed``) rows under ``sp``; ``real`` ``(bs, width)``."""
    width = real.shape[1]
    ids, pos, mask = (data.tensors[k] for k in ("input_ids", "position_ids", "attention_mask"))
    rows, step = real.nonzero(as_tuple=True)  # row-major: the order of real's True entries
    aligned = left_aligned(ids, pos, mask)
    if aligned is None:  # gaps in some row: its own mask
        allowed, predictor = causal_mask(mask), ids.shape[1] - width - 1 + step
    else:  # response token t of row r is predicted by column prompt_r - 1 + t
        (ids, pos), allowed = aligned, None
        predictor = mask[:, :-width].sum(1)[rows] - 1 + step
    keep, cols = torch.unique(predictor, return_inverse=True)
    return _split_outputs(model, ids, pos, allowed, keep, sp)(rows, cols, keeps_logits)


def _split_outputs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    allowed: torch.Tensor | None,
    keep: torch.Tensor,
    sp: SequenceParallel,
) -> Any:
    """A sequence-parallel forward over this rank's slice of the columns (``ulysses.split_columns``); returns
    ``outputs(rows, cols, keeps_logits)``: for the tokens predicted by column ``keep[cols[i]]`` of packed row
    ``rows[i]``, the outputs this rank computed and which ``i`` they are."""
    device = next(model.parameters()).device
    part = split_columns(input_ids, position_ids, allowed, sp)
    local = (keep >= part.start) & (keep < part.start + part.width)
    first = int((keep < part.start).sum())
    columns = (keep[local] - part.start).to(device)

    def outputs(
        rows: torch.Tensor, cols: torch.Tensor, keeps_logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(
            input_ids=part.input_ids.to(device),
            position_ids=part.position_ids.to(device),
            use_cache=False,
            ulysses=sp,  # attention over the whole sequence, under its mask (none: the model makes a slice's)
            ulysses_mask=None if part.attention_mask is None else part.attention_mask.to(device),
            **({"logits_to_keep": columns} if keeps_logits else {}),
        ).logits
        out = out if keeps_logits else out[:, columns]
        mine = local[cols]
        index = mine.nonzero().flatten()
        return out[rows[mine].to(device), (cols[mine] - first).to(device)], index

    return outputs
