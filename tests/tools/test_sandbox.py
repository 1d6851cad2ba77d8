"""Hostile snippets against the sandbox, with small limits: each ends with a clear error within its limits,
and the host process, its environment and the machine are left as they were.

The snippets whose containment depends on the mode run in both modes this machine offers as root: in
namespaces (util-linux ``unshare``: own network, PID namespace and /proc) and without them
(``_unshare_works`` patched to False: the runner cuts the network itself and the sandbox's own user id is
swept afterwards); the resource limits are the same in both."""

import dataclasses
import os
import socket
import tempfile
import time

import pytest

from hybridflow.tools import sandbox
from hybridflow.tools.sandbox import SandboxLimits, run_python

# A generous wall clock, so that on a loaded machine every other limit is reached first; the tests of the
# wall clock itself use 2 s.
LIMITS = SandboxLimits(
    timeout_s=30.0, cpu_s=1, memory_mb=256, file_size_mb=4, max_processes=8, max_output_bytes=10_000
)
SECRET = "hybridflow-test-secret-3141"


@pytest.fixture(params=["namespaces", "plain"])
def mode(request, monkeypatch) -> str:
    if request.param == "plain":
        monkeypatch.setattr(sandbox, "_unshare_works", lambda: False)
    elif not sandbox._unshare_works():
        pytest.fail("this machine runs tests as root with util-linux unshare; namespaces should work here")
    return request.param


def sandbox_users() -> list[int]:
    """Processes still running under a sandbox user id."""
    return sandbox.processes_of(range(sandbox.UID_BASE, sandbox.UID_BASE + 1000 * 256))


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
    result = run_python(code, dataclasses.replace(LIMITS, timeout_s=timeout_s))
    return result, time.monotonic() - start


def test_a_clean_run_prints_and_reports_its_isolation(mode):
    result, _ = run("import os; print(6 * 7, os.getuid() != 0, sorted(os.environ) <= ['LC_CTYPE'])")
    assert result.ok and result.stdout == "42 True True\n" and result.exit_code == 0
    assert result.isolation == {"network": True, "pid_namespace": mode == "namespaces", "own_user": True}


def test_infinite_loop_hits_the_cpu_limit():
    result, _ = run("while True:\n    pass")
    assert result.error == "CPU time limit exceeded (1 s)"


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


@pytest.mark.parametrize(
    "code", ["x = bytearray(10 ** 10)", "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)"]
)
def test_memory_bomb_hits_the_memory_limit(code):
    result, _ = run(code)
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


def test_hundred_megabytes_of_output_are_truncated():
    result, _ = run("import sys\nsys.stdout.write('x' * 100_000_000)")
    assert result.error == "output limit exceeded: stopped after 10000 bytes" and result.truncated
    assert len(result.stdout) <= LIMITS.max_output_bytes


def test_the_network_is_cut(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result, _ = run(
            f"import socket\ns = socket.socket()\ns.settimeout(1)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        )
    assert result.ok and result.stdout.strip() != "0"
