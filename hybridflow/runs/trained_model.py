"""Looking at what a trained actor answers: load a checkpoint as plain Hugging Face objects, and chat."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from hybridflow.models import resolve_model_path
from hybridflow.models.vision import vision_family
from hybridflow.runs.checkpoint import find_latest_checkpoint
from hybridflow.utils.errors import MissingInputError

ADAPTER_CONFIG = "adapter_config.json"


def actor_folder(path: str | Path) -> Path:
    """The Hugging Face folder behind ``path``: a run folder (its newest complete checkpoint), a
    ``global_step_N`` folder, a model folder (``default`` for the embedded SmolLM2) or a LoRA adapter folder.
    A checkpoint's merged ``huggingface/`` folder wins over its ``lora_adapter/`` (saved alone with
    ``save_lora_only``)."""
    path = Path(resolve_model_path(str(path)))
    if (path / "config.json").exists() or (path / ADAPTER_CONFIG).exists():
        return path
    step = path if (path / "actor").exists() else find_latest_checkpoint(path)
    for folder in ("huggingface", "lora_adapter"):
        actor = Path(step) / "actor" / folder if step is not None else None
        if actor is not None and ((actor / "config.json").exists() or (actor / ADAPTER_CONFIG).exists()):
            return actor
    raise MissingInputError(
        f"{path} is neither a model folder, a LoRA adapter folder, a checkpoint, nor a run "
        "folder with a complete checkpoint"
    )


def _auto_class(folder: str | Path) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """``AutoModelForImageTextToText`` for a vision-language model (a registered family), else
    ``AutoModelForCausalLM``."""
    config = AutoConfig.from_pretrained(folder)
    return AutoModelForImageTextToText if vision_family(config) is not None else AutoModelForCausalLM


def load_trained_actor(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of a trained actor, loaded by plain transformers (an adapter folder: by
    ``peft``, on the base model its ``adapter_config.json`` names, with the adapter merged in); a
    vision-language model as ``AutoModelForImageTextToText``."""
    folder = actor_folder(path)
    hf_logging.disable_progress_bar()  # a per-tensor loading bar would bury the answers
    if (folder / ADAPTER_CONFIG).exists():
        from peft import PeftConfig, PeftModel

        base_path = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
        base = _auto_class(base_path).from_pretrained(base_path)
        model = PeftModel.from_pretrained(base, folder).merge_and_unload()
        return model.eval(), AutoTokenizer.from_pretrained(folder)
    return _auto_class(folder).from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def chat(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> str:
    """One user turn through the chat template; greedy unless ``temperature > 0``."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate (not a transformers GenerationMixin)")
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
    )
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    if not isinstance(reply, str):  # one sequence of ids decodes to one string
        raise TypeError(f"tokenizer.decode returned a {type(reply).__name__}")
    return reply
