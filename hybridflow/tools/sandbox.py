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
    probe = subprocess.run([binary, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
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


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """stdout and stderr until both close; (stdout, stderr, timed_out, over_cap)."""
    chunks: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(chunks[proc.stdout.fileno()]), bytes(chunks[proc.stderr.fileno()]), True, False
            for key, _ in sel.select(timeout=left):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                    continue
                chunks[key.fd] += data
                if sum(map(len, chunks.values())) > cap:
                    return (bytes(chunks[proc.stdout.fileno()][:cap]), bytes(chunks[proc.stderr.fileno()][:cap]),
                            False, True)
    return bytes(chunks[proc.stdout.fileno()]), bytes(chunks[proc.stderr.fileno()]), False, False


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
        spec = {"argv": [sys.executable, "-I", "-S", "main.py"], "cwd": workdir, "uid": uid, "status_fd": status_w,
                "setpriv": shutil.which("setpriv"),
                "net": "unshared" if _unshare_works() else "try",
                "limits": {k: v for k, v in asdict(limits).items() if k not in ("timeout_s", "max_output_bytes")}}
        proc = subprocess.Popen(_command(spec), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True, pass_fds=(status_w,), env={},
                                start_new_session=True)
        os.close(status_w)
        status_w = -1
        with proc:
            out, err, timed_out, over_cap = _read_capped(proc, start + limits.timeout_s, limits.max_output_bytes)
            if timed_out or over_cap:
                _kill_group(proc)
            try:  # the code may close its output and keep running
                proc.wait(timeout=max(0.0, start + limits.timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc)  # anything the code left running outside a PID namespace
            proc.wait()
        with os.fdopen(status_r, "r") as f:
            status_r = -1
            text = f.read()
        status = json.loads(text) if text else {}
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if timed_out:
            error = f"timed out after {limits.timeout_s:g} s (wall clock)"
        elif over_cap:
            error = f"output limit exceeded: stopped after {limits.max_output_bytes} bytes"
        elif not status:
            error = f"the sandbox failed to start (exit code {proc.returncode}): {stderr.strip()[-300:]}"
        else:
            error = _describe(status, stderr, limits)
        in_namespaces = spec["net"] == "unshared"
        isolated = {"network": in_namespaces or bool(status.get("network_isolated")), "pid_namespace": in_namespaces,
                    "own_user": uid is not None}
        return SandboxResult(stdout, stderr, status.get("exit"), error, time.monotonic() - start,
                             truncated=over_cap, isolation=isolated)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _UIDS.give(uid)
