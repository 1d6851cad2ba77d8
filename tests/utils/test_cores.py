"""``CoreShare``: a process at work takes the cores divided among the processes at work at that moment."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hybridflow.utils import cores
from hybridflow.utils.cores import CoreShare

# another sharing process: says "working" once its file says so, then works until its stdin closes
WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from hybridflow.utils.cores import CoreShare

    share = CoreShare(4, Path(sys.argv[1]))
    with share.working():
        print("working", flush=True)
        sys.stdin.read()
    print("idle", flush=True)
    """
)


@pytest.fixture
def other(tmp_path):
    """Start another sharing process in ``tmp_path``; it works until its stdin closes."""
    started = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "working"  # the state is on disk before it says so
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_process_alone_at_work_takes_every_core_and_splits_them_with_another(tmp_path, other):
    share = CoreShare(4, tmp_path)
    assert share.threads() == 4  # alone: idle or not, it counts itself
    proc = other()
    assert share.busy_processes() == 2 and share.threads() == 2
    proc.stdin.close()  # its work ends: the cores are all ours again
    assert proc.stdout.readline().strip() == "idle"
    proc.wait()
    assert share.threads() == 4
    share.leave()
    assert list(tmp_path.iterdir()) == []


def test_a_process_killed_at_work_is_pruned(tmp_path, other):
    share = CoreShare(3, tmp_path)
    proc = other()
    assert share.threads() == 1  # 3 cores // 2 at work
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert share.threads() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(os.getpid())]
    share.leave()


def test_working_sets_the_calling_threads_share_split_among_the_calls(tmp_path, other):
    share = CoreShare(4, tmp_path)
    other()
    before = torch.get_num_threads()
    seen: list[int] = []

    def busy() -> int:
        return len([p for p in tmp_path.iterdir() if p.name.endswith(".busy")])

    def call() -> None:  # a torch thread count belongs to the OS thread that sets it
        with share.working():
            seen.append(torch.get_num_threads())  # 4 cores, 2 processes at work
            with share.working():  # a second call at once in this process: one file, the share split
                seen.extend([torch.get_num_threads(), busy()])
        seen.append(busy())

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert seen == [2, 1, 2, 1]
    assert torch.get_num_threads() == before  # this thread's count is its own
    share.leave()


def test_followed_layers_rebalance_in_forward_and_backward(tmp_path, monkeypatch, tiny_model_path):
    from hybridflow.workers.modeling import load_model

    before = torch.get_num_threads()
    monkeypatch.setattr(cores, "RECHECK_S", 0.0)
    share = CoreShare(3, tmp_path)
    monkeypatch.setattr(cores, "_share", share)
    model = load_model(tiny_model_path, torch.device("cpu"), "float32")  # follows: this process shares
    seen: list[int] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        torch.set_num_threads(1)
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert seen == [3, 3]  # the share's 3 cores, set before the first layer ran
        torch.set_num_threads(1)
        logits.sum().backward()
        assert torch.get_num_threads() == 3  # set again as the backward reached a layer
    finally:
        torch.set_num_threads(before)
        share.leave()


def test_nothing_follows_where_the_process_does_not_share(monkeypatch, tiny_model_path):
    from hybridflow.workers.modeling import load_model

    monkeypatch.setattr(cores, "_share", None)
    model = load_model(tiny_model_path, torch.device("cpu"), "float32")
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
