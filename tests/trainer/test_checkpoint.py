"""Checkpoint folders: atomic saves (exception and SIGKILL), latest, pruning, RNG round trip."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hybridflow.trainer import checkpoint
from hybridflow.trainer.checkpoint import (
    COMPLETE_MARKER,
    LATEST_FILE,
    CheckpointManager,
    atomic_directory,
    checkpoint_dir,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)


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
    with pytest.raises(RuntimeError, match="disk full"), atomic_directory(tmp_path / "global_step_1") as folder:
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


# Loads checkpoint.py by file path: importing the hybridflow package (torch, transformers) would take seconds.
_SLOW_SAVER = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("checkpoint", sys.argv[2])
    checkpoint = importlib.util.module_from_spec(spec)
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
    saver = subprocess.Popen([sys.executable, "-c", _SLOW_SAVER, str(checkpoint_dir(tmp_path, 2)), checkpoint.__file__])
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
