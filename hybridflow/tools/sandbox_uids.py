"""User ids for sandboxed code when the trainer runs as root: one per running call, machine-wide.

Why a lock file per user id: the id keeps the process limit (RLIMIT_NPROC counts per user id) and the
file permissions per call, so two calls must never share one, whatever process or fork they run in. An
``flock`` on ``<uid>`` held for the call's length is that promise: it belongs to the open file, so two
processes (Ray workers, forks of one trainer) cannot both hold it, and the kernel drops it when the holder
dies, so a crashed trainer leaks nothing. The folder is root's own under ``/run`` (cleared at boot).
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

UID_BASE = 1_500_000  # user ids no account uses
UID_COUNT = 65_536  # the most calls running at once on one machine
LOCK_DIR = Path("/run/hybridflow-sandbox-uids")


def _lock_dir() -> Path:
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    info = LOCK_DIR.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"{LOCK_DIR} must be a folder of root's that only root can write to")
    return LOCK_DIR


@contextmanager
def allocated_uid() -> Iterator[int]:
    """A user id no other call on this machine holds until the ``with`` block ends."""
    folder = _lock_dir()
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"more than {UID_COUNT} sandboxes at once on this machine")
