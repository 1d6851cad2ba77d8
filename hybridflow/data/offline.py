"""Datasets for the offline trainers (SFT, DPO, KTO), laid out like rollouts.

Every sample becomes a prompt and a response: ``input_ids``/``attention_mask``/``position_ids`` over the
left-padded prompt plus the right-padded response, ``responses`` and a ``response_mask`` marking the tokens
whose log-likelihood counts. So the actor scores demonstrations and preference pairs with the very
``response_log_probs`` it scores its own samples with, and the reference worker's ``compute_ref_log_prob``
works unchanged.

Row formats (parquet or JSONL; prompts and completions are strings or chat messages, as in TRL):
- SFT: ``{prompt, response}`` or a conversation ``{messages: [...]}``. The loss covers the assistant turns
  only: everything up to the first assistant turn is the prompt, and later user/system/tool turns sit in
  the response with mask 0.
- Preferences (DPO): ``{prompt, chosen, rejected}``; a batch interleaves ``chosen_0, rejected_0, ...``.
- Reward model: ``{prompt, chosen, rejected}`` and an optional ``margin`` (``RewardPairDataset``: each side is
  one whole sequence, what the reward model reads).
- KTO: ``{prompt, completion, label}`` (``label`` true for a desirable completion); a batch of ``B`` rows
  carries ``2B`` samples: the rows, then each prompt with the next row's completion (the mismatched pairs
  whose log-ratio estimates KTO's KL reference point).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.dataset import TRUNCATION_MODES, as_messages, read_rows
from hybridflow.data.images import (
    IMAGE_MARKER,
    ImagePrompts,
    as_parts,
    decode_image,
    marker_count,
    row_images,
)
from hybridflow.models.vision import IMAGES, ImageInput
from hybridflow.protocol import DataProto
from hybridflow.utils.errors import InputError


@dataclass
class Sample:
    """One tokenized prompt + response; ``loss_mask`` (0/1 per response token) marks what is trained on."""

    prompt: list[int]
    response: list[int]
    loss_mask: list[int]
    label: int = 0
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in the order of their tokens


class Conversations:
    """Renders chat messages with the tokenizer's template and splits them into a prompt and a response.

    Why turn by turn: the template decides where each turn's tokens start and end, so the prompt is the
    rendering up to the first assistant turn with the generation prompt (what the model sees when it
    answers), and each later turn is the difference between consecutive renderings. A template whose
    renderings are not prefixes of each other cannot be split this way and is refused."""

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        truncation: str = "error",
        processor: ImagePrompts | None = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; expected one of {TRUNCATION_MODES}")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token)"
            )
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.processor = processor  # a vision-language model's: <image> markers become its image parts
        self.eos = tokenizer.eos_token or ""

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            as_parts(messages) if self.processor is not None else messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def encode(
        self,
        messages: list[dict[str, str]],
        where: str,
        prompt_turns: int | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> Sample:
        """Prompt = the first ``prompt_turns`` messages (default: those before the first assistant turn; a
        prompt may hold assistant turns, e.g. a one-shot example, that are context, not targets); response =
        the rest up to the last assistant turn, loss on its assistant turns' tokens (their end-of-turn token
        included, what follows it not). ``images``: the prompt's, one per ``<image>`` marker in it (TRL's
        vision formats put every image in the prompt)."""
        assistant = [
            i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= (prompt_turns or 0)
        ]
        if not assistant or assistant[0] == 0:
            raise ValueError(
                f"{where}: a conversation needs a turn before the first assistant turn and at least "
                f"one assistant turn; roles are {[m['role'] for m in messages]}"
            )
        first = assistant[0] if prompt_turns is None else prompt_turns
        if marker_count(messages[first:]) or marker_count(messages[:first]) != len(images):
            raise InputError(
                f"{where}: the prompt has {marker_count(messages[:first])} {IMAGE_MARKER} placeholder(s) and the "
                f"completion {marker_count(messages[first:])} for {len(images)} image(s); put one {IMAGE_MARKER} "
                "in the prompt where each image goes"
            )
        prompt_text = previous = self._render(messages[:first], generation_prompt=True)
        pieces: list[tuple[str, int]] = []
        for j in range(first, assistant[-1] + 1):
            if messages[j]["role"] == "assistant" and j > first:
                opened = self._render(messages[:j], generation_prompt=True)
                pieces.append((self._after(opened, previous, where), 0))
                previous = opened
            text = self._render(messages[: j + 1])
            piece = self._after(text, previous, where)
            if messages[j]["role"] == "assistant" and self.eos and self.eos in piece:
                cut = piece.rindex(self.eos) + len(self.eos)
                pieces += [(piece[:cut], 1), (piece[cut:], 0)]
            else:
                pieces.append((piece, int(messages[j]["role"] == "assistant")))
            previous = text
        if images:
            if self.processor is None:  # the dataset refuses a row's images without one first
                raise ValueError(f"{where}: the row has images but the model is a text model")
            prompt_text = self.processor.expand(prompt_text, images, where)
        prompt, response, mask = self._ids(prompt_text), [], []
        for text, trained in pieces:
            ids = self._ids(text)
            response += ids
            mask += [trained] * len(ids)
        return self._fit(Sample(prompt, response, mask, images=tuple(images)), where)

    def encode_text(self, prompt: str, completion: str, where: str) -> Sample:
        """Strings fed as they are (``data.apply_chat_template=false``: pre-rendered text, base models): the
        prompt's ids are the tokenizer's plain output, the response's the completion's plus EOS (so the model
        learns to stop), every response token trained."""
        response = self._ids(completion) + [self.tokenizer.eos_token_id]
        return self._fit(Sample(self.tokenizer(prompt)["input_ids"], response, [1] * len(response)), where)

    @staticmethod
    def _after(text: str, prefix: str, where: str) -> str:
        if not text.startswith(prefix):
            raise ValueError(
                f"{where}: the chat template renders a conversation differently from its beginning, "
                "so the turns cannot be split into prompt and response"
            )
        return text[len(prefix) :]

    def _fit(self, sample: Sample, where: str) -> Sample:
        """Apply ``truncation`` when prompt + response exceed ``max_length``: ``error`` raises, ``left`` drops
        the prompt's first tokens, ``right`` the response's last ones."""
        excess = len(sample.prompt) + len(sample.response) - self.max_length
        if excess <= 0:
            return sample
        if self.truncation == "error":
            raise ValueError(
                f"{where}: {len(sample.prompt)} prompt + {len(sample.response)} response tokens exceed "
                f"max_length={self.max_length}; raise data.max_length or set data.truncation to "
                "'left' or 'right'"
            )
        if self.truncation == "left" and excess < len(sample.prompt):
            if sample.images:
                raise ValueError(
                    f"{where}: {len(sample.prompt)} prompt tokens (images included) + {len(sample.response)} "
                    f"response tokens exceed max_length={self.max_length}, and truncation 'left' would cut into an "
                    "image; raise data.max_length"
                )
            sample.prompt = sample.prompt[excess:]
        else:
            keep = max(self.max_length - len(sample.prompt), 1)
            sample.response, sample.loss_mask = sample.response[:keep], sample.loss_mask[:keep]
        return sample


def collate_samples(samples: Sequence[Sample], pad_id: int) -> DataProto:
    """Samples -> a DataProto as the rollout produces it: prompts left-padded to the batch's longest,
    responses right-padded to the longest: ``input_ids``/``attention_mask``/``position_ids`` ``(bs, P + R)``,
    ``responses``/``response_mask`` ``(bs, R)``, ``label`` ``(bs,)``, and ``image_inputs`` (each row's
    images) when a sample has images."""
    width_p = max(len(s.prompt) for s in samples)
    width_r = max(max(len(s.response) for s in samples), 1)
    size = len(samples)
    prompts = torch.full((size, width_p), pad_id, dtype=torch.long)
    responses = torch.full((size, width_r), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(size, width_p, dtype=torch.long)
    response_attention = torch.zeros(size, width_r, dtype=torch.long)
    response_mask = torch.zeros(size, width_r, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.prompt:
            prompts[i, width_p - len(s.prompt) :] = torch.tensor(s.prompt)
            prompt_mask[i, width_p - len(s.prompt) :] = 1
        if s.response:
            responses[i, : len(s.response)] = torch.tensor(s.response)
            response_attention[i, : len(s.response)] = 1
            response_mask[i, : len(s.response)] = torch.tensor(s.loss_mask)
    attention = torch.cat([prompt_mask, response_attention], dim=1)
    images = {IMAGES: [s.images for s in samples]} if any(s.images for s in samples) else {}
    return DataProto.from_dict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "label": torch.tensor([s.label for s in samples], dtype=torch.long),
        },
        images,
    )


# a prompt or completion: chat messages, or with apply_chat_template=False a string fed as it is
Text = list[dict[str, str]] | str


class OfflineDataset(Dataset):
    """Rows of parquet/JSONL files, each validated and tokenized into samples when the dataset is built, so
    a malformed row fails at once with its file, row and field named. Subclasses say how a row becomes
    samples (``encode_row``) and how items become a batch (``collate``). ``apply_chat_template=False``
    feeds string prompts and completions as they are instead of chat-templating them."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        apply_chat_template: bool = True,
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        self.conversations = Conversations(tokenizer, max_length, truncation, processor)
        self.pad_id = tokenizer.pad_token_id
        self.prompt_key, self.apply_chat_template = prompt_key, apply_chat_template
        self.processor, self.image_key = processor, image_key
        files = [data_files] if isinstance(data_files, str | Path) else list(data_files)
        if not files:
            raise ValueError(f"{type(self).__name__} needs at least one data file")
        self.items: list[list[Sample]] = []
        for path in files:
            self.base_dir = Path(path).parent  # relative image paths start here
            for i, row in enumerate(read_rows(path)):
                where = f"{path}: row {i}"
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
                self.items.append(self.encode_row(row, where))
        if not self.items:
            raise ValueError(f"no rows in {[str(f) for f in files]}")

    def _field(self, row: dict, key: str, where: str) -> Any:
        if row.get(key) is None:
            raise ValueError(f"{where}: field {key!r} is missing (present: {sorted(row)})")
        return row[key]

    def _prompt(self, row: dict, where: str, key: str | None = None) -> Text:
        key = key or self.prompt_key
        value = self._field(row, key, where)
        if not self.apply_chat_template:
            return self._raw(value, key, where)
        return as_messages(value, f"{where}: field {key!r}", [])

    def _images(self, row: dict, where: str, key: str | None = None) -> tuple[ImageInput, ...]:
        """The images of the row's prompt (field ``key``): those its content parts carry and the
        ``image_key`` column's, in marker order, decoded; a text model refuses them."""
        key = key or self.prompt_key
        inline: list[Any] = []
        if self.apply_chat_template and not isinstance(row.get(key), str | None):
            as_messages(row[key], f"{where}: field {key!r}", inline)
        elif isinstance(row.get(key), str):
            inline = [None] * row[key].count(IMAGE_MARKER)
        if not inline and not row.get(self.image_key):
            return ()
        values = row_images(inline, row.get(self.image_key), where, self.image_key)
        if self.processor is None:
            raise ValueError(f"{where}: the row has {len(values)} image(s) but the model is a text model")
        if not self.apply_chat_template:
            raise ValueError(f"{where}: prompts with images need data.apply_chat_template=true")
        return tuple(
            self.processor.image_input(*decode_image(v, f"{where}: image {k}", self.base_dir))
            for k, v in enumerate(values)
        )

    def _completion(self, row: dict, key: str, where: str) -> Text:
        """A completion: a string (one assistant turn) or chat messages."""
        value = self._field(row, key, where)
        if not self.apply_chat_template:
            return self._raw(value, key, where)
        if isinstance(value, str):
            return [{"role": "assistant", "content": value}]
        return as_messages(value, f"{where}: field {key!r}")

    @staticmethod
    def _raw(value: Any, key: str, where: str) -> str:
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: field {key!r} must be a string with data.apply_chat_template=false (strings are fed "
                f"as they are), got {type(value).__name__}; set data.apply_chat_template=true for chat messages"
            )
        return value

    def _encode(
        self, prompt: Text, completion: Text, where: str, images: tuple[ImageInput, ...] = ()
    ) -> Sample:
        """One prompt (with its images) and completion: chat-templated turn by turn, or strings as they are."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return self.conversations.encode_text(prompt, completion, where)
        if isinstance(prompt, str) or isinstance(completion, str):  # one setting makes both (chat or not)
            raise ValueError(f"{where}: the prompt and the completion must both be text or both be messages")
        return self.conversations.encode(prompt + completion, where, len(prompt), images)

    def encode_row(self, row: dict, where: str) -> list[Sample]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> list[Any]:
        """Row ``idx``'s samples (a dataset whose ``collate`` needs more adds it, as KTO's row index)."""
        return self.items[idx]

    def collate(self, items: Sequence[list[Sample]]) -> DataProto:
        """Every item's samples in order (a DPO item's chosen then rejected: the interleaved layout)."""
        return collate_samples([s for item in items for s in item], self.pad_id)


class SFTConversationDataset(OfflineDataset):
    """Demonstrations: ``{prompt, response}`` rows or ``{messages}`` conversations (``messages_key``)."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        apply_chat_template: bool = True,
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        self.response_key, self.messages_key = response_key, messages_key
        super().__init__(
            data_files,
            tokenizer,
            max_length,
            truncation,
            prompt_key,
            apply_chat_template,
            processor,
            image_key,
        )

    def encode_row(self, row: dict, where: str) -> list[Sample]:
        if row.get(self.messages_key) is not None:
            if not self.apply_chat_template:
                self._raw(row[self.messages_key], self.messages_key, where)  # a conversation is not a string
            messages = as_messages(row[self.messages_key], f"{where}: field {self.messages_key!r}", [])
            return [
                self.conversations.encode(messages, where, images=self._images(row, where, self.messages_key))
            ]
        prompt, images = self._prompt(row, where), self._images(row, where)
        return [self._encode(prompt, self._completion(row, self.response_key, where), where, images)]


