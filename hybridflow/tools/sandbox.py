"""Running model-written Python in a separate, limited process: one fresh sandbox per call.

What holds, in the modes ``namespaces`` (as root, or with unprivileged user namespaces) and ``bwrap``
(bubblewrap), each checked by tests/tools/test_sandbox*.py with the attacks a policy could learn:
- the call's own mount, PID, network, IPC and UTS namespaces: a root file system of its own with only the
  system folders and the interpreter, read-only; private size-limited tmpfs at ``/tmp`` (the work dir),
  ``/var/tmp``, ``/dev/shm`` and ``/run/lock``, the only writable places, gone with the call; nothing
  else of the host (its /tmp, Ray's session, your home and run folder) is visible; SysV IPC and POSIX
  queues die with the call; no network, not even the host's loopback; the code sees and can signal only
  its own processes, and all of them die when the call ends;
- an unprivileged user: as root, a user id of the call's own, held machine-wide (``sandbox_uids``);
  without root, user 1000 of a nested user namespace, with no capabilities;
- wall-clock timeout, CPU time, address space, file size, number of processes, open files, no core
  dumps; an empty environment; no inherited file descriptors; ``python -I -S``;
- one output cap for stdout and stderr together; a kill is reported as what it was (CPU limit, wall
  clock, memory, output, or killed from outside).

What does not: without root the code's processes belong to the trainer's user id on the host (invisible
to them, but its files in the read-only system and interpreter folders are its own); the sandbox is not
a boundary against kernel exploits: run untrusted users' code in a VM or gVisor.

When neither mode works the tool refuses to run (``SandboxUnavailable``, one line saying why and how to
enable one), unless the user set ``sandbox.unsafe_without_isolation``: then only the limits above
hold, and the code runs as the trainer's own user (reads its files, signals its processes).
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
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from hybridflow.tools.sandbox_uids import allocated_uid
from hybridflow.utils.errors import UserError

RUNNER = Path(__file__).with_name("sandbox_runner.py")
PYTHON = os.path.realpath(sys.executable)  # the interpreter itself, not a virtualenv's link to it
MODES = ("namespaces", "bwrap")  # tried in this order; "unsafe" only when the user opts out
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
ISOLATION = {  # what each mode isolates (the keys of SandboxResult.isolation)
    "namespaces": ("network", "pid_namespace", "ipc_namespace", "private_tmp", "host_files_hidden"),
    "bwrap": ("network", "pid_namespace", "ipc_namespace", "private_tmp", "host_files_hidden"),
    "unsafe": (),
}
ISOLATION_KEYS = (*ISOLATION["namespaces"], "own_user")
UNSAFE_KEY = "sandbox.unsafe_without_isolation"  # the config key of the opt-out


class SandboxUnavailable(UserError):
    """This machine can create no isolated sandbox and the user did not opt out."""


@dataclass
class SandboxLimits:
    """Per-call limits; the defaults suit short arithmetic/data snippets."""

    timeout_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 16
    open_files: int = 64
    max_output_bytes: int = 10_000  # stdout and stderr together
    tmp_size_mb: int = 16  # each private tmpfs (/tmp, /var/tmp, /dev/shm, /run/lock)


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
    mode: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def _bwrap_command(limits: SandboxLimits, binds: list[str]) -> list[str]:
    binary = shutil.which("bwrap")
    if binary is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    command = [binary, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    command += ["--as-pid-1"]  # the runner is process 1: the code can neither kill it nor outlive it
    command += ["--new-session", "--uid", "1000", "--gid", "1000", "--clearenv"]
    for path in binds:
        if os.path.exists(path):
            command += ["--ro-bind", path, path]
    command += ["--dev", "/dev", "--proc", "/proc"]
    for path in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        command += ["--perms", "1777", "--size", str(limits.tmp_size_mb * 2**20), "--tmpfs", path]
    command += ["--ro-bind", str(RUNNER), "/run/sandbox_runner.py", "--remount-ro", "/", "--chdir", "/tmp"]
    return [*command, PYTHON, "-I", "-S", "/run/sandbox_runner.py"]


def _binds() -> list[str]:
    """Folders the code's file system shows read-only: the system's and the interpreter's (its binary and
    its standard library; a virtualenv's packages are not needed under ``-S``)."""
    folders = list(SYSTEM_FOLDERS)
    for path in map(os.path.realpath, (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(PYTHON))):
        if not any(path == f or path.startswith(f + "/") for f in folders):
            folders.append(path)
    return folders


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
    """SIGKILL every process of ``uid`` (which only this call holds), until none is left: a fork bomb may
    fork between the scan and the kill."""
    for _ in range(200):
        pids = processes_of(range(uid, uid + 1))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _call_namespace(runner: int) -> str | None:
    """The PID namespace of the call the process ``runner`` started (ours: the one it unshared; with
    bubblewrap: its child's), or None when it is gone or not made yet."""
    own = os.readlink("/proc/self/ns/pid")
    try:
        found = [os.readlink(f"/proc/{runner}/ns/pid_for_children")]
        with open(f"/proc/{runner}/task/{runner}/children") as f:
            found += [os.readlink(f"/proc/{child}/ns/pid") for child in f.read().split()]
    except OSError:
        return None
    return next((namespace for namespace in found if namespace != own), None)


