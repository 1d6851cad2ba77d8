"""Checkpoint folders: atomic saves (exception and SIGKILL), latest, pruning, RNG round trip."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch

from hybridflow.runs import checkpoint
from hybridflow.runs.checkpoint import (
    COMPLETE_MARKER,
    LATEST_FILE,
    CheckpointManager,
    DiskFullError,
    atomic_directory,
    checkpoint_dir,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
)
from hybridflow.utils import errors
from hybridflow.utils.errors import UserError


def _save(root, step, payload="weights"):
    with atomic_directory(checkpoint_dir(root, step)) as folder:
        (folder / "model.bin").write_text(payload)


def test_successful_save_is_renamed_into_place_with_its_marker(tmp_path):
    with atomic_directory(tmp_path / "global_step_3") as folder:
        assert folder.name == f".tmp-global_step_3-{os.getpid()}"
        (folder / "sub").mkdir()
        (folder / "sub" / "a.txt").write_text("a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3"]
    assert (tmp_path / "global_step_3" / "sub" / "a.txt").read_text() == "a"
    assert (tmp_path / "global_step_3" / COMPLETE_MARKER).is_file()


def test_exception_inside_leaves_neither_final_nor_temporary_folder(tmp_path):
    with (
        pytest.raises(RuntimeError, match="disk full"),
        atomic_directory(tmp_path / "global_step_1") as folder,
    ):
        (folder / "half.bin").write_text("half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_saving_again_replaces_the_folder_whole(tmp_path):
    _save(tmp_path, 5, "old")
    (checkpoint_dir(tmp_path, 5) / "stale.bin").write_text("from the first save")
    _save(tmp_path, 5, "new")
    assert sorted(p.name for p in checkpoint_dir(tmp_path, 5).iterdir()) == [COMPLETE_MARKER, "model.bin"]
    assert (checkpoint_dir(tmp_path, 5) / "model.bin").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_5"]


def test_list_and_latest_see_complete_checkpoints_only(tmp_path):
    assert list_checkpoints(tmp_path / "missing") == [] and find_latest_checkpoint(tmp_path) is None
    for step in (2, 10, 9):
        _save(tmp_path, step)
    (tmp_path / "global_step_11").mkdir()  # no marker: e.g. copied by hand, half-way
    (tmp_path / "notes").mkdir()
    assert list_checkpoints(tmp_path) == [(s, checkpoint_dir(tmp_path, s)) for s in (2, 9, 10)]
    assert find_latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    assert prune_checkpoints(tmp_path, None) == [] and prune_checkpoints(tmp_path, 5) == []
    deleted = prune_checkpoints(tmp_path, 2)
    assert deleted == [checkpoint_dir(tmp_path, s) for s in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_4", "global_step_5"]


def test_manager_commits_records_latest_and_prunes(tmp_path):
    manager = CheckpointManager(tmp_path / "run", max_to_keep=2)
    for step in (10, 20, 30):
        with manager.saving(step) as folder:
            torch.save({"step": step}, folder / "trainer_state.pt")
    assert (tmp_path / "run" / LATEST_FILE).read_text() == "30\n"
    assert [step for step, _ in manager.list()] == [20, 30]
    assert manager.latest() == manager.path(30) == tmp_path / "run" / "global_step_30"
    with pytest.raises(KeyboardInterrupt), manager.saving(40):
        raise KeyboardInterrupt
    assert manager.latest() == manager.path(30) and (tmp_path / "run" / LATEST_FILE).read_text() == "30\n"


# Loads checkpoint.py (and the errors module it imports) by file path: importing the hybridflow package
# (torch, transformers) would take seconds.
_SLOW_SAVER = textwrap.dedent("""
    import importlib.util, sys, time
    for name, path in (("hybridflow.utils.errors", sys.argv[3]), ("checkpoint", sys.argv[2])):
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = checkpoint = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(checkpoint)
    with checkpoint.atomic_directory(sys.argv[1]) as folder:
        with open(folder / "model.bin", "wb") as f:
            for _ in range(1000):  # 1000 x 64 KiB, slowly: the parent kills us half-way
                f.write(b"x" * 65536)
                f.flush()
                time.sleep(0.01)
