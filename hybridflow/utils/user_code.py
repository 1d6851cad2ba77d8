"""Loading the user's own code from a file a config key names: a reward function, a served agent, a tool.

One loader, so every kind of user code is found, and refused, the same way: a missing file, a file that is
not Python or a missing name is one ``UserError`` naming the key and what the file does define.

The module is not added to ``sys.modules``: cloudpickle then ships what it defines by value, so Ray workers
that cannot import the user's file still get it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from hybridflow.utils.errors import MissingInputError, UserError


def load_user_module(path: str | Path, where: str, what: str = "Python file") -> ModuleType:
    """The Python file ``path``, executed as a module of its own; errors start with ``where`` (the key or
    entry that names the file) and call it ``what``."""
    file = Path(path)
    if not file.is_file():
        raise MissingInputError(f"{where}: {what} not found: {path}")
    spec = importlib.util.spec_from_file_location(f"hybridflow_user_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise UserError(f"{where}: cannot load {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_user_function(
    path: str | Path, name: str, key: str, what: str = "Python file"
) -> Callable[..., Any]:
    """The function ``name`` defined in ``path``; ``key`` is the config section that names them (errors name
    its ``.path`` and ``.name``)."""
    module = load_user_module(path, f"{key}.path", what)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(f"{key}.name: {path} has no function {name!r}; it defines {defined}")
    if not callable(fn):
        raise UserError(f"{key}.name: {name!r} in {path} is a {type(fn).__name__}, not a function")
    function: Callable[..., Any] = fn
    return function
