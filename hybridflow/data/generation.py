"""``generation_batch``: prompts typed by hand -> the batch ``generate_sequences`` takes.

A generation batch is a ``DataProto`` of *left-padded* ``input_ids``, ``attention_mask`` and
``position_ids`` ``(bs, P)``: every prompt ends at the last column, where generation continues. A batch a
tokenizer pads on the right (its default) puts padding between a prompt and its response and makes the
model generate garbage; this helper builds the batch exactly as the trainer's dataset does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.data.dataset import as_messages, left_pad, render_prompt
from hybridflow.data.loader import collate_fn
from hybridflow.protocol import DataProto

Prompt = str | list[dict[str, str]]


def generation_batch(
    prompts: Sequence[Prompt],
    tokenizer: Any,
    apply_chat_template: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> DataProto:
    """Left-padded ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, P)`` (P: the longest prompt)
    for ``prompts``, each a string (one user message) or a list of chat messages ``{"role", "content"}``.

    ``apply_chat_template``: None renders with the tokenizer's chat template when it has one, else joins
    the message contents with newlines (base models). ``non_tensor_batch`` holds ``raw_prompt`` (the
    messages, as reward models and scorers expect) and a ``uid`` per prompt.
    """
    if isinstance(prompts, str | dict):
        raise TypeError("generation_batch takes a list of prompts; wrap a single prompt in a list")
    if not prompts:
        raise ValueError("generation_batch needs at least one prompt")
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token)")
    if apply_chat_template is None:
        apply_chat_template = bool(tokenizer.chat_template)
    messages = [as_messages(prompt, f"prompt {i}") for i, prompt in enumerate(prompts)]
    texts = [render_prompt(tokenizer, m, apply_chat_template, chat_template_kwargs) for m in messages]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    width = max(len(i) for i in ids)
    return collate_fn(
        [{**left_pad(i, width, tokenizer.pad_token_id), "raw_prompt": m} for i, m in zip(ids, messages)]
    )
