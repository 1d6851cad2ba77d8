"""Hostile snippets against the sandbox, with small limits: each ends with a clear error within its limits,
and the host process, its environment and the machine are left as they were; and the refusal to run
without isolation unless the user opts out.

The snippets whose containment depends on the mode run in both modes a root trainer can get: the
sandbox's namespaces, and the unsafe opt-out (no mode available, ``allow_unsafe``: only the limits and the
call's own user id). The attacks that isolation must stop are in test_sandbox_attacks.py."""

import dataclasses
import fcntl
import json
import os
import socket
import tempfile
import time

import pytest

from hybridflow.tools import PythonTool, load_tools, sandbox
from hybridflow.tools.sandbox import SandboxLimits, SandboxUnavailable, run_python
from hybridflow.tools.sandbox_uids import LOCK_DIR, UID_BASE, UID_COUNT, allocated_uid

# A generous wall clock, so that on a loaded machine every other limit is reached first; the tests of the
# wall clock itself use 1-2 s.
LIMITS = SandboxLimits(
    timeout_s=30.0, cpu_s=1, memory_mb=256, file_size_mb=4, max_processes=8, max_output_bytes=10_000
)
SECRET = "hybridflow-test-secret-3141"


@pytest.fixture(params=["namespaces", "unsafe"])
def mode(request, monkeypatch) -> str:
    if request.param == "unsafe":
        monkeypatch.setattr(sandbox, "MODES", ())
    elif sandbox.sandbox_mode() != "namespaces":
        pytest.fail("this machine runs tests as root with user namespaces; the namespaces mode should work")
    return request.param


def sandbox_users() -> list[int]:
    """Processes still running under a sandbox user id."""
    return sandbox.processes_of(range(UID_BASE, UID_BASE + UID_COUNT))


def leftover_folders() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("hybridflow-sandbox-")}


@pytest.fixture(autouse=True)
def host_unharmed():
    folders, pid, cwd = leftover_folders(), os.getpid(), os.getcwd()
    yield
    assert os.getpid() == pid and os.getcwd() == cwd
    assert leftover_folders() <= folders, "a sandbox folder was left behind"
    assert not sandbox_users(), "a sandboxed process outlived its call"


def run(code: str, timeout_s: float = LIMITS.timeout_s) -> tuple[sandbox.SandboxResult, float]:
    start = time.monotonic()
    result = run_python(code, dataclasses.replace(LIMITS, timeout_s=timeout_s), allow_unsafe=True)
    return result, time.monotonic() - start


def test_a_clean_run_prints_and_reports_its_isolation(mode):
    result, _ = run("import os; print(6 * 7, os.getuid() != 0, sorted(os.environ) <= ['LC_CTYPE'])")
    assert result.ok and result.stdout == "42 True True\n" and result.exit_code == 0
    isolated = mode == "namespaces"
    assert result.mode == mode and result.isolation == {
        **{key: isolated for key in sandbox.ISOLATION["namespaces"]},
        "own_user": True,
    }


def test_sleeping_forever_hits_the_wall_clock():
    result, seconds = run("import time\ntime.sleep(60)", timeout_s=1)
    assert result.error == "timed out after 1 s (wall clock)" and seconds < 3


def test_fork_bomb_is_capped_and_killed(mode):
    counted, _ = run(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n)"
    )
    assert counted.ok and 0 < int(counted.stdout) < LIMITS.max_processes
    bomb, seconds = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2
    )
    assert bomb.error in ("timed out after 2 s (wall clock)", "CPU time limit exceeded (1 s)") and seconds < 5


def test_a_ten_gigabyte_allocation_hits_the_memory_limit():
    result, _ = run("x = bytearray(10 ** 10)")
    assert result.error == "memory limit exceeded (256 MB)"


def test_ten_gigabyte_file_stops_at_the_file_size_limit():
    result, _ = run(
        "with open('big', 'wb') as f:\n    for _ in range(10 * 1024):\n        f.write(b'0' * 2 ** 20)"
    )
    assert result.error == "file size limit exceeded (4 MB per file)"


