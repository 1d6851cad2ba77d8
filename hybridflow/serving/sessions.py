"""What each session's calls sampled, and the training rows built from exactly those tokens.

Every call the server answers is recorded under its session (its base URL ``/sessions/<id>/v1`` or its
``X-Session-Id`` header): the prompt ids the engine saw, the ids it sampled and their log-probs. The
training batch is built from these records, never from re-encoded text (re-tokenizing a conversation can
give other tokens than the ones sampled, and their log-probs would then belong to tokens never drawn).

A chat call that continues an earlier one of its session (the same messages, the model's reply, then new
tool or user messages) gets as its prompt the earlier prompt ids + the sampled ids + only the tokens of
what the template adds after them, when the template renders append-only (``TemplateDelta``'s check):
so the new prompt extends the old prompt + response token for token. ``sequences`` then joins such calls
into one sample whose added tokens are masked out of ``response_mask``; calls that do not extend an
earlier one (another template, an agent that summarises or starts over) become samples of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridflow.models.vision import ImageInput
from hybridflow.rollout.chat_template import Messages, TemplateDelta, render_chat
from hybridflow.utils.errors import UserError


@dataclass
class CallRecord:
    """One sampled continuation of one call: ``prompt_ids`` -> ``token_ids`` (with ``log_probs``)."""

    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    weight_version: int
    images: tuple[ImageInput, ...] = ()  # the prompt's images


@dataclass
class ChatTurn:
    """A chat call's messages (as the template took them) and the sample the agent may continue."""

    messages: Messages
    reply: str
    prompt_ids: list[int]
    token_ids: list[int]
    ended_by_eos: bool
    ended_by_length: bool


@dataclass
class Session:
    """One session's calls: what each sampled (``records``) and the chat turns it may continue."""

    records: list[CallRecord] = field(default_factory=list)
    turns: list[ChatTurn] = field(default_factory=list)


class ChatPrompter:
    """Prompt ids for a chat call; continues the session's earlier turns token for token when it can."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.eos_text = str(tokenizer.decode([eos_token_id]))  # one id: one string
        try:
            self.turn_end: str | None = TemplateDelta(tokenizer, None, eos_token_id).turn_end
        except UserError:  # not append-only: every call is rendered afresh and becomes its own sample
            self.turn_end = None

    def render(self, messages: Messages, tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The chat template's text of ``messages`` (with ``tools``)."""
        return render_chat(self.tokenizer, messages, generation_prompt, tools)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added (the template wrote them)."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def prompt_ids(
        self, messages: Messages, tools: list[dict[str, Any]], session: Session | None
    ) -> list[int]:
        """The call's prompt ids: an earlier turn of ``session`` continued token for token when the call
        extends it (see the module's docstring), else the rendering of ``messages`` encoded afresh."""
        for turn in reversed(session.turns if session and self.turn_end is not None else []):
            ids = self._continued(turn, messages, tools)
            if ids is not None:
                return ids
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def _continued(self, turn: ChatTurn, messages: Messages, tools: list[dict[str, Any]]) -> list[int] | None:
        k, turn_end = len(turn.messages), self.turn_end
        if turn_end is None or not (turn.ended_by_eos or turn.ended_by_length) or len(messages) <= k + 1:
            return None
        if messages[:k] != turn.messages or messages[k] != {"role": "assistant", "content": turn.reply}:
            return None
        before = self.render(messages[: k + 1], tools, generation_prompt=False)
        after = self.render(messages, tools, generation_prompt=True)
        if not after.startswith(before):
            return None
        added = ("" if turn.ended_by_eos else self.eos_text) + turn_end + after[len(before) :]
        return turn.prompt_ids + turn.token_ids + self.encode(added)


@dataclass
class Sequence:
    """One training sample: ``prompt_ids``, then ``ids`` with ``mask`` 1 on sampled tokens."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    calls: int = 0
    images: tuple[ImageInput, ...] = ()  # the prompt's images: a later call joins only with the same images

    @property
    def all_ids(self) -> list[int]:
        """The prompt and every token after it."""
        return self.prompt_ids + self.ids

    def add(self, record: CallRecord) -> None:
        """``record``'s prompt past what this sequence holds (masked), then its sampled tokens."""
        added = record.prompt_ids[len(self.all_ids) :]
        self.ids += added + record.token_ids
        self.mask += [0] * len(added) + [1] * len(record.token_ids)
        self.log_probs += [0.0] * len(added) + record.log_probs
        self.calls += 1


def sequences(records: list[CallRecord]) -> list[Sequence]:
    """The session's calls as samples: each call joins the longest earlier sample whose ids its prompt
    starts with, token for token, else starts a sample of its own."""
    out: list[Sequence] = []
    for record in records:
        fits = [
            s for s in out if record.prompt_ids[: len(s.all_ids)] == s.all_ids and s.images == record.images
        ]
        target = max(fits, key=lambda s: len(s.all_ids)) if fits else None
        if target is None:
            target = Sequence(list(record.prompt_ids), images=record.images)
            out.append(target)
        target.add(record)
    return out
