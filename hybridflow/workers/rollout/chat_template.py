"""Moved to ``hybridflow.rollout.chat_template`` (the agent loop and the served sessions share it); this path
keeps working for one release, with a ``DeprecationWarning``."""

from hybridflow.rollout import chat_template
from hybridflow.utils.deprecation import moved_names

__getattr__ = moved_names(__name__, chat_template, ["Messages", "TemplateDelta"])