class PreferenceDataset(OfflineDataset):
    """Preference pairs ``{prompt, chosen, rejected}``; an item is ``[chosen, rejected]``."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        apply_chat_template: bool = True,
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        self.chosen_key, self.rejected_key = chosen_key, rejected_key
        super().__init__(
            data_files,
            tokenizer,
            max_length,
            truncation,
            prompt_key,
            apply_chat_template,
            processor,
            image_key,
        )

    def encode_row(self, row: dict, where: str) -> list[Sample]:
        prompt, images = self._prompt(row, where), self._images(row, where)
        return [
            self._encode(prompt, self._completion(row, key, where), f"{where} ({key})", images)
            for key in (self.chosen_key, self.rejected_key)
        ]


def reward_model_tokens(tokenizer: Any, prompt: Text, completion: Text) -> list[int]:
    """The tokens a reward model reads for a prompt and a completion, in its training (``hybridflow rm``) and
    when it scores a policy's responses alike: the whole conversation rendered by the chat template and
    tokenized as one text, or for strings (no template) the prompt, a newline and the completion, with the
    tokenizer's special tokens (what a plain classifier expects)."""
    if isinstance(prompt, str) or isinstance(completion, str):  # both text, or both messages
        return tokenizer(f"{prompt}\n{completion}")["input_ids"]
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class RewardPairDataset(OfflineDataset):
    """Preference pairs for a reward model: ``{prompt, chosen, rejected}`` (strings or chat messages, TRL's
    explicit-prompt format) and TRL's optional ``margin_key`` (how much more the chosen one is preferred; 0
    when a row has none). Each side is one sequence (``reward_model_tokens``; laid out as a response with an
    empty prompt); a batch interleaves ``chosen_0, rejected_0, ...`` and carries ``margin`` ``(2B,)``, each
    pair's on both its rows. Over ``max_length``: ``truncation`` left drops a sequence's first tokens (the
    reward is read at its end), right its last ones."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        apply_chat_template: bool = True,
        margin_key: str = "margin",
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.chosen_key, self.rejected_key, self.margin_key = chosen_key, rejected_key, margin_key
        self.margins: list[float] = []  # one per row, in the order of ``items``
        super().__init__(
            data_files,
            tokenizer,
            max_length,
            truncation,
            prompt_key,
            apply_chat_template,
            processor,
            image_key,
        )

    def _sequence(self, prompt: Text, completion: Text, where: str) -> Sample:
        ids = reward_model_tokens(self.tokenizer, prompt, completion)
        excess = len(ids) - self.max_length
        if excess > 0 and self.truncation == "error":
            raise ValueError(
                f"{where}: {len(ids)} tokens exceed max_length={self.max_length}; raise data.max_length or set "
                "data.truncation to 'left' or 'right'"
            )
        if excess > 0:
            ids = ids[excess:] if self.truncation == "left" else ids[: self.max_length]
        return Sample([], ids, [1] * len(ids))

    def encode_row(self, row: dict, where: str) -> list[Sample]:
        if row.get(self.image_key) is not None and len(row[self.image_key]):
            raise ValueError(
                f"{where}: a reward model trains on text pairs only; this row has images ({self.image_key!r})"
            )
        margin = row.get(self.margin_key)
        margin = 0.0 if margin is None else margin
        if isinstance(margin, bool) or not isinstance(margin, int | float):
            raise ValueError(f"{where}: field {self.margin_key!r} must be a number, got {margin!r:.60}")
        prompt = self._prompt(row, where)
        pair = [
            self._sequence(prompt, self._completion(row, key, where), f"{where} ({key})")
            for key in (self.chosen_key, self.rejected_key)
        ]
        self.margins.append(float(margin))
        return pair

    def __getitem__(self, idx: int) -> list[Any]:
        """``[chosen, rejected, idx]``: the collate looks the pair's margin up by ``idx``."""
        return [*self.items[idx], idx]

    def collate(self, items: Sequence[list[Any]]) -> DataProto:
        batch = collate_samples([s for item in items for s in item[:2]], self.pad_id)
        batch.tensors["margin"] = torch.tensor([self.margins[item[2]] for item in items for _ in range(2)])
        return batch


