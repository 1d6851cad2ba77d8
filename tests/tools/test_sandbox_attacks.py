"""Attacks on the sandbox (issue 24), each asserting that the attacker's success criterion is false, in
every mode this machine offers: as root (the sandbox's own namespaces, a user id per call) and as an
unprivileged user (the sandbox started by ``nobody`` through ``runuser``: unprivileged user namespaces,
bubblewrap where it is installed, and the unsafe opt-out, which is expected to lose the attacks listed in
``UNSAFE_BREAKS``). A mode that cannot be created here is skipped with the reason.

The non-root runs start ``sandbox_driver.py`` as nobody with a copy of the sandbox's modules in a folder
nobody can read, and a Python nobody can run (this checkout's or the system's)."""

import ctypes
import dataclasses
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import sandbox_driver

from hybridflow.tools import sandbox
from hybridflow.tools.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(
    timeout_s=20.0, cpu_s=1, memory_mb=256, file_size_mb=4, max_processes=8, max_output_bytes=10_000
)
SANDBOX_UIDS = range(1_500_000, 1_500_000 + 256_000)  # the user ids root gives sandboxed code
SECRET = "hybridflow-attack-secret-2718"


def _python_for_nobody() -> str | None:
    """An interpreter (3.10+) the user nobody can start: this one, or the system's."""
    for python in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(
            [
                "runuser",
                "-u",
                "nobody",
                "--",
                python,
                "-I",
                "-S",
                "-c",
                "import sys; assert sys.version_info >= (3, 10)",
            ],
            capture_output=True,
        )
        if probe.returncode == 0:
            return python
    return None


@pytest.fixture(scope="module")
def nobody_copy(tmp_path_factory):
    """(python, folder): the sandbox's modules and the driver, copied where nobody can read them."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("starting the sandbox as nobody needs root and runuser")
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python 3.10+ that the user nobody can run")
    folder = Path(tempfile.mkdtemp(prefix="hybridflow-test-nobody-"))
    package = Path(sandbox.__file__).parents[1]
    for source in [*package.joinpath("tools").glob("sandbox*.py"), package / "utils" / "errors.py"]:
        target = folder / "hybridflow" / source.parent.name / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
    shutil.copy(sandbox_driver.__file__, folder / "sandbox_driver.py")
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    yield python, folder
    shutil.rmtree(folder)


# What the unsafe opt-out (no namespaces, the trainer's own user id) does not stop: these attacks succeed
# there (strict xfail, so the README's table stays true; the fork bomb only sometimes leaves survivors
# behind); the others hold in every mode.
UNSAFE_BREAKS = {
    "test_files_do_not_persist_across_calls": True,
    "test_sysv_ipc_does_not_outlive_the_call": True,
    "test_the_hosts_tmp_a_live_ray_session_and_the_trainers_files_are_out_of_reach": True,
    "test_the_trainer_cannot_be_signalled_and_no_orphan_survives": True,
    "test_fork_bomb_is_contained": False,
    "test_disk_fill_stops_at_the_private_tmp_size": True,
}


@pytest.fixture(params=["root", "nobody", "nobody-bwrap", "nobody-unsafe"])
def mode(request) -> str:
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("the root mode needs root")
    if request.param == "nobody-unsafe" and request.node.originalname in UNSAFE_BREAKS:
        strict = UNSAFE_BREAKS[request.node.originalname]
        request.applymarker(pytest.mark.xfail(strict=strict, reason="the unsafe opt-out does not stop it"))
    return request.param


def _kill_all(uid: int) -> None:
    """Kill ``uid``'s sandboxed code until scans find none for 0.2 s (a killed driver's code may still be
    forking), so that no test sees another's leftovers."""
    quiet = 0
    for _ in range(500):
        pids = sandbox_driver.leftovers(uid)
        quiet = 0 if pids else quiet + 1
        if quiet == 20:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def drive(request, ask: dict, wrapper: list[str] = ()) -> dict:
    """The driver's answer to ``ask``, run as nobody (by ``runuser``, or by ``wrapper``)."""
    python, folder = request.getfixturevalue("nobody_copy")
    start_as_nobody = list(wrapper) or ["runuser", "-u", "nobody", "--"]
    folders = set(Path(tempfile.gettempdir()).glob("hybridflow-sandbox-*"))
    try:
        done = subprocess.run(
            [*start_as_nobody, python, "-I", "-S", str(folder / "sandbox_driver.py"), str(folder)],
            input=json.dumps(ask),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
    finally:  # what unsafe calls leave behind (their driver killed by the code): processes, work folders
        nobody = pwd.getpwnam("nobody").pw_uid
        if not ask["modes"]:
            _kill_all(nobody)
        for leftover in set(Path(tempfile.gettempdir()).glob("hybridflow-sandbox-*")) - folders:
            if leftover.stat().st_uid == nobody:
                shutil.rmtree(leftover, ignore_errors=True)
    assert done.returncode == 0 and done.stdout, f"the driver failed: {done.stderr[-2000:]}"
    return json.loads(done.stdout)


def sandboxed(mode: str, request, codes: list[str], scenario: str = "calls", limits: SandboxLimits = LIMITS):
    """{"results": [result dict per call], "leftovers": [pid of sandboxed code still running]}."""
    if mode == "root":
        run = {"calls": sandbox_driver.calls, "pair": sandbox_driver.pair}[scenario]
        results = run(run_python, limits, [c.replace("DRIVER_PID", str(os.getpid())) for c in codes])
        return {"results": results, "leftovers": sandbox.processes_of(SANDBOX_UIDS)}
    ask = {
        "scenario": scenario,
        "codes": codes,
        "limits": {k: getattr(limits, k) for k in limits.__dataclass_fields__},
        "modes": {"nobody": ["namespaces"], "nobody-bwrap": ["bwrap"], "nobody-unsafe": []}[mode],
    }
    answer = drive(request, ask)
    if "unavailable" in answer:
        pytest.skip(f"{mode}: {answer['unavailable']}")
    return answer


def stdout_of(answer: dict) -> list[str]:
    return [r["stdout"] for r in answer["results"]]


@pytest.fixture
def host_dir():
    """A folder in the host's /tmp that nobody may enter (0777), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="hybridflow-test-host-"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_files_do_not_persist_across_calls(mode, request):
    name = f"hybridflow-{uuid.uuid4().hex}"
    places = [f"/tmp/{name}", f"/dev/shm/{name}", f"/var/tmp/{name}", f"/run/lock/{name}", name]
    write = (
        f"import os\nfor p in {places!r}:\n    try:\n"
        f"        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)\n        os.write(fd, b'{SECRET}')\n"
        "        os.close(fd)\n        print('wrote', p)\n    except OSError as e:\n        print(p, e)"
    )
    read = (
        f"for p in {places!r}:\n    try:\n        print(open(p).read())\n    except OSError as e:\n"
        "        print(p, type(e).__name__)"
    )
    try:
        answer = sandboxed(mode, request, [write, read])
        wrote, reread = stdout_of(answer)
        assert "wrote /tmp/" in wrote and "wrote /dev/shm/" in wrote  # the private ones are writable
        assert SECRET not in reread
        assert not [p for p in places[:4] if os.path.exists(p)], "a file reached the host"
    finally:
        for p in places[:4]:
            Path(p).unlink(missing_ok=True)


SHM = """
import ctypes
import dataclasses
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 64)]
KEY = {key}
"""
SHM_WRITE = (
    SHM
    + """
