"""The program that runs inside a code sample's sandbox: the sample's tests, each in a child process of its own.

Standard library only, and it trusts nothing the model wrote: ``code.py`` sends this file's source followed by
``main(json.loads(SPEC))`` to ``run_python`` (one sandbox per sample). Why a child per test: a test that hangs, crashes,
exits early or floods its output is killed and recorded without touching the others, and the program never
runs in the process that reports. The reporting process:
- never executes the model's code (it only compiles it, to tell a syntax error from a failing test);
- makes itself non-dumpable, so the model's processes (the same user id) can neither read its memory nor
  write to its output through ``/proc``; the children get pipes, never its stdout;
- prints one line, ``RESULT_MARKER`` + JSON, at the end.

What it reports per test is what happened (``done`` with the captured stdout or the returned value,
``error``, ``timeout``, ``output_limit``); it never sees the expected outputs of stdin/stdout and call tests,
which the trusted side compares. Assert tests (HumanEval's ``check``, MBPP's asserts) run the test's code in
the child, after the program, and count as passed only when the test's last statement returned (the child
then writes ``done`` on a pipe of its own): an early ``exit()`` fails.

Spec: {"program", "kind": humaneval | asserts | call | stdio, "setup": code run before each assert test,
"tests": [{"code"} | {"call", "entry_point", "code"} | {"fn_name", "args"} | {"stdin"}], "output_caps":
[bytes per test], "test_timeout_s", "test_cpu_s", "budget_s": seconds for all tests together}.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

RESULT_MARKER = "@@hybridflow-code-result@@"
PR_SET_DUMPABLE = 4
DONE = b"done\n"
ERROR_TAIL = 300  # characters of a failing test's stderr kept for the report
ERROR_BYTES = 4096  # bytes of stderr kept while reading


def _child(
    spec: dict[str, Any], test: dict[str, Any], stdin_fd: int, out_w: int, err_w: int, done_w: int
) -> None:
    """In the test's process: its own session (the parent kills the group), the pipes as 0/1/2 and 3, the
    per-test CPU limit, then the program and the test."""
    os.setsid()
    for fd, target in ((stdin_fd, 0), (out_w, 1), (err_w, 2), (done_w, 3)):
        os.dup2(fd, target)
    os.closerange(4, 1 << 16)
    cpu = int(spec["test_cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    kind, payload = spec["kind"], b""
    namespace: dict[str, Any] = {
        "__name__": "__main__" if kind == "stdio" else "solution",
        "__builtins__": __builtins__,
    }
    try:
        try:
            exec(compile(spec["program"], "solution.py", "exec"), namespace)
        except SystemExit as stop:  # a script that ends with exit(): fine for stdin/stdout programs only
            if kind != "stdio" or stop.code not in (None, 0):
                raise
        if kind == "humaneval":
            exec(compile(test["code"], "test.py", "exec"), namespace)
            namespace[test["call"]](namespace[test["entry_point"]])
        elif kind == "asserts":
            if spec["setup"]:
                exec(compile(spec["setup"], "setup.py", "exec"), namespace)
            exec(compile(test["code"], "test.py", "exec"), namespace)
        elif kind == "call":
            solution = namespace.get("Solution")
            owner = solution() if isinstance(solution, type) else None
            fn = getattr(owner, test["fn_name"]) if owner is not None else namespace[test["fn_name"]]
            payload = json.dumps(fn(*test["args"])).encode()
    except BaseException:  # noqa: BLE001 - whatever the program raised fails this test, nothing else
        sys.stderr.write(traceback.format_exc()[-2000:])
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os.write(3, DONE + payload)
    os._exit(0)


def _read_until_done(
    pid: int, fds: dict[int, str], deadline: float, cap: int | None
) -> tuple[dict[str, bytearray], str | None, int | None]:
    """Read the child's pipes until it has exited and they are drained, the deadline passes (``timeout``)
    or its stdout exceeds ``cap`` (``output_limit``; None: stdout is not kept, however long): ``(bytes per
    pipe name, how it ended or None, its wait status if it was reaped)``. Of stderr only the end is kept."""
    got = {name: bytearray() for name in fds.values()}
    open_fds, ended = set(fds), None
    status: int | None = None
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            ended = "timeout"
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(left, 0.05))
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                open_fds.discard(fd)
            name = fds[fd]
            if name != "out" or cap is not None:
                got[name] += data
            if name == "err" and len(got[name]) > 2 * ERROR_BYTES:
                del got[name][:-ERROR_BYTES]
        if cap is not None and len(got["out"]) > cap:
            ended = "output_limit"
            break
        if status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
        if status is not None and not ready:  # exited, and nothing more came: leftovers may hold the pipes
            break
    return got, ended, status


def _kill(how: Callable[[int, int], None], target: int) -> None:
    try:
        how(target, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_test(spec: dict[str, Any], index: int, seconds: float) -> dict[str, Any]:
    test = spec["tests"][index]
    stdin = tempfile.TemporaryFile()
    stdin.write(test.get("stdin", "").encode())
    stdin.seek(0)
    pipes = [os.pipe() for _ in range(3)]
    pid = os.fork()
    if pid == 0:
        try:
            _child(spec, test, stdin.fileno(), pipes[0][1], pipes[1][1], pipes[2][1])
        finally:
            os._exit(1)
    stdin.close()
    for _, w in pipes:
        os.close(w)
    fds = {pipes[0][0]: "out", pipes[1][0]: "err", pipes[2][0]: "done"}
    cap = spec["output_caps"][index] if spec["kind"] == "stdio" else None
    got, ended, code = _read_until_done(pid, fds, time.monotonic() + seconds, cap)
    _kill(os.killpg, pid)  # the test and whatever it started in its session
    if code is None:
        _kill(os.kill, pid)  # should it not have made its session yet
        _, code = os.waitpid(pid, 0)
    for fd in fds:
        os.close(fd)
    result = {"status": ended or "error"}
    if ended is None and got["done"].startswith(DONE):
        result = {"status": "done", "value": got["done"][len(DONE) :].decode(errors="replace")}
    elif ended is None and os.WIFSIGNALED(code) and os.WTERMSIG(code) in (signal.SIGXCPU, signal.SIGKILL):
        result = {"status": "timeout"}  # the per-test CPU limit
    if spec["kind"] == "stdio":
        result["stdout"] = got["out"][:cap].decode(errors="replace")
    if result["status"] != "done":
        result["error"] = got["err"].decode(errors="replace").strip()[-ERROR_TAIL:]
    return result


def main(spec: dict[str, Any]) -> None:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    try:
        compile(spec["program"], "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        print(RESULT_MARKER + json.dumps({"syntax_error": f"{type(err).__name__}: {err}"[:ERROR_TAIL]}))
        return
    end = time.monotonic() + spec["budget_s"]
    results = []
    for index in range(len(spec["tests"])):
        left = min(spec["test_timeout_s"], end - time.monotonic())
        results.append(
            _run_test(spec, index, left) if left > 0.05 else {"status": "timeout", "skipped": True}
        )
    sys.stdout.write(RESULT_MARKER + json.dumps({"tests": results}) + "\n")
    sys.stdout.flush()
