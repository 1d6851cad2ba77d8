"""Prompt datasets in verl's row format, read from parquet or JSONL files.

A row: `data_source` (str, picks the reward function), `prompt` (a list of chat messages
`{"role", "content"}`, or a plain string taken as one user message), `ability`, `reward_model`
(`{"style", "ground_truth"}`), `extra_info` (dict, optional). Every row is validated and tokenized
when the dataset is built, so a malformed file fails at once with the file, row and field named,
not halfway through training.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from hybridflow.data.images import IMAGE_MARKER, ImagePrompts, content_text, decode_image, row_images
from hybridflow.models.vision import IMAGES, ImageInput
from hybridflow.utils.errors import InputError, MissingInputError

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")


@dataclass
class PromptRow:
    """One validated row. `row` is its 0-based position in `file` (blank JSONL lines not counted);
    `position` its position over all the dataset's files, before filtering; `raw` the row as the file holds
    it (every column, nested as written)."""

    file: str
    row: int
    position: int
    messages: list[dict[str, str]]
    data_source: str | None
    ground_truth: Any
    extra_info: dict
    raw: dict
    images: list[Any] = field(
        default_factory=list
    )  # as the row gives them (bytes, paths, dicts), marker order


def read_rows(path: str | Path) -> list[dict]:
    """All rows of one parquet (`.parquet`) or JSON-lines (`.jsonl`, `.json`) file, as dicts."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise MissingInputError(f"data file {what}: {path}; check data.train_files / data.val_files")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except pa.ArrowException as e:
            raise InputError(f"{path}: not a readable parquet file ({e})") from e
    if suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(
                        f"{path}: line {line_no} is not valid JSON ({e}): fix or remove that line"
                    ) from e
        return rows
    raise InputError(f"{path}: unknown data file type {suffix!r}; expected .parquet or .jsonl")


def as_messages(value: Any, where: str, images: list[Any] | None = None) -> list[dict[str, str]]:
    """The prompt as chat messages; a plain string becomes one user message. A message's content may be a
    list of OpenAI/TRL content parts, which becomes text with an ``<image>`` marker per image part. With
    ``images``, it gets one entry per marker in order (``content_text``): the image a part carries, or None
    (the row's next image); without, a part that carries an image is refused."""
    collected: list[Any] = []
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InputError(
            f"{where}: must be a string or a non-empty list of chat messages, got {value!r:.200}"
        )
    messages = []
    for i, message in enumerate(value):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = content_text(content, f"{where}[{i}].content", collected)
        elif isinstance(content, str):
            collected += [None] * content.count(IMAGE_MARKER)
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(content, str)
        ):
            raise InputError(
                f"{where}[{i}]: a chat message needs string 'role' and 'content' (or content parts), got "
                f"{message!r:.200}"
            )
        messages.append({"role": message["role"], "content": content})
    if images is not None:
        images += collected
    elif any(image is not None for image in collected):
        raise InputError(
            f"{where}: images inside content parts are not read here; give them in the images column"
        )
    return messages


def parse_row(
    raw: Any, file: str, row: int, position: int, prompt_key: str = "prompt", image_key: str = "images"
) -> PromptRow:
    """Validate one raw row; every error names the file, the row and the field. The prompt's images (in
    marker order): those its content parts carry, and the ``image_key`` column's (``row_images``)."""
    where = f"{file}: row {row}"
    if not isinstance(raw, dict):
        raise InputError(f"{where}: a row must be an object, got {type(raw).__name__}")
    if raw.get(prompt_key) is None:
        raise InputError(
            f"{where}: field {prompt_key!r} is missing or null; every row needs a prompt "
            "(or set data.prompt_key to the field that holds it)"
        )
    inline: list[Any] = []
    messages = as_messages(raw[prompt_key], f"{where}: field {prompt_key!r}", inline)
    images = row_images(inline, raw.get(image_key), where, image_key) if inline or raw.get(image_key) else []
    data_source = raw.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise InputError(f"{where}: field 'data_source' must be a string, got {data_source!r:.200}")
    reward_model = raw.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise InputError(
            f"{where}: field 'reward_model' must be an object with 'ground_truth', got {reward_model!r:.200}"
        )
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise InputError(f"{where}: field 'extra_info' must be an object, got {extra_info!r:.200}")
    ground_truth = reward_model.get("ground_truth")
    return PromptRow(file, row, position, messages, data_source, ground_truth, extra_info, raw, images)