shm = libc.shmget(KEY, 4096, 0o1000 | 0o600)
ctypes.memmove(libc.shmat(shm, None, 0), b"{secret}", {n})
queue = libc.msgget(KEY, 0o1000 | 0o600)
print(shm >= 0, queue >= 0, libc.msgsnd(queue, ctypes.byref(Msg(1, b"{secret}")), 64, 0) == 0)
"""
)
SHM_READ = (
    SHM
    + """
shm = libc.shmget(KEY, 0, 0)
print(ctypes.string_at(libc.shmat(shm, None, 0o10000), {n}) if shm >= 0 else "no segment")
queue, msg = libc.msgget(KEY, 0), Msg()
print(msg.mtext if queue >= 0 and libc.msgrcv(queue, ctypes.byref(msg), 64, 0, 0o4000) > 0 else "no queue")
"""
)


def _host_ipc(key: int) -> list[str]:
    """The host's SysV shared memory segments and message queues with ``key``."""
    found = []
    for kind in ("shm", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            found += [
                f"{kind} {line.split()[1]}" for line in f.readlines()[1:] if int(line.split()[0]) == key
            ]
    return found


def _remove_host_ipc(key: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for get, ctl in ((libc.shmget, libc.shmctl), (libc.msgget, libc.msgctl)):
        ident = get(key, 0, 0)
        if ident >= 0:
            ctl(ident, 0, None)  # IPC_RMID


def test_sysv_ipc_does_not_outlive_the_call(mode, request):
    key = 0x4859_0000 + uuid.uuid4().int % 0xFFFF
    fill = {"key": key, "secret": SECRET, "n": len(SECRET)}
    try:
        answer = sandboxed(mode, request, [SHM_WRITE.format(**fill), SHM_READ.format(**fill)])
        made, reread = stdout_of(answer)
        assert made == "True True True\n", answer["results"][0]  # the code could make both
        assert SECRET not in reread and reread == "no segment\nno queue\n"
        assert _host_ipc(key) == []
    finally:
        _remove_host_ipc(key)


def test_the_hosts_tmp_a_live_ray_session_and_the_trainers_files_are_out_of_reach(mode, request, host_dir):
    """Ray makes /tmp/ray/session_latest/sockets 0777; a fake one in the host's /tmp stands for it. The
    trainer's run folder (0700, its checkpoint 0600) belongs to whoever started the sandbox: as nobody,
    the code's host user id is the trainer's own."""
    sockets = host_dir / "session_latest" / "sockets"
    sockets.mkdir(parents=True)
    for folder in (host_dir / "session_latest", sockets):
        folder.chmod(0o777)
    (sockets / "raylet").write_text("the trainer's socket")
    (host_dir / "notes").write_text(SECRET)
    run_folder = host_dir / "run"
    run_folder.mkdir(mode=0o700)
    (run_folder / "ckpt").write_text(SECRET)
    (run_folder / "ckpt").chmod(0o600)
    trainer = 0 if mode == "root" else pwd.getpwnam("nobody").pw_uid
    for path in (run_folder, run_folder / "ckpt"):
        os.chown(path, trainer, trainer)
    d, ckpt = str(sockets), str(run_folder / "ckpt")
    code = (
        f"import os\nfor act in (lambda: open({d!r} + '/evil', 'w').write('x'),\n"
        f"            lambda: os.unlink({d!r} + '/raylet'), lambda: os.rename({d!r}, {d!r} + '-gone'),\n"
        f"            lambda: print(open({str(host_dir / 'notes')!r}).read()),\n"
        f"            lambda: print(open({ckpt!r}).read()), lambda: os.unlink({ckpt!r}),\n"
        f"            lambda: print({host_dir.name!r} in os.listdir('/tmp'))):\n"
        "    try:\n        act()\n    except OSError as e:\n        print(type(e).__name__)"
    )
    (out,) = stdout_of(sandboxed(mode, request, [code]))
    assert SECRET not in out and "True" not in out
    assert (
        sorted(os.listdir(sockets)) == ["raylet"]
        and (sockets / "raylet").read_text() == "the trainer's socket"
    )
    assert (run_folder / "ckpt").read_text() == SECRET


def test_one_output_cap_for_stdout_and_stderr_together(mode, request):
    code = "import sys\nsys.stdout.write('o' * 9900)\nsys.stdout.flush()\nsys.stderr.write('e' * 9900)"
    (result,) = sandboxed(mode, request, [code])["results"]
    assert len(result["stdout"]) + len(result["stderr"]) <= LIMITS.max_output_bytes
    assert result["error"] == "output limit exceeded: stopped after 10000 bytes" and result["truncated"]


def test_two_processes_never_share_a_user_id_and_one_call_never_kills_another(mode, request):
    """A fork after import runs a second call while the first is running: they hold distinct user ids
    (as root; without root each has its own user namespace), and the second's end leaves the first alone."""
    first = "import os, time\nprint(os.getuid())\nfor i in range(15):\n    time.sleep(0.1)\nprint('done')"
    second = "import os\nprint(os.getuid())"
    answer = sandboxed(mode, request, [first, second], scenario="pair")
    a, b = answer["results"]
    assert a["error"] is None and a["stdout"].endswith("done\n"), a
    assert b["error"] is None, b
    if mode == "root":
        assert a["stdout"].split()[0] != b["stdout"].split()[0]


def test_a_kill_is_reported_as_what_it_was_cpu_spin_and_memory_bomb_included(mode, request):
    codes = [
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",  # killed, not by a limit
        "while True:\n    pass",
        "x = []\nwhile True:\n    x.append(' ' * 10 ** 6)",
    ]
    killed, spin, memory = sandboxed(mode, request, codes)["results"]
    assert killed["error"].startswith("killed") and "CPU" not in killed["error"]
    assert spin["error"] == "CPU time limit exceeded (1 s)" and spin["duration_s"] < 15
    assert memory["error"] == "memory limit exceeded (256 MB)"


def test_the_trainer_cannot_be_signalled_and_no_orphan_survives(mode, request):
    """The code tries to kill the process that started the sandbox (the test's, or the driver's as
    nobody) and its own parent, and leaves a detached sleeper behind."""
    code = (
        "import os, signal, time\nfor pid in (DRIVER_PID, os.getppid()):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
        "print('left a sleeper')"
    )
    answer = sandboxed(mode, request, [code])
    assert "left a sleeper" in answer["results"][0]["stdout"]  # and the driver lived to report it
    assert answer["leftovers"] == []


def test_fork_bomb_is_contained(mode, request):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    limits = SandboxLimits(**{**LIMITS.__dict__, "timeout_s": 2.0})
    answer = sandboxed(mode, request, [bomb, "print('after')"], limits=limits)
    bombed, after = answer["results"]
    assert bombed["error"] in ("timed out after 2 s (wall clock)", "CPU time limit exceeded (1 s)"), bombed
    assert after["stdout"] == "after\n" and answer["leftovers"] == [], answer


def test_disk_fill_stops_at_the_private_tmp_size(mode, request):
    """At most 64 MB are attempted, in 1 MB files (each under the file-size limit): the private /tmp
    holds ``tmp_size_mb`` (8 MB here); the host's disk never sees them."""
    code = (
        "import os\nos.chdir('/tmp')\nwritten = 0\ntry:\n    for i in range(64):\n"
        "        with open(f'fill{i}', 'wb') as f:\n            f.write(b'0' * 2 ** 20)\n"
        "        written += 1\nfinally:\n    print(written)"
    )
    limits = SandboxLimits(**{**LIMITS.__dict__, "tmp_size_mb": 8})
    (result,) = sandboxed(mode, request, [code], limits=limits)["results"]
    assert int(result["stdout"]) <= 8 and result["error"] == "disk limit exceeded (8 MB in /tmp)"


def test_hundred_megabytes_of_output_stop_at_the_cap(mode, request):
    code = "import sys\nsys.stdout.write('x' * 50_000_000)\nsys.stderr.write('y' * 50_000_000)"
    (result,) = sandboxed(mode, request, [code])["results"]
    assert len(result["stdout"]) + len(result["stderr"]) <= LIMITS.max_output_bytes and result["truncated"]


@pytest.fixture
def busy_machine():
    """Every core kept busy by another process for the test's length (what other jobs do to a trainer)."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
    ]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize("timeout_s", [0.5, 1.0, 2.0])
def test_the_wall_clock_holds_within_0_3_s_on_a_busy_machine(mode, request, timeout_s, busy_machine):
    """Before: 1.0-3.0 s for a 1 s limit, 2.0-4.0 s for 2 s (the call waited, after the kill, for the machine's
    init to reap the call's orphaned process 1, which it does in whole seconds); the first call of a process
    also probes the machine's modes, which counts too."""
    limits = dataclasses.replace(LIMITS, timeout_s=timeout_s)
    (result,) = sandboxed(mode, request, ["import time\ntime.sleep(30)"], limits=limits)["results"]
    assert result["error"] == f"timed out after {timeout_s:g} s (wall clock)"
    assert result["duration_s"] <= timeout_s + 0.3, result


# Starts a command as nobody in a user namespace (root and nobody mapped) that may create no user
# namespace below it: a machine without unprivileged user namespaces, where bubblewrap fails too.
NO_USER_NAMESPACES = """
import ctypes, os, sys
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
        os._exit(90)
    os.write(ready_w, b"x")
    os.read(go_r, 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    os.execv(sys.argv[1], sys.argv[1:])
os.read(ready_r, 1)
for kind in ("uid", "gid"):
    with open(f"/proc/{pid}/{kind}_map", "w") as f:
        f.write("0 0 1\\n65534 65534 1\\n")
os.write(go_w, b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_without_user_namespaces_a_non_root_user_is_refused_in_one_line_unless_unsafe(request, tmp_path):
    if pwd.getpwnam("nobody").pw_uid != 65534:
        pytest.skip("the wrapper maps nobody as user 65534")
    (tmp_path / "wrap.py").write_text(NO_USER_NAMESPACES)
    wrapper = [sys.executable, "-I", "-S", str(tmp_path / "wrap.py")]
    ask = {"scenario": "calls", "codes": ["print(6 * 7)"], "limits": {}, "modes": ["namespaces", "bwrap"]}
    refused = drive(request, ask, wrapper)["unavailable"]
    assert "cannot isolate code on this machine" in refused and "\n" not in refused
    assert "allow unprivileged user namespaces" in refused and "install bubblewrap" in refused
    assert f"{sandbox.UNSAFE_KEY}=true" in refused
    (result,) = drive(request, {**ask, "modes": []}, wrapper)["results"]
    assert result["stdout"] == "42\n" and result["mode"] == "unsafe"
