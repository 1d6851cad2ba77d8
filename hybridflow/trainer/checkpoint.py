"""Checkpoint folders: atomic saves, the latest complete one, pruning, and RNG state. No model specifics.

Why: a run killed in the middle of a save (out of memory, pre-emption, Ctrl-C, SIGKILL) must never leave a
folder that a resume takes for a checkpoint. Every save is written into a temporary sibling
``.tmp-<name>-<pid>``; when the writer is done, a ``COMPLETE`` marker is written last, everything is
fsynced, and the folder is renamed into place. So a ``global_step_<N>`` folder holding the marker is complete
by construction; a crash leaves only a ``.tmp-*`` entry, which is never listed and is removed by the next save
in the same root once its process is gone. Assumes one saving process per root (the driver), on one machine.

Layout (verl's)::

    <root>/global_step_<N>/...                   one complete checkpoint per saved step
    <root>/latest_checkpointed_iteration.txt     the newest saved step, for verl tools and people
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"global_step_(\d+)")
_TMP_PID = re.compile(r"-(\d+)$")


@contextmanager
def atomic_directory(final_path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it becomes ``final_path``, on an exception it vanishes.

    On success the ``COMPLETE`` marker is written, the tree fsynced and the folder renamed to
    ``final_path``. An existing ``final_path`` is first renamed out of the way (to a ``.tmp-old-*`` name),
    so no reader ever sees a half-old, half-new folder; a crash between the two renames loses only that
    older copy of the same folder.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text(f"saved at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        _fsync_tree(tmp)
        if final.exists():
            old = final.parent / f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            _remove(old)
        else:
            os.rename(tmp, final)
        _fsync_path(final.parent)
    except BaseException:
        _remove(tmp)
        raise


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete ``.tmp-*-<pid>`` entries in ``folder`` whose process no longer runs; returns what was removed."""
    removed = []
    for entry in Path(folder).glob(f"{_TMP_PREFIX}*"):
        match = _TMP_PID.search(entry.name)
        if match and int(match[1]) != os.getpid() and not _process_alive(int(match[1])):
            _remove(entry)
            removed.append(entry)
    return removed


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/global_step_{step}``."""
    return Path(root) / f"global_step_{step}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first; [] if ``root`` is missing."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            found.append((int(match[1]), entry))
    return sorted(found)


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder under ``root``, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest complete one under it (a run folder).

    Refuses a folder without the ``COMPLETE`` marker (a ``.tmp-*`` leftover, a half-copied folder), so a
    resume never starts from a checkpoint that a crash cut short."""
    path = Path(path)
    if (path / COMPLETE_MARKER).is_file():
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a complete checkpoint (it has no {COMPLETE_MARKER} marker) "
                                "nor a run folder holding one")
    return latest


def prune_checkpoints(root: str | os.PathLike, max_to_keep: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond the newest ``max_to_keep``; None or <= 0 keeps all.

    Each folder is renamed to a ``.tmp-del-*`` name before it is deleted, so a crash half-way through a
    deletion never leaves a marked folder with missing files. Returns the deleted checkpoint paths.
    """
    checkpoints = list_checkpoints(root)
    if not max_to_keep or max_to_keep <= 0 or len(checkpoints) <= max_to_keep:
        return []
    doomed = [path for _, path in checkpoints[: len(checkpoints) - max_to_keep]]
    for path in doomed:
        trash = path.parent / f"{_TMP_PREFIX}del-{path.name}-{os.getpid()}"
        os.rename(path, trash)
        _remove(trash)
    return doomed


def write_latest_step(root: str | os.PathLike, step: int) -> None:
    """Atomically write ``step`` to ``root/latest_checkpointed_iteration.txt`` (as verl does)."""
    target = Path(root) / LATEST_FILE
    tmp = target.parent / f"{_TMP_PREFIX}{LATEST_FILE}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_path(target.parent)


class CheckpointManager:
    """The checkpoints of one run folder: ``with manager.saving(step) as folder: <write files>``."""

    def __init__(self, root: str | os.PathLike, max_to_keep: int | None = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once saved."""
        return checkpoint_dir(self.root, step)

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Yield a temporary folder to write ``step``'s files into; on success it is committed, the latest
        step recorded and old checkpoints pruned; on an exception nothing changes."""
        with atomic_directory(self.path(step)) as folder:
            yield folder
        write_latest_step(self.root, step)
        prune_checkpoints(self.root, self.max_to_keep)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return find_latest_checkpoint(self.root)

    def list(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first."""
        return list_checkpoints(self.root)

    def to_resume(self, resume_mode: str, resume_from_path: str | None) -> Path | None:
        """The checkpoint a run resumes from (``trainer.resume_mode``): ``auto`` this run folder's newest
        complete one (None: start fresh), ``resume_path`` the complete checkpoint or run folder
        ``resume_from_path``, ``disable`` None. First deletes the ``.tmp-*`` leftovers of a save that a
        killed process never finished."""
        remove_stale_temporaries(self.root)
        if resume_mode == "disable":
            return None
        return self.latest() if resume_mode == "auto" else resolve_checkpoint(resume_from_path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` so the rename never lands before the data."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))