def _wait_until_gone(namespace: str, seconds: float = 5.0) -> None:
    """Until no live process of the call's PID namespace is left: the kernel tears a killed namespace down
    asynchronously, and a call's user id goes back to the pool (or the caller goes on) only after. A zombie
    does not count: the namespace's process 1 becomes one only once every other process of it has gone, and
    orphaned (its parent, the runner, killed with it) it waits for the machine's init to reap it, which may
    take seconds (measured: 1-2 s, in whole seconds, on this project's machines)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == namespace and not _zombie(pid):
                    break
            except OSError:
                continue
        else:
            return
        time.sleep(0.005)


def _zombie(pid: str) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (its state, after the parenthesised command name)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "Z"


@dataclass
class _Output:
    stdout: bytes = b""
    stderr: bytes = b""
    status: bytes = b""
    timed_out: bool = False
    over_cap: bool = False


def _read_capped(proc: subprocess.Popen[bytes], status_fd: int, deadline: float, cap: int) -> _Output:
    """The code's stdout and stderr (at most ``cap`` bytes together) and the runner's status, until the
    runner has reported (the code ended) and the output read so far is drained, the deadline passes, or
    the output exceeds ``cap``."""
    if proc.stdout is None or proc.stderr is None:  # _supervise starts it with both piped
        raise RuntimeError("the sandbox runner was started without its output pipes")
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
    out.stdout = bytes(got["stdout"][:cap])
    out.stderr = bytes(got["stderr"][: cap - len(out.stdout)])
    out.status = bytes(got["status"])
    return out


def _describe(status: dict, stderr: str, limits: SandboxLimits) -> str | None:
    if "signal" in status:
        sig = status["signal"]
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and status.get("cpu_s", 0.0) >= limits.cpu_s):
            return f"CPU time limit exceeded ({limits.cpu_s} s)"
        if sig == signal.SIGXFSZ:
            return f"file size limit exceeded ({limits.file_size_mb} MB per file)"
        if sig == signal.SIGKILL:
            return "killed (SIGKILL from outside the sandbox, before any of its limits was reached)"
        return f"killed by signal {signal.Signals(sig).name}"
    code = status.get("exit")
    if code == 0:
        return None
    if "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
        return f"file size limit exceeded ({limits.file_size_mb} MB per file)"
    if "No space left on device" in stderr:
        return f"disk limit exceeded ({limits.tmp_size_mb} MB in /tmp)"
    if "MemoryError" in stderr:
        return f"memory limit exceeded ({limits.memory_mb} MB)"
    if "sandbox: could not start" in stderr:
        return stderr.strip().splitlines()[-1]
    return f"exited with code {code}"


def _run(code: str, limits: SandboxLimits, mode: str, started: float | None = None) -> SandboxResult:
    """One call in ``mode`` (see ``MODES``), its wall clock running from ``started`` (default: now); never
    raises for anything the code does."""
    started = time.monotonic() if started is None else started
    with ExitStack() as stack:
        root = os.geteuid() == 0
        uid = stack.enter_context(allocated_uid()) if root and mode != "bwrap" else None
        spec, command = _prepare(code, limits, mode, uid, stack)
        out, returncode = _supervise(command, spec, limits, started + limits.timeout_s)
        if uid is not None and mode == "unsafe":  # no namespace: the leftovers, by the id only it holds
            _kill_user(uid)
    return _verdict(out, returncode, spec, limits, uid, started)


def _prepare(
    code: str, limits: SandboxLimits, mode: str, uid: int | None, stack: ExitStack
) -> tuple[dict, list[str]]:
    """The runner's spec (``sandbox_runner.py``'s docstring) and the command that starts it (inside bubblewrap
    in mode ``bwrap``); the unsafe mode's work folder, a fresh one of the host's, goes when ``stack`` closes."""
    if uid is not None and shutil.which("setpriv") is None:
        raise SandboxUnavailable("util-linux setpriv is not installed (the code's user id needs it)")
    spec: dict[str, Any] = {
        "mode": mode,
        "code": code,
        "python": PYTHON,
        "uid": uid,
        "setpriv": shutil.which("setpriv"),
        "cwd": "/tmp",
        "binds": _binds(),
        "limits": {k: v for k, v in asdict(limits).items() if k not in ("timeout_s", "max_output_bytes")},
    }
    command = [sys.executable, "-I", "-S", str(RUNNER)]
    if mode == "bwrap":
        command = _bwrap_command(limits, spec["binds"])
    elif mode == "unsafe":
        spec["cwd"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-"))
        if uid is not None:
            os.chown(spec["cwd"], uid, uid)
    return spec, command


def _supervise(command: list[str], spec: dict, limits: SandboxLimits, deadline: float) -> tuple[_Output, int]:
    """Start the runner, read what the code writes (capped) until it ends or ``deadline``, then end the call:
    the runner's process group killed and, with namespaces, the call's PID namespace empty. Returns the output
    and the runner's exit status."""
    status_r, status_w = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                pass_fds=(status_w,),
                env={},
                start_new_session=True,
            )
        finally:
            os.close(status_w)
        with proc:
            if proc.stdin is None:  # started with stdin piped, just above
                raise RuntimeError("the sandbox runner was started without its input pipe")
            try:
                proc.stdin.write(json.dumps({**spec, "status_fd": status_w}).encode())
                proc.stdin.close()
            except BrokenPipeError:  # the runner died at once: its stderr says why
                pass
            out = _read_capped(proc, status_r, deadline, limits.max_output_bytes)
            namespace = _call_namespace(proc.pid) if spec["mode"] != "unsafe" else None
            if not (out.timed_out or out.over_cap):  # the runner ends once the namespace is torn down
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc)  # a timed-out or flooding run; the PID namespace dies with the runner
            proc.wait()
    finally:
        os.close(status_r)
    if namespace is not None:
        _wait_until_gone(namespace)
    return out, proc.returncode


