"""``ConfigView``: a config section as verl's functions read their ``config`` argument.

verl passes its estimators an ``AlgoConfig`` and its policy losses an ``ActorConfig``, objects read both
as attributes (``config.gamma``, ``config.clip_ratio``) and as a mapping (``config["gamma"]``, its
``get`` with a default). Our config sections are plain dataclasses (this layer does not know them);
a view gives any dataclass or dict that reading interface, read-only, nested sections included, so a
function written for verl reads our settings unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any


class ConfigView(Mapping[str, Any]):
    """Read-only attribute-and-mapping access to ``source`` (a dataclass instance or a mapping), with
    ``extra`` entries added or overriding (e.g. ``global_batch_info``, which verl's losses read)."""

    def __init__(self, source: Any = None, **extra: Any) -> None:
        if isinstance(source, ConfigView):
            values = dict(source._values)
        elif dataclasses.is_dataclass(source) and not isinstance(source, type):
            values = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)}
        elif isinstance(source, Mapping):
            values = dict(source)
        elif source is None:
            values = {}
        else:
            raise TypeError(f"ConfigView reads a dataclass or a mapping, not {type(source).__name__}")
        values.update(extra)
        object.__setattr__(self, "_values", values)

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        is_section = isinstance(value, Mapping) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        )
        return ConfigView(value) if is_section else value

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no setting {key!r}; it has {sorted(self._values)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"config is read-only here (tried to set {key!r})")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ConfigView({self._values!r})"