""")


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path):
    _save(tmp_path, 1, "good")
    saver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _SLOW_SAVER,
            str(checkpoint_dir(tmp_path, 2)),
            checkpoint.__file__,
            errors.__file__,
        ]
    )
    partial = tmp_path / f".tmp-global_step_2-{saver.pid}" / "model.bin"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size > 4 * 65536):
        assert saver.poll() is None and time.monotonic() < deadline, "the saver never started writing"
        time.sleep(0.05)
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    assert partial.exists()  # the torn save is still there, under its temporary name
    assert not checkpoint_dir(tmp_path, 2).exists()
    assert find_latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert (checkpoint_dir(tmp_path, 1) / "model.bin").read_text() == "good"
    _save(tmp_path, 3)  # the next save removes the dead process's leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_3"]


# ------------------------------------------------------------------ manifests, damaged checkpoints, repair
def _save_files(manager, step, payload=b"w" * 1000):
    with manager.saving(step) as folder:
        (folder / "actor").mkdir()
        (folder / "actor" / "model.safetensors").write_bytes(payload)
        (folder / "trainer_state.pt").write_bytes(b"state")


def test_the_marker_lists_every_file_and_verification_finds_damage(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save_files(manager, 1)
    table = json.loads((manager.path(1) / COMPLETE_MARKER).read_text())["files"]
    assert table == {
        "actor/model.safetensors": {"size": 1000, "crc32": zlib.crc32(b"w" * 1000)},
        "trainer_state.pt": {"size": 5, "crc32": zlib.crc32(b"state")},
    }
    assert verify_checkpoint(manager.path(1)) == []
    weights = manager.path(1) / "actor" / "model.safetensors"
    weights.write_bytes(b"w" * 999 + b"x")  # same size, one byte changed
    assert verify_checkpoint(manager.path(1)) == ["actor/model.safetensors does not match its checksum"]
    weights.write_bytes(b"w" * 10)  # truncated
    (manager.path(1) / "trainer_state.pt").unlink()
    assert verify_checkpoint(manager.path(1)) == [
        "actor/model.safetensors has 10 bytes, 1000 were saved",
        "trainer_state.pt is missing",
    ]
    (manager.path(1) / COMPLETE_MARKER).write_text('{"saved_at": "2025-01-01", "fil')
    assert verify_checkpoint(manager.path(1)) == [f"its {COMPLETE_MARKER} manifest is damaged"]
    (manager.path(1) / COMPLETE_MARKER).write_text("saved at 2025-01-01\n")  # a marker from before manifests
    assert verify_checkpoint(manager.path(1)) == []


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        _save_files(manager, step)
    with open(manager.path(3) / "actor" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert manager.latest_intact() == manager.path(2)
    assert "global_step_3 is damaged (actor/model.safetensors has 100 bytes, 1000 were saved)" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_2",
        "global_step_3.damaged",
        LATEST_FILE,
    ]  # step 1 is not pruned for the damaged one
    assert (tmp_path / LATEST_FILE).read_text() == "2\n"
    with pytest.raises(
        UserError, match="global_step_3.damaged is damaged: actor/model.safetensors has 100 bytes"
    ):
        resolve_checkpoint(tmp_path / "global_step_3.damaged")  # named explicitly: refused, no fallback
    assert resolve_checkpoint(tmp_path) == manager.path(2)  # a run folder falls back

    (manager.path(2) / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(
        UserError,
        match=r"every checkpoint in .* is damaged \(newest: global_step_2: "
        "trainer_state.pt has 0 bytes, 5 were saved\\)",
    ):
        manager.latest_intact()
    with pytest.raises(UserError, match="trainer.resume_from_path .*missing does not exist"):
        resolve_checkpoint(tmp_path / "missing")


def test_resume_repairs_a_lagging_latest_file_and_an_extra_checkpoint(tmp_path):
    """What a kill between committing a checkpoint and recording it / pruning leaves behind."""
    for step in (1, 2, 3):
        _save_files(CheckpointManager(tmp_path), step)
    (tmp_path / LATEST_FILE).write_text("2\n")
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    assert manager.latest_intact() == manager.path(3)
    assert (tmp_path / LATEST_FILE).read_text() == "3\n"
    assert [step for step, _ in manager.list()] == [2, 3]


def test_a_full_disk_during_a_save_says_so_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    """No small filesystem can be mounted here, so the writer fails as a full disk makes it fail: with
    ENOSPC half-way (Python's writes), or with torch's zip writer message (what torch.save said)."""
    manager = CheckpointManager(tmp_path / "run")
    _save_files(manager, 1, b"w" * 3000)
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 2048)
    )
    failures = [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
    ]
    for failure in failures:
        with pytest.raises(DiskFullError) as info, manager.saving(2) as folder:
            (folder / "actor").mkdir()
            (folder / "actor" / "model.safetensors").write_bytes(b"w" * 1500)
            raise failure
        assert str(info.value) == (
            f"no space left on the disk holding {tmp_path / 'run'} while saving global_step_2: 0.0 MiB free, "
            "the checkpoint needs about 0.0 MiB (the size of global_step_1). Free some space (or lower "
            "trainer.max_ckpt_to_keep, or point trainer.default_local_dir at a larger disk); the earlier "
            "checkpoints are intact and the run resumes from the newest one"
        )
        assert info.value.__cause__ is failure
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["global_step_1", LATEST_FILE]
        assert verify_checkpoint(manager.path(1)) == []
