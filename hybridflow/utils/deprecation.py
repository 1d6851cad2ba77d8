"""Public paths that moved keep working for one release, with a ``DeprecationWarning`` naming the new path:
whole modules (``MovedModules``, the table ``hybridflow.MOVED_MODULES``) and names that left a module which
stays (``moved_names``, the module's own ``__getattr__``).

Why a finder for modules rather than a file left at each old path: the module is then the new one itself
(``hybridflow.trainer.config is hybridflow.config.schema``), so classes, ``isinstance`` checks and pickles are
the same objects, and no stub sits in a room it does not belong to (``hybridflow.demo`` would be a top-level
room of its own). ``MovedModules`` goes on ``sys.meta_path`` after the usual finders, so it only ever answers
for a name no file holds, and only for the names in its table.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import warnings
from collections.abc import Callable, Iterable, Sequence
from types import CodeType, ModuleType
from typing import Any


def moved_names(old: str, new: ModuleType, names: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module ``old``: each of ``names`` resolves to ``new``'s, with a
    ``DeprecationWarning`` that names ``new``; any other name is an ``AttributeError`` as usual."""
    moved = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {new.__name__}.{name}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(new, name)

    return __getattr__


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads each old module name of ``moved`` (old -> new dotted name) as the new module."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}  # the new modules' own specs

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old name of the table (located at the new module's file); None for any other."""
        if fullname not in self.moved:
            return None
        new = importlib.util.find_spec(self.moved[fullname])
        return importlib.machinery.ModuleSpec(fullname, self, origin=new.origin if new else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The new module (imported if need be), after the warning."""
        self._warn(spec.name)
        module = importlib.import_module(self.moved[spec.name])
        self._specs.setdefault(module.__name__, module.__spec__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new module ran when imported); the import system set the old name's spec on it,
        so its own goes back."""
        module.__spec__ = self._specs[module.__name__]

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m OLD`` (``runpy`` runs it as ``__main__``; the warning is
        the ``__main__`` module's, so Python shows it by default, as it does one from a user's script)."""
        new = self.moved[fullname]
        spec = importlib.util.find_spec(new)
        warnings.warn_explicit(
            self._message(fullname),
            DeprecationWarning,
            (spec.origin if spec else None) or new,
            1,
            module="__main__",
        )
        loader = spec.loader if spec is not None else None
        return loader.get_code(new) if isinstance(loader, importlib.abc.InspectLoader) else None

    def _message(self, old: str) -> str:
        return f"{old} moved to {self.moved[old]}; the old path works for one release"

    def _warn(self, old: str) -> None:
        # stacklevel 3: past this method and create_module, to the import statement (the import system's
        # own frames are skipped)
        warnings.warn(self._message(old), DeprecationWarning, stacklevel=3)
