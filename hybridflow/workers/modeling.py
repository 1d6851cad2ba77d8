"""Loading Hugging Face models for the workers, and the forward passes they share.

Every role (actor, reference, critic, reward model) reads ``(bs, prompt_length + response_length)``
sequences laid out the same way: left-padded prompt, then the response, right-padded. The functions here
turn such a batch into per-response-token quantities, and compute the output layer only over the positions
that predict response tokens (``logits_to_keep``): on a 49k-token vocabulary the output layer is a fifth of
the model's arithmetic, and the prompt positions' logits are never needed. Nor are those of the padding
after each response (``response_outputs`` keeps only the positions that predict a real response token): a
batch laid out for 192 response tokens whose answers took 10 would otherwise compute ``(bs, 192, vocab)``
logits, their softmax and its backward, mostly over padding (measured: a SmolLM2 update of 32 such rows took
8.6 s instead of 4.4 s), and a long-tail batch as long as its longest answer everywhere. How the rows are laid
out for the forward (prefix trees, padding-free, padded) is ``hybridflow.workers.row_layouts``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
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

import hybridflow.workers.row_layouts as row_layouts
from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.data.images import ImagePrompts
from hybridflow.models import resolve_model_path
from hybridflow.models.vision import (
    placeholder_token_ids,
    vision_family,
    without_placeholders,
)
from hybridflow.protocol import DataProto
from hybridflow.utils.cores import follow
from hybridflow.utils.deprecation import moved_names
from hybridflow.utils.errors import MissingInputError
from hybridflow.workers.expert_routing import Routing
from hybridflow.workers.row_layouts import predictor_outputs
from hybridflow.workers.ulysses import (
    SequenceParallel,
    spread,
)
from hybridflow.workers.weight_files import SafetensorsFolder

logger = logging.getLogger(__name__)

# the row helpers that lived here until the row layouts got a module of their own
__getattr__ = moved_names(__name__, row_layouts, ["trimmed", "row_images", "image_column", "image_inputs"])

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
    outputs, _, real = predictor_outputs(model, data, share_prompt, keeps_logits, None, remove_padding)
    return outputs, real


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
    routing: Routing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``responses`` under ``model`` (logits divided by the sampling temperature,
    so they match what the rollout sampled from).

    ``data.batch``: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, T)`` and ``responses``
    ``(bs, L)``. Returns ``(log_probs (bs, L), entropy (bs, L) or None)``, zero at padding; gradients flow if
    enabled, and through the entropy only with ``entropy_grad`` (an entropy bonus): a metric-only entropy
    keeps no graph. ``share_prompt``: shared runs of tokens computed once (see ``response_outputs``).
    ``sp``: a sequence-parallel group whose ranks all hold ``data`` (``workers.ulysses``): each computes its
    columns' part, and all of them return the whole. ``remove_padding``: rows scored end to end without
    padding where no prefix tree is used (see ``response_outputs``). ``routing``: an MoE model's expert
    routing asked of the forward (replay, record, balance; ``hybridflow.workers.expert_routing``)."""
    logits, index, real = predictor_outputs(model, data, share_prompt, True, sp, remove_padding, routing)
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
    values, index, real = predictor_outputs(model, data, share_prompt, False, sp, remove_padding)
    return per_token(spread(values.squeeze(-1).float(), index, int(real.sum()), sp), real)