def test_environment_secrets_are_out_of_reach(mode, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", SECRET)
    code = (
        f"import os\nprint(dict(os.environ))\nfor p in ('/proc/{os.getpid()}/environ', '/proc/1/environ'):\n"
        "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)"
    )
    result, _ = run(code)
    assert result.ok and SECRET not in result.stdout and "HYBRIDFLOW" not in result.stdout


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("import sys\nsys.exit(3)", "exited with code 3"),
        ("import ctypes\nctypes.string_at(0)", "killed by signal SIGSEGV"),
    ],
)
def test_exit_and_segfault_are_reported(code, error):
    result, _ = run(code)
    assert result.error == error


def test_the_network_is_cut(mode):
    """Cut in a namespace; the unsafe opt-out has the host's network (the README's table says so)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result, _ = run(
            f"import socket\ns = socket.socket()\ns.settimeout(1)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        )
    assert result.ok and (result.stdout.strip() != "0") == (mode == "namespaces")


def test_without_isolation_the_tool_refuses_in_one_line_unless_the_user_opts_out(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "MODES", ("bwrap",))  # as root the sandbox does not use bubblewrap
    with pytest.raises(SandboxUnavailable) as refused:
        run_python("print(1)")
    message = str(refused.value)
    assert "\n" not in message and "bubblewrap is not used as root" in message
    assert "unprivileged user namespaces" in message and f"{sandbox.UNSAFE_KEY}=true" in message
    with pytest.raises(SandboxUnavailable):  # when the run starts, not at the first call
        PythonTool()
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: python\n")
    with pytest.raises(SandboxUnavailable):
        load_tools(tmp_path / "tools.yaml")
    tool = load_tools(tmp_path / "tools.yaml", unsafe_python=True)["python"]
    assert tool.execute({"code": "print(6 * 7)"}, "id")[0] == "42\n"
    assert run_python("pass", allow_unsafe=True).mode == "unsafe"


def test_user_ids_are_held_machine_wide_by_a_lock_per_id():
    """Nested holders get distinct ids, and a forked process cannot take an id its parent holds."""
    with allocated_uid() as first, allocated_uid() as second:
        assert first != second
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            with allocated_uid() as child:
                os.write(write, json.dumps(child).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            child = json.loads(f.read())
        os.waitpid(pid, 0)
        assert child not in (first, second)
        with open(LOCK_DIR / str(first)) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_verdict_reads_the_runners_status_and_the_output():
    """``_verdict``, one of the three parts of a call (``_prepare``, ``_supervise``, ``_verdict``), on hand-made
    outputs: what the runner reported becomes the one-line error, and the wall clock runs from the call."""
    limits, started = SandboxLimits(timeout_s=2.0, cpu_s=1), time.monotonic() - 1.5
    spec = {"mode": "namespaces", "cwd": "/tmp"}

    def verdict(**out) -> sandbox.SandboxResult:
        return sandbox._verdict(sandbox._Output(**out), 0, spec, limits, 1_500_001, started)

    cpu = verdict(status=b'{"signal": 9, "cpu_s": 1.2}', stderr=b'File "/tmp/main.py", line 1')
    assert cpu.error == "CPU time limit exceeded (1 s)" and cpu.stderr == 'File "main.py", line 1'
    assert verdict(status=b'{"exit": 0}', stdout=b"42\n").ok and 1.5 <= cpu.duration_s < 3
    assert verdict(timed_out=True).error == "timed out after 2 s (wall clock)"
    assert verdict(status=b'{"exit": 3}').error == "exited with code 3"
    assert verdict(stderr=b"boom\nsandbox: could not start: pivot_root: EPERM\n").error == (
        "sandbox: could not start: pivot_root: EPERM"
    )
    assert verdict(status=b'{"exit": 0}').isolation == {
        **dict.fromkeys(sandbox.ISOLATION["namespaces"], True),
        "own_user": True,
    }
