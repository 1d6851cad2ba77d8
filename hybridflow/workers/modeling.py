"""Loading Hugging Face models for the workers, and the forward passes they share.

Every role (actor, reference, critic, reward model) reads ``(bs, prompt_length + response_length)``
sequences laid out the same way: left-padded prompt, then the response, right-padded. The functions here
turn such a batch into per-response-token quantities, and compute the output layer only over the positions
that predict response tokens (``logits_to_keep``): on a 49k-token vocabulary the output layer is a fifth of
the model's arithmetic, and the prompt positions' logits are never needed. Nor are those of the padding
after each response (``response_outputs`` keeps only the positions that predict a real response token): a
batch laid out for 192 response tokens whose answers took 10 would otherwise compute ``(bs, 192, vocab)``
logits, their softmax and its backward, mostly over padding (measured: a SmolLM2 update of 32 such rows took
8.6 s instead of 4.4 s), and a long-tail batch as long as its longest answer everywhere. Rows that begin alike
(GRPO's ``n`` samples of a prompt, prompts with one system prompt) are packed as a prefix tree so what they
share is computed once (``hybridflow.workers.packing``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.data.images import ImagePrompts
from hybridflow.models import resolve_model_path
from hybridflow.models.layers import LayerLayout, layer_layout
from hybridflow.models.vision import (
    IMAGES,
    ImageInput,
    image_token_keys,
    model_image_inputs,
    placeholder_token_ids,
    vision_family,
    vision_positions,
    without_placeholders,
)
from hybridflow.protocol import DataProto
from hybridflow.utils.cores import follow
from hybridflow.utils.errors import MissingInputError
from hybridflow.workers.packing import PackedBatch, TokenInputs, flatten_rows, pack_prefix_tree
from hybridflow.workers.ulysses import (
    SequenceParallel,
    causal_mask,
    left_aligned,
    split_columns,
    spread,
    takes_4d_mask,
)
from hybridflow.workers.weight_files import SafetensorsFolder

logger = logging.getLogger(__name__)

# Per-load progress bars from transformers would drown the trainer's own progress line.
hf_logging.disable_progress_bar()


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU (bf16 is about 11x slower on these CPUs), bf16 on CUDA."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"model.dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]


def model_location(path: str) -> str:
    """``default`` -> the embedded model's folder; a path that looks local must be a model folder (else
    transformers would take it for a hub id and fail with an unrelated message)."""
    resolved = os.path.expanduser(resolve_model_path(path))
    looks_local = resolved.startswith((".", "/")) or resolved.count("/") > 1 or os.path.exists(resolved)
    if looks_local and not os.path.isdir(resolved):
        problem = "is a file, not a model folder" if os.path.exists(resolved) else "not found"
        raise MissingInputError(
            f"model path {problem}: {resolved}; give a Hugging Face model folder (with "
            "config.json), a hub id, or 'default'"
        )
    return resolved


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(model_location(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_image_prompts(
    path: str, tokenizer: PreTrainedTokenizerBase, trust_remote_code: bool = False
) -> ImagePrompts | None:
    """A vision-language model's image processing (``ImagePrompts``), or None for a text model."""
    return ImagePrompts.from_pretrained(model_location(path), tokenizer, trust_remote_code)


