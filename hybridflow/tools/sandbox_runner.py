"""The sandbox's first process: runs as ``python -I -S sandbox_runner.py`` with the spec as JSON on stdin
(stdlib only: it must start fast and trust nothing but the interpreter).

Why a runner of our own rather than exec'ing the code directly: it is the trusted process that builds the
call's namespaces and file system, sets the limits, drops the code's privileges and then reports on a
private pipe exactly how the code ended (exit code or signal, and the CPU time it used).

Mode ``namespaces`` (as root, or as any user where the kernel allows unprivileged user namespaces):
``unshare`` of mount, PID, network, IPC and UTS namespaces (plus a user namespace without root, mapping
the caller to root inside), then a fork: the child is process 1 of the new PID namespace and dies with
the runner (``PR_SET_PDEATHSIG``), and with it, by the kernel's hand, every process the code started. It
builds a new root on a tmpfs: the system folders and the interpreter's read-only, a fresh ``/proc``, a few
device nodes, and private size-limited tmpfs at ``/tmp`` (the work dir), ``/var/tmp``, ``/dev/shm`` and
``/run/lock``; it pivots into it and detaches the host's root, so nothing else of the host is reachable.
The code then runs as an unprivileged user: the call's own user id as root, or user 1000 of a nested user
namespace without root (it owns no mount, so it cannot undo the mounts; after ``exec`` it has no
capabilities).

Modes ``bwrap`` and ``unsafe``: bubblewrap (or nothing, when the user opted out) made the namespaces; the
runner only sets the limits and runs the code.

Spec: {"mode", "code", "python", "setpriv": path of util-linux setpriv, "uid": int | null, "binds": [path], "status_fd": int, "limits":
{"cpu_s", "memory_mb", "file_size_mb", "max_processes", "open_files", "tmp_size_mb"}}. The status goes to
``status_fd`` as one JSON object: {"exit": int} or {"signal": int}, with "cpu_s": float; a failure to
build the sandbox is written to stderr as one line starting with ``sandbox: could not start``.
"""

