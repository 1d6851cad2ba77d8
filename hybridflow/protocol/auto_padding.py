"""verl's process-wide auto-padding switch, ``DataProtoConfig.auto_padding`` (or ``VERL_AUTO_PADDING=1``), and
the ``meta_info`` key a batch carries it under: kept apart from ``dataproto`` because it is process state, not
a batch's.

Imports nothing of hybridflow.
"""

from __future__ import annotations

import os

AUTO_PADDING_KEY = "_verl_auto_padding"  # verl's meta_info key, so a batch built by either reads the same


class _DataProtoConfigMeta(type):
    @property
    def auto_padding(cls) -> bool:
        by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._auto_padding

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._auto_padding = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide switch ``DataProtoConfig.auto_padding`` (or ``VERL_AUTO_PADDING=1``), as in verl.

    Worker-group dispatch here always pads a batch to a multiple of the ranks and removes the padding from
    the result, so the switch changes nothing there; ``DataProto.is_padding_enabled`` reports it."""

    _auto_padding = False
