"""Runs sandbox calls for the attack tests and returns what each saw, the same way as root and as nobody.

As root the tests import it; for the non-root modes they run it as a script under ``runuser -u nobody``
(stdlib only, with a copy of the sandbox's modules that nobody can read), the request as JSON on stdin and
the answer as JSON on stdout (``DRIVER_PID`` in the code becomes the driver's process id): {"results": [SandboxResult as a dict], "leftovers": [pid], "alive": true}
or {"unavailable": why} when the requested mode cannot be created here.
"""

import dataclasses
import functools
import json
import os
import sys
import time
import types


def calls(run_python, limits, codes: list[str]) -> list[dict]:
    """One call after the other (what a conversation's turns do)."""
    return [dataclasses.asdict(run_python(code, limits)) for code in codes]


def pair(run_python, limits, codes: list[str], delay_s: float = 0.5) -> list[dict]:
    """Two calls at once from two processes, a fork after import (what two Ray workers or a forked
    trainer do): the child starts the second call ``delay_s`` after the parent started the first."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            time.sleep(delay_s)
            os.write(write, json.dumps(dataclasses.asdict(run_python(codes[1], limits))).encode())
        finally:
            os._exit(0)
    os.close(write)
    first = dataclasses.asdict(run_python(codes[0], limits))
    with os.fdopen(read) as f:
        second = json.loads(f.read())
    os.waitpid(pid, 0)
    return [first, second]


def leftovers(uid: int | None = None) -> list[int]:
    """Processes of ``uid`` (default: ours) that run sandboxed code (``main.py``), other than this one."""
    uid = os.getuid() if uid is None else uid
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                owner = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, StopIteration):
            continue
        if owner == uid and b"main.py" in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def _import_sandbox(root: str):
    """The sandbox module from the copy at ``root``, without the package's heavy ``__init__``s."""
    for name in ("hybridflow", "hybridflow.tools", "hybridflow.utils"):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = module
    sys.path.insert(0, root)
    from hybridflow.tools import sandbox

    return sandbox


def main() -> None:
    request = json.loads(sys.stdin.read())
    sandbox = _import_sandbox(sys.argv[1])
    sandbox.MODES = tuple(request["modes"])  # none: the unsafe opt-out
    try:
        sandbox.sandbox_mode(allow_unsafe=not sandbox.MODES)
    except sandbox.SandboxUnavailable as err:
        print(json.dumps({"unavailable": str(err)}))
        return
    scenario = {"calls": calls, "pair": pair}[request["scenario"]]
    limits = sandbox.SandboxLimits(**request["limits"])
    codes = [code.replace("DRIVER_PID", str(os.getpid())) for code in request["codes"]]
    results = scenario(functools.partial(sandbox.run_python, allow_unsafe=not sandbox.MODES), limits, codes)
    print(json.dumps({"results": results, "leftovers": leftovers(), "alive": True}))


if __name__ == "__main__":
    main()
