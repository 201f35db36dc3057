"""fedhead.infra.devices.keep_freed_memory: a freed large block stays in the process and serves the next
allocation, instead of being unmapped and faulted in (and zeroed by the kernel) again. Checked by resident memory,
not by time or fault counts (transparent huge pages change the counts, not what is resident)."""

import os
import platform
import subprocess
import sys

import pytest

MB = 1 << 20
PROBE = """
import numpy as np
from fedhead.infra.devices import keep_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE")
on = keep_freed_memory()
r0 = rss()
a = np.ones(64 << 20, dtype=np.uint8)  # 64 MB, over glibc's default 32 MB mmap ceiling
r1 = rss()
del a
r2 = rss()
b = np.ones(64 << 20, dtype=np.uint8)
r3 = rss()
print(on, r1 - r0, r2 - r0, r3 - r0)
"""


def probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "FEDHEAD_MALLOC"}
    if env_value is not None:
        env["FEDHEAD_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    on, *deltas = out.stdout.split()
    return on == "True", [int(d) for d in deltas]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_block_stays_and_serves_the_next_one():
    on, (grown, after_free, after_second) = probe(None)
    assert on
    assert grown >= 60 * MB  # the block was touched
    assert after_free >= 60 * MB  # freed, it stays in the process ...
    assert after_second < after_free + 8 * MB  # ... and the next block of that size is served from it
    off, (grown, after_free, _) = probe("default")  # glibc's own policy: a block over 32 MB is unmapped on free
    assert not off
    assert grown >= 60 * MB and after_free < 8 * MB
