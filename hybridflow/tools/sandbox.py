"""Running model-written Python in a separate, limited process: one fresh process per call.

What holds (each is checked by tests/tools/test_sandbox.py with hostile snippets):
- wall-clock timeout, then the whole process group is killed (SIGKILL);
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS), size of any written file (RLIMIT_FSIZE), number of
  processes (RLIMIT_NPROC; as root the code runs under a user id of its own, since root ignores it),
  open files, no core dumps;
- an empty environment (no secrets from the trainer's), a fresh temporary working folder deleted
  afterwards, no inherited file descriptors, Python started with ``-I -S`` (no site-packages, no
  user paths);
- output capped at ``max_output_bytes`` (the program is stopped when it writes more);
- with root and util-linux ``unshare``: its own network namespace (no network, not even the host's
  loopback), its own PID namespace (it sees and can signal only its own processes, all killed when it
  ends) and /proc. Without root, the network is cut with an unprivileged user namespace where the
  kernel allows it; ``isolation()`` says what this machine gives.

What does not: the code can read every world-readable file (source, model weights) and write in
world-writable folders such as /tmp (each file capped, not their number). It is not a security boundary
against kernel exploits: use a VM or gVisor for untrusted users; this is for a policy's mistakes.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
UID_BASE = 1_500_000  # user ids no account uses: one per concurrent sandbox, so limits are per call


@dataclass
class SandboxLimits:
    """Per-call limits; the defaults suit short arithmetic/data snippets."""

    timeout_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 16
    open_files: int = 64
    max_output_bytes: int = 10_000


@dataclass
class SandboxResult:
    """How one run ended. ``error`` is None for a clean exit 0, else one line a model (or user) can read."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    duration_s: float
    truncated: bool = False
    isolation: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


class _UidPool:
    """Distinct unprivileged user ids for concurrent runs (RLIMIT_NPROC counts per user id)."""

    def __init__(self, base: int, size: int = 256) -> None:
        self._free = list(range(base + size - 1, base - 1, -1))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("more than 256 sandboxes at once; run fewer tool calls in parallel")
            return self._free.pop()

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


_UIDS = _UidPool(UID_BASE + (os.getpid() % 1000) * 256)


@cache
def _unshare_works() -> bool:
    """Root and util-linux ``unshare`` that can create network, PID and mount namespaces here."""
    binary = shutil.which("unshare")
    if os.geteuid() != 0 or binary is None:
        return False
    probe = subprocess.run(
        [binary, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def isolation() -> dict[str, bool]:
    """What the sandbox isolates on this machine (run a trivial program and read what it reported)."""
    return run_python("pass").isolation


def _command(spec: dict) -> list[str]:
    runner = [sys.executable, "-I", "-S", str(RUNNER), json.dumps(spec)]
    if spec["net"] == "unshared":
        return [shutil.which("unshare"), "--net", "--pid", "--fork", "--kill-child", "--mount-proc", *runner]
    return runner


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def processes_of(uids: range) -> list[int]:
    """Live (not zombie) processes whose real user id is in ``uids``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) in uids and not fields["State"].strip().startswith("Z"):
                found.append(int(pid))
        except (OSError, KeyError, ValueError):
            continue
    return found


def _kill_user(uid: int) -> None:
    """SIGKILL every process of the sandbox's own user id: those that left its process group, and those
    of a PID namespace the kernel is still tearing down."""
    for _ in range(200):  # a fork bomb may fork between the scan and the kill: scan until none is left
        pids = processes_of(range(uid, uid + 1))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


@dataclass
class _Output:
    stdout: bytes = b""
    stderr: bytes = b""
    status: bytes = b""
    timed_out: bool = False
    over_cap: bool = False


def _read_capped(proc: subprocess.Popen, status_fd: int, deadline: float, cap: int) -> _Output:
    """The code's stdout and stderr and the runner's status, until the runner has reported (the code
    ended) and the output read so far is drained, the deadline passes, or the output exceeds ``cap``."""
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_fd: "status"}
    got = {name: bytearray() for name in names.values()}
    out = _Output()
    with selectors.DefaultSelector() as sel:
        for fd in names:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            # once the runner has reported, only what is already written is read (children the code left
            # behind may hold the pipes open)
            reported = status_fd not in sel.get_map()
            ready = sel.select(timeout=0.0 if reported else max(0.0, deadline - time.monotonic()))
            if not ready:
                out.timed_out = not reported
                break
            for key, _ in ready:
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                got[names[key.fd]] += data
            if len(got["stdout"]) + len(got["stderr"]) > cap:
                out.over_cap = True
                break
    out.stdout, out.stderr, out.status = (
        bytes(got["stdout"][:cap]),
        bytes(got["stderr"][:cap]),
        bytes(got["status"]),
    )
    return out


def _describe(status: dict, stderr: str, limits: SandboxLimits) -> str | None:
    if "signal" in status:
        sig = status["signal"]
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return f"CPU time limit exceeded ({limits.cpu_s} s)"
        if sig == signal.SIGXFSZ:
            return f"file size limit exceeded ({limits.file_size_mb} MB per file)"
        return f"killed by signal {signal.Signals(sig).name}"
    code = status.get("exit")
    if code == 0:
        return None
    if "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
        return f"file size limit exceeded ({limits.file_size_mb} MB per file)"
    if "MemoryError" in stderr:
        return f"memory limit exceeded ({limits.memory_mb} MB)"
    if "sandbox: could not start" in stderr:
        return stderr.strip().splitlines()[-1]
    return f"exited with code {code}"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    uid = _UIDS.take() if os.geteuid() == 0 else None
    status_r, status_w = os.pipe()
    try:
        Path(workdir, "main.py").write_text(code)
        if uid is not None:
            for path in (workdir, os.path.join(workdir, "main.py")):
                os.chown(path, uid, uid)
        spec = {
            "argv": [sys.executable, "-I", "-S", "main.py"],
            "cwd": workdir,
            "uid": uid,
            "status_fd": status_w,
            "setpriv": shutil.which("setpriv"),
            "net": "unshared" if _unshare_works() else "try",
            "limits": {k: v for k, v in asdict(limits).items() if k not in ("timeout_s", "max_output_bytes")},
        }
        proc = subprocess.Popen(
            _command(spec),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            pass_fds=(status_w,),
            env={},
            start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        with proc:
            out = _read_capped(proc, status_r, start + limits.timeout_s, limits.max_output_bytes)
            _kill_group(proc)  # the code's leftovers outside a PID namespace; a timed-out or flooding run
            proc.wait()
            if uid is not None:
                _kill_user(uid)
        text = out.status.decode()
        status = json.loads(text) if text else {}
        stdout = out.stdout.decode(errors="replace")
        stderr = out.stderr.decode(errors="replace").replace(f"{workdir}/", "")  # tracebacks say "main.py"
        if out.timed_out:
            error = f"timed out after {limits.timeout_s:g} s (wall clock)"
        elif out.over_cap:
            error = f"output limit exceeded: stopped after {limits.max_output_bytes} bytes"
        elif not status:
            error = f"the sandbox failed to start (exit code {proc.returncode}): {stderr.strip()[-300:]}"
        else:
            error = _describe(status, stderr, limits)
        in_namespaces = spec["net"] == "unshared"
        isolated = {
            "network": in_namespaces or bool(status.get("network_isolated")),
            "pid_namespace": in_namespaces,
            "own_user": uid is not None,
        }
        return SandboxResult(
            stdout,
            stderr,
            status.get("exit"),
            error,
            time.monotonic() - start,
            truncated=out.over_cap,
            isolation=isolated,
        )
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _UIDS.give(uid)