def _verdict(
    out: _Output, returncode: int, spec: dict, limits: SandboxLimits, uid: int | None, started: float
) -> SandboxResult:
    """What the call's output and the runner's status say: the result, with one line for what went wrong."""
    text = out.status.decode()
    status = json.loads(text) if text else {}
    stdout = out.stdout.decode(errors="replace")
    stderr = out.stderr.decode(errors="replace")
    if spec["mode"] == "unsafe":
        stderr = stderr.replace(f"{spec['cwd']}/", "")  # tracebacks say "main.py" in every mode
    else:
        stderr = stderr.replace("/tmp/main.py", "main.py")
    error: str | None
    if out.timed_out:
        error = f"timed out after {limits.timeout_s:g} s (wall clock)"
    elif out.over_cap:
        error = f"output limit exceeded: stopped after {limits.max_output_bytes} bytes"
    elif not status:
        last = (stderr.strip().splitlines() or [f"exit code {returncode}"])[-1][-300:]
        error = (
            last if last.startswith("sandbox: could not start") else f"the sandbox failed to start: {last}"
        )
    else:
        error = _describe(status, stderr, limits)
    isolated = {key: key in ISOLATION[spec["mode"]] for key in ISOLATION_KEYS}
    isolated["own_user"] = uid is not None
    return SandboxResult(
        stdout,
        stderr,
        status.get("exit"),
        error,
        time.monotonic() - started,
        truncated=out.over_cap,
        isolation=isolated,
        mode=spec["mode"],
    )


@cache
def _why_not(mode: str) -> str | None:
    """None when ``mode`` runs a trivial program here, else why not (one short phrase)."""
    if mode == "bwrap" and os.geteuid() == 0:
        return "bubblewrap is not used as root"
    try:
        probe = _run("print('ok')", SandboxLimits(timeout_s=30.0), mode)
    except SandboxUnavailable as err:
        return str(err)
    if probe.ok and probe.stdout == "ok\n":
        return None
    return f"{mode}: {probe.error}"


def sandbox_mode(allow_unsafe: bool = False) -> str:
    """The first of ``MODES`` that works on this machine; ``unsafe`` if none does and ``allow_unsafe``.
    Raises ``SandboxUnavailable`` (one line: why, and how to enable a sandbox) otherwise."""
    reasons = []
    for mode in MODES:
        why = _why_not(mode)
        if why is None:
            return mode
        reasons.append(why)
    if allow_unsafe:
        return "unsafe"
    raise SandboxUnavailable(
        f"the python tool cannot isolate code on this machine ({'; '.join(reasons)}): allow unprivileged "
        "user namespaces (sysctl user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1 "
        "kernel.apparmor_restrict_unprivileged_userns=0), install bubblewrap, or run as root; or set "
        f"{UNSAFE_KEY}=true to run it as your own user, able to read your files and kill your processes"
    )


def isolation(allow_unsafe: bool = False) -> dict[str, bool]:
    """What the sandbox isolates on this machine (run a trivial program and read what it reported)."""
    return run_python("pass", allow_unsafe=allow_unsafe).isolation


def run_python(code: str, limits: SandboxLimits | None = None, allow_unsafe: bool = False) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandbox; never raises for anything the code does. Raises
    ``SandboxUnavailable`` when this machine cannot isolate it and ``allow_unsafe`` is false. The wall clock
    (``limits.timeout_s``) counts from this call, the first one's probe of the machine's modes included."""
    started = time.monotonic()
    return _run(code, limits or SandboxLimits(), sandbox_mode(allow_unsafe), started)