def render_prompt(
    tokenizer,
    messages: list[dict[str, str]],
    apply_chat_template: bool = True,
    chat_template_kwargs: dict | None = None,
) -> str:
    """The prompt text a model sees: the chat template with the assistant generation prompt, or (for base
    models without a template) the message contents joined with newlines."""
    if apply_chat_template:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
        )
    return "\n".join(m["content"] for m in messages)


def tokenize_prompts(
    tokenizer,
    all_messages: Sequence[list[dict[str, str]]],
    apply_chat_template: bool,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[str], list[list[int]]]:
    """``(texts, token ids)`` of prompts as the model sees them (``render_prompt``): the dataset and
    ``hybridflow doctor`` both count prompt tokens with it. A templated prompt holds its special tokens
    already; raw text gets what the tokenizer adds (a base model's BOS), as its plain output would."""
    texts = [render_prompt(tokenizer, m, apply_chat_template, chat_template_kwargs) for m in all_messages]
    ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"] if texts else []
    return texts, ids


def encode_rows(
    tokenizer: Any,
    processor: ImagePrompts | None,
    rows: Sequence[PromptRow],
    apply_chat_template: bool,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[str], list[list[int]], list[list[ImageInput]]]:
    """``(texts, token ids, images)`` of rows as the model sees them: with a vision-language model's
    ``processor`` each image is decoded (an error names the file, row and image) and its placeholder expanded
    to the tokens it takes; a text model refuses rows with images. The dataset and ``hybridflow doctor`` both
    count prompt tokens with it."""
    with_images = next((r for r in rows if r.images), None)
    if with_images is None or processor is None:
        if with_images is not None:
            raise InputError(
                f"{with_images.file}: row {with_images.row}: the row has {len(with_images.images)} image(s) but the "
                "model is a text model (no registered vision-language family); use a vision-language model"
            )
        texts, ids = tokenize_prompts(
            tokenizer, [r.messages for r in rows], apply_chat_template, chat_template_kwargs
        )
        return texts, ids, [[] for _ in rows]
    if not apply_chat_template:
        raise InputError(
            f"{with_images.file}: row {with_images.row}: prompts with images need data.apply_chat_template=true "
            "(the chat template places each image)"
        )
    texts, ids, images = [], [], []
    for r in rows:
        where = f"{r.file}: row {r.row}"
        inputs = [
            processor.image_input(*decode_image(value, f"{where}: image {k}", Path(r.file).parent))
            for k, value in enumerate(r.images)
        ]
        texts.append(processor.render(r.messages, inputs, where, chat_template_kwargs))
        ids.append(tokenizer(texts[-1], add_special_tokens=False)["input_ids"])
        images.append(inputs)
    return texts, ids, images


