"""The tools a run offers: the built-in table and loading a YAML list of tools (built-in or your own class).

The YAML file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: calculator            # built-in name, "package.module.Class" or "path/to/file.py:Class"
      - class_name: python
        config: {timeout_s: 5, memory_mb: 512}   # passed to the class
        tool_schema: {...}                # optional: replaces the class's schema
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from hybridflow.tools.base import BaseTool
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.tools.python_tool import PythonTool
from hybridflow.utils.errors import UserError
from hybridflow.utils.user_code import load_user_module


def builtin_tools() -> dict[str, type[BaseTool]]:
    """The tools a YAML file may name without a class path."""
    return {"calculator": CalculatorTool, "python": PythonTool}


def _tool_class(spec: str, where: str) -> type[BaseTool]:
    """A built-in name, ``package.module.Class`` or ``file.py:Class``."""
    builtins = builtin_tools()
    if spec in builtins:
        return builtins[spec]
    module: ModuleType | None
    if ":" in spec:
        path, _, name = spec.rpartition(":")
        module = load_user_module(path, where, "tool file")
    else:
        module_name, _, name = spec.rpartition(".")
        try:
            module = importlib.import_module(module_name) if module_name else None
        except ImportError as err:
            raise UserError(f"{where}: cannot import {module_name!r} for tool {spec!r}: {err}") from err
    cls = getattr(module, name, None) if module is not None else None
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise UserError(
            f"{where}: {spec!r} is not a BaseTool subclass; built-in tools: {sorted(builtins)}, or "
            "give 'package.module.Class' or 'path/to/file.py:Class'"
        )
    return cls


def load_tools(path: str | Path, unsafe_python: bool = False) -> dict[str, BaseTool]:
    """The tools listed in the YAML file ``path``, by the name the model calls them. ``unsafe_python``
    (``sandbox.unsafe_without_isolation``) lets the python tool run unisolated where this
    machine can create no sandbox."""
    file = Path(path)
    if not file.is_file():
        raise UserError(
            f"tool config {path} not found (actor_rollout_ref.rollout.multi_turn.tool_config_path)"
        )
    entries = (yaml.safe_load(file.read_text()) or {}).get("tools")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{path}: expected a non-empty list under 'tools:', each with a 'class_name'")
    return tools_from_entries(entries, str(path), unsafe_python)


def tools_from_entries(
    entries: list[dict[str, Any]], source: str = "tools", unsafe_python: bool = False
) -> dict[str, BaseTool]:
    """Instantiate ``[{"class_name", "config"?, "tool_schema"?}, ...]``; the names must be distinct.
    ``unsafe_python``: see ``load_tools``."""
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise UserError(f"{where}: needs a 'class_name' (a built-in tool name or a class path)")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise UserError(
                f"{where}: unknown keys {sorted(unknown)}; allowed: class_name, config, tool_schema"
            )
        cls = _tool_class(entry["class_name"], where)
        extra = {"allow_unsafe": unsafe_python} if issubclass(cls, PythonTool) else {}
        tool = cls(entry.get("config"), entry.get("tool_schema"), **extra)
        if tool.tool_name in tools:
            raise UserError(f"{where}: a second tool named {tool.tool_name!r}")
        tools[tool.tool_name] = tool
    return tools
