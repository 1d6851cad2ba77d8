"""The tool interface the agent loop calls (``registry.py`` loads the tools a run offers).

A tool is a class with a name, a description and a JSON-schema ``parameters`` (together its schema in
OpenAI function format, which chat templates that support tools render into the prompt) and three
methods: ``create`` when a conversation starts, ``execute`` for each call, ``release`` when the
conversation ends (per-conversation state, e.g. a scratch folder, lives between the two).

``execute`` returns ``(text, reward, metrics)``: the text becomes the tool message the model reads next,
the reward is kept with the conversation (a reward function may add it), the metrics are logged. Raise
``ToolError`` for a failure the model should read about ("division by zero"); the agent loop turns it,
and any other exception, into an ``Error: ...`` tool message and counts it in ``agent/tool_errors``.
"""

from __future__ import annotations

from typing import Any, ClassVar

ToolOutput = tuple[str, float, dict[str, float]]


class ToolError(Exception):
    """A failure the model caused and should read about (bad arguments, an expression that fails)."""


class BaseTool:
    """Subclass with ``name``, ``description``, ``parameters`` and ``execute``; see the module docstring."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        self.config = dict(config or {})
        self._schema = tool_schema

    @property
    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return self._schema or {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def tool_name(self) -> str:
        """The name the model calls it by (the schema's, which a YAML ``tool_schema`` may change)."""
        name: str = self.schema["function"]["name"]
        return name

    def create(self, instance_id: str) -> None:
        """A conversation ``instance_id`` starts that may call this tool."""

    def execute(self, args: dict[str, Any], instance_id: str) -> ToolOutput:
        """Run one call with the model's ``args``; returns ``(text, reward, metrics)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute(args, instance_id)")

    def release(self, instance_id: str) -> None:
        """The conversation ``instance_id`` ended: free what ``create`` or ``execute`` kept for it."""
