"""One error type for "the user's input is wrong", and the command-line wrapper that prints it.

Why: a wrong path, a malformed data row or a reward function that returns text is not a bug in
hybridflow, and a 10-frame traceback hides the one line that matters. Code that finds such a problem
raises ``UserError`` (or a subclass) where it finds it, with a message that names the culprit (file, row,
key, path) and says what to do; every command catches it once (``run_cli``) and prints
``hybridflow <cmd>: error: <message>`` with exit status 2. ``--debug`` or ``HYBRIDFLOW_DEBUG=1`` shows the
traceback instead; anything that is not a ``UserError`` is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEBUG_ENV = "HYBRIDFLOW_DEBUG"


class UserError(Exception):
    """The user's input (config, files, paths, functions, the machine's resources) cannot be used; the
    message names the culprit and what to do."""


class InputError(UserError, ValueError):
    """A value in the user's files or functions is wrong (a ``ValueError`` too, for callers that catch it)."""


class MissingInputError(UserError, FileNotFoundError):
    """A path the user named does not exist or is not what it must be (a file where a folder is needed)."""


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether ``--debug`` is in ``argv`` or ``HYBRIDFLOW_DEBUG`` is set; returns argv without ``--debug``."""
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return debug, [a for a in argv if a != "--debug"]


def run_cli(prog: str, command: Callable[[list[str]], int], argv: list[str]) -> int:
    """``command(argv)``; a ``UserError`` becomes one line on stderr and exit status 2 (unless debugging)."""
    debug, argv = debug_requested(argv)
    try:
        return command(argv)
    except UserError as error:
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