import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 2, 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
CODE_UID = 1000  # the code's user id inside its nested user namespace (without root)
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # private tmpfs of every call

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the sandbox failed (the message says which)."""


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data and data.encode(),
        ),
        f"mount {source} on {target}",
    )


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read_only(target: str, keep_devices: bool = False) -> None:
    """Remount a bind mount read-only, keeping the flags the kernel may have locked on it (in a user
    namespace, a remount that would clear nosuid/nodev/noexec is refused)."""
    st = os.statvfs(target)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    flags |= st.f_flag & (MS_NODEV | MS_NOEXEC | 1024 | 2048)  # nodev, noexec, noatime, nodiratime
    if not keep_devices:
        flags |= MS_NODEV
    if st.f_flag & 4096:  # ST_RELATIME -> MS_RELATIME
        flags |= 1 << 21
    mount("none", target, None, flags)


def bind(source: int, target: str, keep_devices: bool = False) -> None:
    """The folder or device node open as ``source`` (an ``O_PATH`` descriptor) at ``target``, read-only."""
    if os.path.isdir(f"/proc/self/fd/{source}"):
        os.makedirs(target, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
        mount(f"/proc/self/fd/{source}", target, None, MS_BIND)
    os.close(source)
    read_only(target, keep_devices)


def build_root(spec: dict) -> None:
    """The call's whole file system (see the module docstring); ends with the new root as ``/``."""
    size_mb = spec["limits"]["tmp_size_mb"]
    # what to show, opened before the new root hides the host's /tmp (an interpreter may live there)
    shown = {path: os.open(path, os.O_PATH) for path in spec["binds"] if os.path.exists(path)}
    devices = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES}
    root = "/tmp"  # any folder will do as the mount point: it is detached with the old root
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mount("sandbox-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path, fd in shown.items():
        bind(fd, root + path)
    for name, fd in devices.items():
        bind(fd, f"{root}/dev/{name}", keep_devices=True)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        os.symlink(f"/proc/self/fd/{fd}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.makedirs(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in SCRATCH:
        os.makedirs(root + path, exist_ok=True)
        mount(
            "sandbox-tmp",
            root + path,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={size_mb}m,nr_inodes=16384,mode=1777",
        )
    arch = platform.machine()
    if arch not in SYS_PIVOT_ROOT:
        raise SetupError(f"pivot_root: no system call number known for {arch}")
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT[arch], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    read_only("/")


def map_user(inside: int, outside: int) -> None:
    """Map ``outside`` (the id in the parent user namespace) to ``inside`` in our new user namespace."""
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{inside} {outside} 1\n")
    write("/proc/self/gid_map", f"{inside} {outside} 1\n")


def processes_of(uid: int) -> int:
    """Tasks (processes and threads) the kernel counts against RLIMIT_NPROC for ``uid``."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return count


def limit_and_exec(spec: dict) -> None:
    """In the code's process: limits, user id, folder, then the code with an empty environment."""
    limits, uid, mode = spec["limits"], spec["uid"], spec["mode"]
    mb = 1024 * 1024
    nproc = limits["max_processes"]
    if mode == "unsafe" and uid is None:  # RLIMIT_NPROC counts every task of the user id, not this call's
        nproc += processes_of(os.getuid())
    for name, value in (
        (resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2),
        (resource.RLIMIT_NPROC, (nproc,) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(name, value)
    os.chdir(spec["cwd"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    argv = [spec["python"], "-I", "-S", "main.py"]
    if uid is not None:  # as root: the call's own user id, no capabilities after execve
        # setpriv changes the ids as it execs, so an interpreter under a private home (pyenv in /root)
        # is still found without namespaces
        argv = [spec["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    elif mode == "namespaces" and os.getuid() == 0:  # root of our user namespace: become user 1000 of a
        check(libc.unshare(CLONE_NEWUSER), "unshare the code's user namespace")  # nested one
        map_user(CODE_UID, 0)
    os.execve(argv[0], argv, {})


def run_code(spec: dict, status) -> None:
    """Fork the code, reap every process until it ends (as process 1, orphans are ours), report."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as process 1, what it does not handle is ignored
    pid = os.fork()
    if pid == 0:
        try:
            status.close()
            limit_and_exec(spec)
        except BaseException as err:  # noqa: BLE001 - report any failure to start, then die
            os.write(2, f"sandbox: could not start the code: {type(err).__name__}: {err}\n".encode())
        os._exit(127)
    while True:
        done, code, usage = os.wait4(-1, 0)
        if done == pid:
            break
    ended = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"exit": os.WEXITSTATUS(code)}
    status.write(json.dumps({**ended, "cpu_s": usage.ru_utime + usage.ru_stime}))
    status.close()


def enter_namespaces(spec: dict, status) -> None:
    """New namespaces, then process 1 of the PID namespace builds the file system and runs the code."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    check(libc.unshare(flags | (CLONE_NEWUSER if uid != 0 else 0)), "unshare the namespaces")
    if uid != 0:
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"0 {uid} 1\n")
        write("/proc/self/gid_map", f"0 {gid} 1\n")
    alive_r, alive_w = os.pipe()  # the runner holds the write end until it exits
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
            if select.select([alive_r], [], [], 0)[0]:  # end of file: the runner died before that line
                os._exit(1)
            os.close(alive_r)
            build_root(spec)
            with open("/tmp/main.py", "w") as f:
                f.write(spec["code"])
            run_code({**spec, "cwd": "/tmp"}, status)
        except BaseException as err:  # noqa: BLE001 - report any failure to start, then die
            os.write(2, f"sandbox: could not start: {type(err).__name__}: {err}\n".encode())
            os._exit(127)
        os._exit(0)
    status.close()
    _, code = os.waitpid(pid, 0)
    sys.exit(os.WEXITSTATUS(code) if os.WIFEXITED(code) else 1)


def main() -> None:
    spec = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    status = os.fdopen(spec["status_fd"], "w")
    if spec["mode"] == "namespaces":
        try:
            enter_namespaces(spec, status)
        except SetupError as err:  # one line for the refusal message, not a traceback
            sys.exit(f"sandbox: could not start: {err}")
        return
    with open(os.path.join(spec["cwd"], "main.py"), "w") as f:
        f.write(spec["code"])
    run_code(spec, status)


if __name__ == "__main__":
    main()
