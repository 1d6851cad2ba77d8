"""Host memory that a worker process hands back to the operating system once it frees it.

Why: glibc's allocator keeps freed heap memory for reuse, and raises the size above which it maps blocks of
their own (and unmaps them on free) each time such a block is freed, up to 32 MiB. A worker that frees a
gathered layer, a checkpoint shard or a batch of logits therefore keeps that memory: measured on a 199M-model
GRPO step over 4 FSDP2 ranks, each rank peaked about 0.45 GiB above its state plus the runtime, so the peak per
rank fell to 0.58x of one rank's instead of 0.39x. Fixing both thresholds (what ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` do when set before a process starts) returns large blocks on free, in a running
process, for every allocation made after the call.

The threshold, 4 MiB, was measured (``bench/memory.py``): the 4-rank update's peak fell to 0.39x at 4 MiB as at
64 KiB, and a SmolLM2 update took as long as with glibc's defaults (9.9 s against 8.9-10.0 s), where 1 MiB
took 12.2 s and 64 KiB 13.3-14.5 s: below a few MiB, the many mid-sized activations of a step are mapped and
zeroed afresh each time.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
RETURN_THRESHOLD = 4 * 2**20  #: freed blocks from this size (bytes) go back to the OS at once


def return_freed_memory(threshold: int = RETURN_THRESHOLD) -> bool:
    """Make this process's allocator give freed blocks of ``threshold`` bytes or more back to the OS at once.

    Returns whether it took effect: only glibc has these settings (Linux; not musl, macOS or Windows), and
    elsewhere the call changes nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
