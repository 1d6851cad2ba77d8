"""``python``: runs model-written code in the sandbox and returns what it printed."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from hybridflow.tools.base import BaseTool, ToolError, ToolOutput
from hybridflow.tools.sandbox import SandboxLimits, run_python, sandbox_mode
from hybridflow.utils.errors import UserError


class PythonTool(BaseTool):
    """``{"code": "print(2**10)"}`` -> ``"1024"``. ``config`` takes any ``SandboxLimits`` field
    (``timeout_s``, ``cpu_s``, ``memory_mb``, ``file_size_mb``, ``max_processes``, ``max_output_bytes``...).

    It refuses to be built where this machine can create no sandbox (``SandboxUnavailable``, before the run
    starts rather than at the first call), unless ``allow_unsafe``
    (``sandbox.unsafe_without_isolation``)."""

    name: ClassVar[str] = "python"
    description: ClassVar[str] = (
        "Run a Python script (standard library only, no network, no files kept) and return what it prints."
    )
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python code; print the result"}},
        "required": ["code"],
    }

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        tool_schema: dict[str, Any] | None = None,
        allow_unsafe: bool = False,
    ) -> None:
        super().__init__(config, tool_schema)
        known = {f.name for f in dataclasses.fields(SandboxLimits)}
        unknown = set(self.config) - known
        if unknown:
            raise UserError(f"python tool config: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        self.limits = SandboxLimits(**self.config)
        self.allow_unsafe = allow_unsafe
        sandbox_mode(allow_unsafe)

    def execute(self, args: dict[str, Any], instance_id: str) -> ToolOutput:
        code = args.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<a Python script>"}')
        result = run_python(code, self.limits, self.allow_unsafe)
        metrics = {"sandbox/duration_s": result.duration_s}
        if result.error is not None:  # what it printed first and the end of its traceback, both short
            printed = f"\nstdout began: {result.stdout[:200]}" if result.stdout else ""
            tail = result.stderr.strip()[-500:]
            raise ToolError(result.error + printed + (f"\n{tail}" if tail else ""))
        return result.stdout, 0.0, metrics
