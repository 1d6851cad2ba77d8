"""``return_freed_memory``: freed blocks go back to the OS at once instead of staying in the process."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from hybridflow.utils.memory import return_freed_memory

    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    if sys.argv[1] == "return":
        assert return_freed_memory()
    before = rss_mib()
    for _ in range(2):  # glibc maps the first 16 MiB block, then raises its threshold: the second stays
        block = torch.ones(4 * 2**20)
        del block
    print(round(rss_mib() - before))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings")
def test_freed_blocks_leave_the_process_only_when_asked():
    def kept_mib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert kept_mib("keep") >= 12  # glibc's default: the second 16 MiB block is kept after it is freed
    assert kept_mib("return") <= 4
