"""Whether a process still runs, by pid: how a file named after its owner's pid tells a live owner from a dead one.

May import: nothing of hybridflow.
"""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (someone else's counts: it is alive, just not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