class KTODataset(OfflineDataset):
    """Unpaired completions ``{prompt, completion, label}``; ``label`` true marks a desirable completion."""

    def __init__(
        self,
        data_files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_length: int = 1024,
        truncation: str = "error",
        prompt_key: str = "prompt",
        completion_key: str = "completion",
        label_key: str = "label",
        apply_chat_template: bool = True,
        processor: ImagePrompts | None = None,
        image_key: str = "images",
    ) -> None:
        self.completion_key, self.label_key = completion_key, label_key
        self.prompts: list[Text] = []
        self.prompt_images: list[tuple[ImageInput, ...]] = []
        self.completions: list[Text] = []
        super().__init__(
            data_files,
            tokenizer,
            max_length,
            truncation,
            prompt_key,
            apply_chat_template,
            processor,
            image_key,
        )

    def encode_row(self, row: dict, where: str) -> list[Sample]:
        label = self._field(row, self.label_key, where)
        if not isinstance(label, bool):
            raise ValueError(f"{where}: field {self.label_key!r} must be true or false, got {label!r}")
        self.prompts.append(self._prompt(row, where))
        self.prompt_images.append(self._images(row, where))
        self.completions.append(self._completion(row, self.completion_key, where))
        sample = self._encode(self.prompts[-1], self.completions[-1], where, self.prompt_images[-1])
        sample.label = int(label)
        return [sample]

    def __getitem__(self, idx: int) -> list[Any]:
        """``[sample]``; the collate needs the row's messages for the mismatched pairs, so it gets ``idx`` too."""
        return [*self.items[idx], idx]

    def collate(self, items: Sequence[list[Any]]) -> DataProto:
        """``2B`` samples: the ``B`` rows, then row ``i``'s prompt with row ``i+1``'s completion (mod ``B``)."""
        rows = [item[0] for item in items]
        indices = [item[1] for item in items]
        if len(rows) < 2:
            raise ValueError(
                "KTO needs at least 2 rows per batch to pair prompts with other rows' completions"
            )
        mismatched = [
            self._encode(
                self.prompts[i],
                self.completions[indices[(k + 1) % len(rows)]],
                "a mismatched KTO pair",
                self.prompt_images[i],
            )
            for k, i in enumerate(indices)
        ]
        return collate_samples(rows + mismatched, self.pad_id)
