"""``RunLock``: one run at a time per run folder.

Why: the same command started twice on one folder would interleave checkpoints and log lines, and the
checkpoint code assumes one saving process per folder. The lock is an ``flock`` on ``<folder>/.lock``, held
by an open file for the life of the run: the operating system drops it when the process ends in any way
(SIGKILL, out of memory, power loss on a local disk), so a dead run never leaves a stale lock behind. The
file holds the holder's pid and host, for the message that refuses a second run.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from hybridflow.utils.errors import UserError

LOCK_FILE = ".lock"


class RunLock:
    """``with RunLock(folder):`` holds the folder's lock; a second holder gets a ``UserError`` naming the
    first one's pid. Also the first write into the folder, so a folder that cannot be written is
    reported here, before any work, naming ``trainer.default_local_dir``."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        path = self.folder / LOCK_FILE
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            file = open(path, "a+")  # not truncated: the holder's pid stays readable until we own the lock
        except OSError as e:
            raise UserError(
                f"cannot write to trainer.default_local_dir {self.folder}: {e.strerror}; choose a "
                "folder this user can write to"
            ) from e
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise UserError(
                f"{self.folder} is in use by another run ({holder}); wait for it to end, stop it, "
                "or give this run another trainer.default_local_dir"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Give the lock up (closing the file releases it); the file stays, harmless to the next run."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
