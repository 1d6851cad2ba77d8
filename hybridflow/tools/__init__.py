"""Tools a policy may call during multi-turn rollouts, the Hermes tool-call parser, and the sandbox.

Before ``rewards`` in the layering (the code scorer runs programs in the sandbox); ``workers`` (the agent
loop) import it. May import: ``utils``, ``protocol``,
``models``, ``algorithms``, ``config``. ``registry.py`` holds the built-in tool table and loads a run's tool list.
"""

from hybridflow.tools.base import BaseTool, ToolError, ToolOutput
from hybridflow.tools.calculator import CalculatorTool, calculate
from hybridflow.tools.parsing import ToolCall, parse_tool_calls
from hybridflow.tools.python_tool import PythonTool
from hybridflow.tools.registry import builtin_tools, load_tools, tools_from_entries
from hybridflow.tools.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, isolation, run_python

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "PythonTool",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "ToolCall",
    "ToolError",
    "ToolOutput",
    "builtin_tools",
    "calculate",
    "isolation",
    "load_tools",
    "parse_tool_calls",
    "run_python",
    "tools_from_entries",
]
