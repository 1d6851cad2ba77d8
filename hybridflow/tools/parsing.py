"""Finding tool calls in the model's text: Hermes style, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

This is the format the chat templates of Qwen2.5 and SmolLM2 teach. One reply may hold several calls;
each is parsed on its own, so one malformed call does not hide the well-formed ones beside it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
FORMATS = ("hermes",)


@dataclass
class ToolCall:
    """One call: ``name`` and ``arguments`` when well formed, else ``error`` says what is wrong."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "error": self.error}


def _parse_block(body: str, closed: bool) -> ToolCall:
    text = body.strip()
    if not closed:
        return ToolCall(None, error=f"{OPEN} without a closing {CLOSE}", text=text)
    try:
        call = json.loads(text)
    except json.JSONDecodeError as err:
        return ToolCall(
            None, error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})", text=text
        )
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, error='a tool call must be a JSON object with a string "name"', text=text)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(call["name"], error='"arguments" is a string that is not JSON', text=text)
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], error='"arguments" must be a JSON object', text=text)
    return ToolCall(call["name"], arguments, text=text)


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text`` in order (malformed ones carry ``error``); an
    unclosed last one counts as malformed. No tag, no calls: the reply is a final answer."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {FORMATS}")
    calls = []
    for match in _BLOCK.finditer(text):
        closed = match.group(0).endswith(CLOSE)
        calls.append(_parse_block(match.group(1), closed))
    return calls