def is_vision_language(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model at ``path`` is of a registered vision-language family."""
    config = AutoConfig.from_pretrained(model_location(path), trust_remote_code=trust_remote_code)
    return vision_family(config) is not None


def _vision_class(path: str, auto_cls: Any, trust_remote_code: bool) -> tuple[Any, bool]:
    """The auto class to load ``path`` with, and whether it then needs a value head: a vision-language model
    asked for as a causal LM or a one-label token classifier loads as ``AutoModelForImageTextToText``."""
    if auto_cls not in (AutoModelForCausalLM, AutoModelForTokenClassification):
        return auto_cls, False
    if not is_vision_language(path, trust_remote_code):
        return auto_cls, False
    return AutoModelForImageTextToText, auto_cls is AutoModelForTokenClassification


def load_model(
    path: str,
    device: torch.device,
    dtype: str | None = "auto",
    auto_cls: Any = AutoModelForCausalLM,
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    new_head: str | None = None,
    disable_dropout: bool = True,
    on_meta: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """A Hugging Face model on ``device``; ``path`` may be ``default`` (the embedded SmolLM2), with its
    dropout off unless ``disable_dropout`` is false (``without_dropout``).

    ``new_head`` (e.g. ``"the critic's value head"``): a head the checkpoint is expected to lack. Its
    fresh weights are reported in one line instead of transformers' table of MISSING keys, which reads
    like an error; any *other* missing weight is still reported as a warning.

    ``on_meta``: build the model from its config with its parameters on the meta device, reading no weights
    (a sharded rank that receives its shards from rank 0, ``sharding.shard_module``); they stay there,
    ``device`` unused. Its buffers (rotary frequencies...) are computed on the CPU as the model builds them.

    A vision-language checkpoint (a registered family, ``hybridflow.models.vision``) asked for as a causal LM
    loads as ``AutoModelForImageTextToText``: the same next-token logits, with its vision tower; asked for as
    a one-label token classifier (the critic), as that with a value head for output layer (``value_head``)."""
    auto_cls, value_head = _vision_class(path, auto_cls, trust_remote_code)
    if auto_cls is AutoModelForImageTextToText:
        new_head = None  # a value head is put in place of the output layer below, not loaded
        kwargs.pop("num_labels", None)
    torch_dtype = resolve_dtype(dtype, device)
    if on_meta:
        config = AutoConfig.from_pretrained(
            model_location(path), trust_remote_code=trust_remote_code, **kwargs
        )
        with parameters_on_meta():
            model = auto_cls.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    elif new_head is None:
        model = auto_cls.from_pretrained(
            model_location(path), dtype=torch_dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    else:
        model = _with_new_head(auto_cls, path, torch_dtype, trust_remote_code, new_head, kwargs)
    if value_head:
        model = with_value_head(model)
    if not on_meta:
        model = model.to(device)
    if disable_dropout:
        without_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return follow(model)  # where this process shares its cores, its layers rebalance them


def _with_new_head(
    auto_cls: Any,
    path: str,
    dtype: torch.dtype,
    trust_remote_code: bool,
    new_head: str,
    kwargs: dict[str, Any],
) -> PreTrainedModel:
    """``from_pretrained`` of a checkpoint expected to lack ``new_head``: transformers' table of missing keys
    silenced, the fresh head reported in one line (``_report_new_head``)."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = auto_cls.from_pretrained(
            model_location(path),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    _report_new_head(model, sorted(info.get("missing_keys", [])), new_head, path)
    return model


def with_value_head(model: PreTrainedModel) -> PreTrainedModel:
    """A vision-language model whose output layer is a fresh one-output linear head: its "logits" ``(bs, T,
    1)`` are values, as a token classifier's are (transformers has no token-classification class for these
    families). The head is initialised as transformers initialises a classifier head, and untied from the
    embeddings."""
    text = model.config.get_text_config()
    old = model.lm_head.weight
    head = torch.nn.Linear(text.hidden_size, 1, bias=True, device=old.device, dtype=old.dtype)
    if old.device.type != "meta":
        torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
        torch.nn.init.zeros_(head.bias)
    model.lm_head = head
    model.config.tie_word_embeddings = text.tie_word_embeddings = False
    logger.info("the critic's value head starts from scratch (a linear layer in place of the output layer)")
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside the block hold their parameters on the meta device and their buffers where they
    computed them (accelerate's ``init_empty_weights(include_buffers=False)``).

    Each parameter moves to the meta device as it is registered, before its module initialises it, so the
    block allocates no weights and initialises none; buffers such as rotary frequencies, which no checkpoint
    holds, come out as the model computes them (under ``torch.device("meta")`` they would have no values)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with mock.patch.object(torch.nn.Module, "register_parameter", on_meta):  # put back on the way out
        yield


def weights_source(path: str, **load: Any) -> Callable[[torch.nn.Module], Mapping[str, torch.Tensor]]:
    """Rank 0's full tensors for a sharded model built on the meta device (``sharding.shard_module``): the
    checkpoint's safetensors files read one tensor at a time, when they hold every parameter of the module
    under its name and shape; else (a hub id, ``.bin`` files, names transformers converts as it loads them)
    the state dict of the model loaded whole on the CPU by ``load_model(path, **load)``."""

    def source(module: torch.nn.Module) -> Mapping[str, torch.Tensor]:
        location = model_location(path)
        files = SafetensorsFolder.open(location) if os.path.isdir(location) else None
        if files is not None and files.holds(module):
            return files
        logger.info("%s is read whole by rank 0: its files do not hold the model's tensors as they are", path)
        return load_model(path, torch.device("cpu"), **load).state_dict()

    return source


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability in ``model`` to 0: ``nn.Dropout`` layers and the rates attention layers
    keep as plain floats (Llama's ``attention_dropout``, read in the forward only in training mode).

    Why (TRL's ``disable_dropout``): log-probs are computed in eval mode and updates in training mode, so with
    dropout the update's forward is not the policy that was scored: PPO's first ratio is not 1 and DPO's
    first loss is not ln 2 although the policy equals the reference. The model's config (saved with each
    checkpoint) keeps its rates."""
    for module in model.modules():
        rates = [
            name for name, value in vars(module).items() if name.endswith("dropout") and type(value) is float
        ]
        if isinstance(module, torch.nn.Dropout):
            rates.append("p")
        for name in rates:
            setattr(module, name, 0.0)
    return model


def _report_new_head(model: PreTrainedModel, missing: list[str], new_head: str, path: str) -> None:
    head = {name for name, _ in model.named_parameters() if name.split(".")[0] in ("score", "classifier")}
    fresh, other = [k for k in missing if k in head], [k for k in missing if k not in head]
    if fresh:
        logger.info(
            "%s starts from scratch (%s, as expected: %s holds no such head)",
            new_head,
            ", ".join(fresh),
            path,
        )
    if other:
        logger.warning(
            "%s: weights missing from %s were initialised randomly: %s", new_head, path, ", ".join(other)
        )


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
):
    """The model's outputs over ``inputs`` (ids, mask, positions; the mask may be one per layer type) with
    ``images`` (in token order) fed to its vision tower; ``keep``: ``logits_to_keep`` for models that take
    it."""
    device = next(model.parameters()).device
    return model(
        **inputs,
        **model_image_inputs(images, device),
        use_cache=False,
        **({"logits_to_keep": keep} if keeps_logits else {}),
    ).logits


def response_outputs(
    model: PreTrainedModel,
    data: DataProto,
    share_prompt: bool = True,
    keeps_logits: bool = True,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs that predict the response tokens a row attends to: ``(M, ...)`` (logits, or one
    value) in row-major order, and where those tokens are, ``real`` ``(bs, L)`` bool (``per_token`` puts
    per-token results back in place).

    ``data.batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, T)`` and ``responses``
    ``(bs, L)``; ``data.non_tensor_batch["image_inputs"]``: each row's images, if any (fed to the vision
    tower, with Qwen's 3-D positions computed from them). With ``share_prompt`` and rows that begin alike
    (a group's prompt, a system prompt, the same image), each shared run of tokens is computed once, an
    image's encoder pass included (``hybridflow.workers.packing``; eager and SDPA attention, which take a
    4-D mask); otherwise every row is run as it is, without the columns past its longest response
    (``trimmed``), or with ``remove_padding`` their real tokens end to end in one row (``flatten_rows``).
    Each is exact for the model it is used on: a model whose layers carry a state from token to token
    (linear attention) is never packed, and sliding-window layers get masks of their own window
    (``packs_as_tree``, ``tree_masks``). ``keeps_logits``: the model takes ``logits_to_keep`` (causal LMs
    do; token-classification models do not)."""
    outputs, _, real = _outputs(model, data, share_prompt, keeps_logits, None, remove_padding)
    return outputs, real


def _outputs(
    model: PreTrainedModel,
    data: DataProto,
    share_prompt: bool,
    keeps_logits: bool,
    sp: SequenceParallel | None,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``response_outputs``, or with ``sp`` (a sequence-parallel group, ``workers.ulysses``) only the outputs
    this rank's columns predict, ``(m, ...)``, with ``index`` ``(m,)``: which of the ``M`` tokens they are
    (``ulysses.spread`` assembles them); ``index`` is None without ``sp``."""
    length = data.tensors["responses"].shape[1]
    real = data.tensors["attention_mask"][:, -length:].bool()
    images = row_images(data)
    if sp is not None and images is not None:
        raise ValueError(
            "sequence parallelism (ulysses_sequence_parallel_size > 1) does not cover rows with images"
        )
    layout = layer_layout(model.config)
    remove_padding = remove_padding and not layout.recurrent  # a state would run from one row into the next
    if (share_prompt or remove_padding) and packs_as_tree(model, layout):
        found = _tree_outputs(model, data, layout, keeps_logits, sp, real, share_prompt, remove_padding)
        if found is not None:
            return found
    data = trimmed(data)
    width = data.tensors["responses"].shape[1]
    if sp is not None:
        return (*_rows_split_outputs(model, data, real[:, :width], keeps_logits, sp), real)
    flat = flatten_rows(data) if remove_padding and images is None else None
    if flat is not None:  # flash attention: transformers finds the rows from their positions
        device = next(model.parameters()).device
        inputs = {"input_ids": flat.input_ids.to(device), "position_ids": flat.position_ids.to(device)}
        keep = flat.keep.to(device)
        outputs = _forward(model, inputs, [], keep, keeps_logits)
        return (outputs if keeps_logits else outputs[:, keep])[0], None, real
    return _row_outputs(model, data, images, keeps_logits, real[:, :width]), None, real


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
    outputs = _forward(model, inputs, packed.images, keep, keeps_logits)
    return packed.gather(outputs if keeps_logits else outputs[:, keep], real), None, real


def _row_outputs(
    model: PreTrainedModel, data: DataProto, images: list | None, keeps_logits: bool, real: torch.Tensor
) -> torch.Tensor:
    """``_outputs`` of plain (``trimmed``) rows, padded as they are; ``real`` ``(bs, width)``."""
    device = next(model.parameters()).device
    width = real.shape[1]
    inputs = {k: data.tensors[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
    flat = [im for row in images or [] for im in row]
    positions = vision_positions(model, inputs["input_ids"], inputs["attention_mask"], flat) if flat else None
    if positions is not None:
        inputs["position_ids"] = positions
    outputs = _forward(model, inputs, flat, width + 1, keeps_logits)
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


def per_token(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Values ``(M,)`` of the response tokens at ``real`` ``(bs, L)`` back in place: ``(bs, L)``, zero at
    padding (gradients flow to ``values``)."""
    return values.new_zeros(real.shape).masked_scatter(real.to(values.device), values)


def response_log_probs(
    model: PreTrainedModel,
    data: DataProto,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompt: bool = True,
    sp: SequenceParallel | None = None,
    remove_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``responses`` under ``model`` (logits divided by the sampling temperature,
    so they match what the rollout sampled from).

    ``data.batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, T)`` and ``responses``
    ``(bs, L)``. Returns ``(log_probs (bs, L), entropy (bs, L) or None)``, zero at padding; gradients flow if
    enabled, and through the entropy only with ``entropy_grad`` (an entropy bonus): a metric-only entropy
    keeps no graph. ``share_prompt``: shared runs of tokens computed once (see ``response_outputs``).
    ``sp``: a sequence-parallel group whose ranks all hold ``data`` (``workers.ulysses``): each computes its
    columns' part, and all of them return the whole. ``remove_padding``: rows scored end to end without
    padding where no prefix tree is used (see ``response_outputs``)."""
    logits, index, real = _outputs(model, data, share_prompt, True, sp, remove_padding)
    logits = without_placeholders(logits.float(), placeholder_token_ids(model.config))
    if temperature != 1.0:
        logits = logits / temperature
    labels = data.tensors["responses"][real].to(logits.device)
    count = len(labels)
    if index is not None:
        labels = labels[index.to(logits.device)]
    log_probs = per_token(spread(logprobs_from_logits(logits, labels), index, count, sp), real)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = per_token(spread(entropy_from_logits(logits), index, count, sp), real)
    return log_probs, entropy


def response_values(
    model: PreTrainedModel,
    data: DataProto,
    share_prompt: bool = True,
    sp: SequenceParallel | None = None,
    remove_padding: bool = False,
) -> torch.Tensor:
    """Values ``(bs, L)`` of a token-classification (value-head) model: the value at each position is
    predicted from the state *before* the response token there, as GAE expects. ``sp``: as for
    ``response_log_probs``."""
    values, index, real = _outputs(model, data, share_prompt, False, sp, remove_padding)
    return per_token(spread(values.squeeze(-1).float(), index, int(real.sum()), sp), real)