def left_pad(ids: Sequence[int], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad one prompt to `length`: input_ids, attention_mask and position_ids, each `(length,)`.

    Left padding puts every prompt's last token at the same column, where generation continues.
    Position ids count real tokens only (cumsum of the mask - 1, clipped at 0 on the padding), as
    Hugging Face generation does for left-padded batches.
    """
    n = len(ids)
    input_ids = torch.full((length,), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(length, dtype=torch.long)
    if n:
        input_ids[length - n :] = torch.as_tensor(list(ids), dtype=torch.long)
        attention_mask[length - n :] = 1
    position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


class RLHFDataset(Dataset):
    """Chat prompts from one or more parquet/JSONL files, tokenized and left-padded to `max_prompt_length`.

    `apply_chat_template=True` renders the messages with the tokenizer's chat template and the
    assistant generation prompt; `False` feeds a string prompt as it is and joins chat messages' contents
    with newlines (pre-rendered text, base models without a template). Prompts longer than `max_prompt_length` tokens are dropped when
    `filter_overlong_prompts` (their number is `num_filtered`), otherwise handled by `truncation`:
    "error" raises naming the file and row, "left" keeps the last tokens, "right" the first.
    `chat_template_kwargs` go to `apply_chat_template` (e.g. a model's `enable_thinking`).

    Images (verl's format): `<image>` markers in the messages (or content parts), the images in the row's
    `image_key` column (a list of `{"bytes": ...}`, `{"path": ...}`, bytes or paths; relative paths from the
    data file's folder). With a vision-language model's `processor` every image is decoded and counted when
    the dataset is built (its tokens count against `max_prompt_length`; truncation never cuts into an image),
    and each item carries its images as `image_inputs` (`ImageInput`s, processed again from the encoded bytes
    kept here, so the dataset holds no pixel arrays).
    """

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer,
        max_prompt_length: int = 512,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        apply_chat_template: bool = True,
        chat_template_kwargs: dict | None = None,
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; expected one of {TRUNCATION_MODES}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token)"
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.processor = processor
        files = [data_files] if isinstance(data_files, str | Path) else list(data_files)
        if not files:
            raise ValueError("RLHFDataset needs at least one data file")
        raw_rows = []
        for path in files:
            rows_of_file = read_rows(path)
            if not rows_of_file:
                raise InputError(f"{path}: the file has no rows; give a file with prompts in it")
            raw_rows += [(str(path), i, raw) for i, raw in enumerate(rows_of_file)]
        rows = [
            parse_row(raw, path, i, pos, prompt_key, image_key) for pos, (path, i, raw) in enumerate(raw_rows)
        ]
        _, token_ids, images = encode_rows(
            tokenizer, processor, rows, apply_chat_template, self.chat_template_kwargs
        )
        for row, inputs in zip(rows, images):  # the encoded bytes, decoded again per item
            row.images = [image.data for image in inputs]
        self.rows, self.prompt_ids, self.num_filtered = self._fit(rows, token_ids, filter_overlong_prompts)
        if not self.rows:
            raise InputError(
                f"no prompts left in {files}: all {len(rows)} are longer than {max_prompt_length} tokens; "
                "raise data.max_prompt_length or set data.filter_overlong_prompts=false with a truncation"
            )

    def _fit(
        self, rows: list[PromptRow], token_ids: list[list[int]], filter_overlong: bool
    ) -> tuple[list[PromptRow], list[list[int]], int]:
        """Drop or truncate prompts longer than max_prompt_length; returns kept rows, their ids, #dropped."""
        limit = self.max_prompt_length
        kept_rows, kept_ids, dropped = [], [], []
        for row, ids in zip(rows, token_ids):
            if len(ids) > limit:
                if filter_overlong:
                    dropped.append(row)
                    continue
                if self.truncation == "error":
                    raise InputError(
                        f"{row.file}: row {row.row}: prompt has {len(ids)} tokens, more than "
                        f"max_prompt_length={limit}; raise it, set truncation to 'left'/'right' "
                        f"or filter_overlong_prompts=True"
                    )
                kept = ids[-limit:] if self.truncation == "left" else ids[:limit]
                processor = self.processor  # set when a row has images
                image_token = processor.image_token_id if processor is not None else -1
                if row.images and kept.count(image_token) < ids.count(image_token):
                    raise InputError(
                        f"{row.file}: row {row.row}: prompt has {len(ids)} tokens (images included), more than "
                        f"max_prompt_length={limit}, and truncation would cut into an image; raise "
                        "data.max_prompt_length or set filter_overlong_prompts=True"
                    )
                ids = kept
            kept_rows.append(row)
            kept_ids.append(ids)
        if dropped:
            shown = ", ".join(f"{r.file}:{r.row}" for r in dropped[:5])
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d (first: %s)",
                len(dropped),
                len(rows),
                limit,
                shown,
            )
        return kept_rows, kept_ids, len(dropped)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        """One prompt: `input_ids`, `attention_mask`, `position_ids` (each `(max_prompt_length,)`, left
        padded) plus `raw_prompt` (the messages, `<image>` markers in place), `data_source`, `ground_truth`,
        `extra_info`, `index` (extra_info["index"] when the row has one, else the row's position over all files)
        and `data_row` (the row as the file holds it: what a served agent gets as its sample); with a
        vision-language processor, `image_inputs` (the row's images, maybe none)."""
        row = self.rows[idx]
        item: dict[str, Any] = left_pad(
            self.prompt_ids[idx], self.max_prompt_length, self.tokenizer.pad_token_id
        )
        item.update(
            raw_prompt=row.messages,
            data_source=row.data_source,
            ground_truth=row.ground_truth,
            extra_info=row.extra_info,
            index=row.extra_info.get("index", row.position),
            data_row=row.raw,
        )
        if self.processor is not None:
            where = f"{row.file}: row {row.row}"
            item[IMAGES] = tuple(
                self.processor.image_input(*decode_image(data, f"{where}: image {k}"))
                for k, data in enumerate(row.images)
            )
        return item
