"""Growing a conversation token by token through the chat template, and checking that this is sound.

The agent loop keeps the model's own sampled tokens (retokenizing its text could change them, and the
log-probs would then belong to other tokens) and appends only the tokens of what comes after: the end
of the assistant turn, the tool messages and the next generation prompt. Those are found as a text
difference between two renderings of the conversation, which is right only if the template renders
append-only: the rendering of a conversation is a prefix of the rendering of any continuation of it.
ChatML templates (SmolLM2, Qwen2.5, the tiny test model) are; templates that rewrite earlier turns
(e.g. dropping past reasoning, as Qwen3's does) or put the end-of-turn token elsewhere are not, and
``TemplateDelta`` refuses them once per tokenizer with the turn where the rendering changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from hybridflow.utils.errors import UserError

Messages = list[dict[str, Any]]

_PROBE: Messages = [
    {"role": "user", "content": "What is 12*34?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
    },
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "12*34=408"},
]


class TemplateDelta:
    """Token ids to append after an assistant turn the model ended with its EOS token.

    ``tools``: schemas passed to the template (templates without tool support ignore them)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: list[dict[str, Any]] | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_text = tokenizer.decode([eos])
        self.turn_end = self._check_append_only()

    def render(self, messages: Messages, generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with the tools it was given)."""
        return render_chat(self.tokenizer, messages, generation_prompt, self.tools)

    def _check_append_only(self) -> str:
        """Render the probe turn by turn; returns what the template writes after an assistant turn's EOS."""
        name = self.tokenizer.name_or_path or type(self.tokenizer).__name__
        for k in range(1, len(_PROBE)):
            before = self.render(_PROBE[:k], generation_prompt=_PROBE[k]["role"] == "assistant")
            after = self.render(_PROBE[: k + 1], generation_prompt=False)
            if not after.startswith(before):
                raise UserError(
                    f"the chat template of {name} is not append-only: adding a {_PROBE[k]['role']!r} message "
                    f"after {len(_PROBE[:k])} message(s) rewrites what was rendered before, so multi-turn "
                    "rollouts cannot keep the model's tokens; use a ChatML-style template (e.g. set "
                    "tokenizer.chat_template) or turn actor_rollout_ref.rollout.multi_turn.enable off"
                )
        prompt = self.render(_PROBE[:1], generation_prompt=True)
        turn = self.render(_PROBE[:2], generation_prompt=False)[len(prompt) :]
        content = _PROBE[1]["content"]
        if not turn.startswith(content + self.eos_text):
            raise UserError(
                f"the chat template of {name} does not end an assistant turn with the EOS token "
                f"{self.eos_text!r} right after its content (it renders {turn!r}); the agent loop "
                "needs the model's EOS to close its turn"
            )
        return turn[len(content) + len(self.eos_text) :]

    def after_assistant(self, messages: Messages, new_messages: Messages) -> list[int]:
        """Tokens after the EOS that ended ``messages[-1]`` (an assistant turn): its turn end, ``new_messages``
        (tool results) and the generation prompt for the next assistant turn."""
        before = self.render(messages, generation_prompt=False)
        after = self.render(messages + new_messages, generation_prompt=True)
        if not after.startswith(before):
            raise UserError(
                "the chat template rewrote earlier turns of a conversation (not append-only); "
                f"the last message was {messages[-1]!r:.200}"
            )
        text = self.turn_end + after[len(before) :]
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """The chat template's text of ``messages`` (with ``tools``, none when empty), the generation prompt
    appended when ``generation_prompt``."""
    schemas: list[dict[str, Any] | Callable[..., Any]] | None = list(tools) if tools else None
    text = tokenizer.apply_chat_template(
        messages, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt
    )
    if not isinstance(text, str):  # tokenize=False renders text; the signature covers every mode
        raise TypeError(f"apply_chat_template(tokenize=False) returned a {type(text).__name__}")
    return text
