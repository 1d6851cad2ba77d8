"""The sandbox's first process: runs as ``python -I -S sandbox_runner.py SPEC_JSON`` (stdlib only).

Why a runner of our own rather than exec'ing the code directly: it is the trusted process that sets the
limits, leaves the network, drops to the sandbox's user id and then reports on a private pipe exactly how
the code ended (exit code, or the signal that killed it). Under ``unshare --pid`` it is process 1 of a
new PID namespace, so when it exits every process the code started is killed by the kernel.

SPEC_JSON: {"argv": [...], "cwd": str, "uid": int | null, "limits": {"cpu_s", "memory_mb",
"file_size_mb", "max_processes", "open_files"}, "net": "unshared" | "try" | "off", "status_fd": int,
"setpriv": path of util-linux setpriv or null}. The
status goes to ``status_fd`` as one JSON object: {"exit": int} or {"signal": int}, plus "network_isolated": bool.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000


def leave_network(mode: str) -> bool:
    """Whether the process now has a network namespace of its own (only a loopback that is down)."""
    if mode == "unshared":
        return True  # the `unshare --net` that started us did it
    if mode != "try":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    return libc.unshare(flags) == 0


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
    """In the child: limits, user id, folder, then the code with an empty environment."""
    limits, uid = spec["limits"], spec["uid"]
    mb = 1024 * 1024
    nproc = limits["max_processes"]
    if uid is None and os.getuid() != 0:  # RLIMIT_NPROC counts every task of the real user id
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
    argv = spec["argv"]
    if uid is not None and spec["setpriv"]:
        # setpriv changes the ids as it execs, so an interpreter under a private home (pyenv in /root)
        # is still found; the code itself then runs with no capabilities and cannot gain any
        argv = [
            spec["setpriv"],
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
            *argv,
        ]
    elif uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.execve(argv[0], argv, {})


def main() -> None:
    spec = json.loads(sys.argv[1])
    status = os.fdopen(spec["status_fd"], "w")
    isolated = leave_network(spec["net"])
    pid = os.fork()
    if pid == 0:
        try:
            status.close()
            limit_and_exec(spec)
        except BaseException as err:  # noqa: BLE001 - report any failure to start, then die
            os.write(2, f"sandbox: could not start the code: {type(err).__name__}: {err}\n".encode())
        os._exit(127)
    _, code = os.waitpid(pid, 0)
    ended = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"exit": os.WEXITSTATUS(code)}
    status.write(json.dumps({**ended, "network_isolated": isolated}))
    status.close()


if __name__ == "__main__":
    main()
