"""Checkpoint folders: atomic saves, the latest complete one, pruning, and RNG state. No model specifics.

Why: a run killed in the middle of a save (out of memory, pre-emption, Ctrl-C, SIGKILL) must never leave a
folder that a resume takes for a checkpoint. Every save is written into a temporary sibling
``.tmp-<name>-<pid>``; when the writer is done, a ``COMPLETE`` marker is written last, everything is
fsynced, and the folder is renamed into place. So a ``global_step_<N>`` folder holding the marker is complete
by construction; a crash leaves only a ``.tmp-*`` entry, which is never listed and is removed by the next save
in the same root once its process is gone. Assumes one saving process per root (the driver), on one machine
(``RunLock`` makes sure of it).

The marker is also a manifest: the size and CRC-32 of every file in the folder, whatever it holds (Hugging
Face folders, optimiser files, sharded DCP files), so a resume can tell a checkpoint damaged after it was
saved (a truncated file, a disk error) and fall back to the previous intact one. Checkpoints whose marker is
plain text (saved before manifests) are taken as intact.

Layout (verl's)::

    <root>/global_step_<N>/...                   one complete checkpoint per saved step
    <root>/latest_checkpointed_iteration.txt     the newest saved step, for verl tools and people
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridflow.config.checks import required
from hybridflow.utils.errors import MissingInputError, UserError
from hybridflow.utils.processes import process_alive

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
DAMAGED_SUFFIX = ".damaged"
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
        manifest = {"saved_at": time.strftime("%Y-%m-%d %H:%M:%S"), "files": _file_table(tmp)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
        _fsync_tree(tmp)
        if final.exists():
            old = final.parent / f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            _remove(old)
        else:
            os.rename(tmp, final)
        _fsync_path(final.parent)
    except BaseException as error:
        written = _tree_size(tmp)
        _remove(tmp)
        if is_disk_full(error):
            raise DiskFullError(final, written) from error
        raise


class DiskFullError(UserError, OSError):
    """The disk filled up during a save: says where, how much is free and how much the checkpoint needs."""

    def __init__(self, final: Path, written: int) -> None:
        previous = find_latest_checkpoint(final.parent)
        need = (
            f"about {_gib(_tree_size(previous))} (the size of {previous.name})"
            if previous is not None
            else f"more than the {_gib(written)} written before the disk filled"
        )
        super().__init__(
            f"no space left on the disk holding {final.parent} while saving {final.name}: "
            f"{_gib(shutil.disk_usage(final.parent).free)} free, the checkpoint needs {need}. Free some space "
            "(or lower trainer.max_ckpt_to_keep, or point trainer.default_local_dir at a larger disk); the "
            "earlier checkpoints are intact and the run resumes from the newest one"
        )


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it, here or in a worker) is a full disk: ``ENOSPC``/``EDQUOT``, or
    the text torch's zip writer and the C library give for it."""
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        error = current
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(
            text in str(error)
            for text in ("No space left on device", "Disk quota exceeded", "unexpected pos")
        ):
            return True
        current = error.__cause__ or error.__context__
    return False


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete ``.tmp-*-<pid>`` entries in ``folder`` whose process no longer runs; returns what was removed."""
    removed = []
    for entry in Path(folder).glob(f"{_TMP_PREFIX}*"):
        match = _TMP_PID.search(entry.name)
        if match and int(match[1]) != os.getpid() and not process_alive(int(match[1])):
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
    if not path.exists():
        raise MissingInputError(
            f"trainer.resume_from_path {path} does not exist; give a global_step_N folder or a run folder"
        )
    if (path / COMPLETE_MARKER).is_file():
        problems = verify_checkpoint(path)
        if problems:
            raise UserError(
                f"trainer.resume_from_path {path} is damaged: {'; '.join(problems[:3])}; resume "
                "from an earlier checkpoint (or its run folder, which falls back by itself)"
            )
        return path
    latest = newest_intact_checkpoint(path)
    if latest is None:
        raise MissingInputError(
            f"trainer.resume_from_path {path} is neither a complete checkpoint (it has no "
            f"{COMPLETE_MARKER} marker: a save cut short?) nor a run folder holding one"
        )
    return latest


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """What is wrong with a complete checkpoint compared with the manifest written when it was saved
    (missing files, other sizes or checksums); [] when intact or saved without a manifest."""
    path = Path(path)
    marker = (path / COMPLETE_MARKER).read_text()
    if marker.startswith("saved at"):
        return []  # a plain-text marker: saved before manifests, nothing to compare with
    try:
        table = json.loads(marker)["files"]
    except (ValueError, KeyError, TypeError):
        return [f"its {COMPLETE_MARKER} manifest is damaged"]
    problems = []
    for name, expected in table.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != expected["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, {expected['size']} were saved")
        elif _crc32(file) != expected["crc32"]:
            problems.append(f"{name} does not match its checksum")
    return problems


def newest_intact_checkpoint(root: str | os.PathLike, set_aside: bool = False) -> Path | None:
    """The newest complete checkpoint under ``root`` that passes ``verify_checkpoint``; a damaged newer one
    is skipped with a warning (renamed to ``<name>.damaged`` when ``set_aside``, so neither pruning nor a
    later resume takes it). None when there is no checkpoint; ``UserError`` when every one is damaged."""
    damaged = []
    for _, path in reversed(list_checkpoints(root)):
        problems = verify_checkpoint(path)
        if not problems:
            break
        damaged.append((path, problems))
    else:
        if damaged:
            raise UserError(
                f"every checkpoint in {root} is damaged (newest: {damaged[0][0].name}: "
                f"{'; '.join(damaged[0][1][:3])}); move the folder away or set "
                "trainer.resume_mode=disable to start over"
            )
        return None
    for bad, problems in damaged:
        aside = bad.with_name(bad.name + DAMAGED_SUFFIX) if set_aside else bad
        if set_aside:
            _remove(aside)
            os.rename(bad, aside)
        logger.warning(
            "checkpoint %s is damaged (%s): %s; resuming from %s",
            bad,
            "; ".join(problems[:3]),
            f"moved it to {aside.name}" if set_aside else "skipped",
            path.name,
        )
    return path


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

    def __init__(
        self,
        root: str | os.PathLike,
        max_to_keep: int | None = None,
        check_root: Callable[[Path], None] | None = None,
    ) -> None:
        """``check_root(root)`` runs once, before the first save: e.g. that every writer sees the folder."""
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self._check_root = check_root

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives once saved."""
        return checkpoint_dir(self.root, step)

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """Yield a temporary folder to write ``step``'s files into; on success it is committed, the latest
        step recorded and old checkpoints pruned; on an exception nothing changes."""
        if self._check_root is not None:
            self._check_root(self.root)
            self._check_root = None
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

    def latest_intact(self) -> Path | None:
        """The newest checkpoint that is complete and intact; damaged newer ones are set aside, then
        ``repair`` brings the folder back in order (see ``newest_intact_checkpoint``)."""
        latest = newest_intact_checkpoint(self.root, set_aside=True)
        self.repair()
        return latest

    def repair(self) -> None:
        """Put back what a kill between a save's last steps (or a damaged checkpoint set aside) can leave:
        ``latest_checkpointed_iteration.txt`` naming another step than the newest checkpoint, and
        checkpoints beyond ``max_to_keep``."""
        checkpoints = self.list()
        latest_file = self.root / LATEST_FILE
        recorded = latest_file.read_text().strip() if latest_file.is_file() else None
        if checkpoints and recorded != str(checkpoints[-1][0]):
            write_latest_step(self.root, checkpoints[-1][0])
            logger.warning(
                "%s said step %s; set it to %d, the newest checkpoint",
                latest_file,
                recorded,
                checkpoints[-1][0],
            )
        for path in prune_checkpoints(self.root, self.max_to_keep):
            logger.warning("deleted %s: beyond trainer.max_ckpt_to_keep=%s", path, self.max_to_keep)

    def to_resume(self, resume_mode: str, resume_from_path: str | None) -> Path | None:
        """The checkpoint a run resumes from (``trainer.resume_mode``): ``auto`` this run folder's newest
        intact one (None: start fresh; see ``latest_intact``), ``resume_path`` the complete checkpoint or run folder
        ``resume_from_path``, ``disable`` None. First deletes the ``.tmp-*`` leftovers of a save that a
        killed process never finished."""
        remove_stale_temporaries(self.root)
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest_intact()
        return resolve_checkpoint(required(resume_from_path, "trainer.resume_from_path"))  # resume_path


def _file_table(folder: Path) -> dict[str, dict[str, int]]:
    """``{relative path: {"size", "crc32"}}`` of every file under ``folder``."""
    return {
        file.relative_to(folder).as_posix(): {"size": file.stat().st_size, "crc32": _crc32(file)}
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


def _crc32(file: Path) -> int:
    """CRC-32 of a file, read in 8 MiB blocks (about 1 GB/s: a damaged file, not an attacker, is the worry)."""
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _tree_size(folder: Path | None) -> int:
    if folder is None or not folder.exists():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"


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
