"""Host memory: what is available, and handing back what a load no longer needs (bottom layer: no superslm
imports)."""

from __future__ import annotations

import os


def available_memory() -> int:
    """Bytes of host memory available to this process now (Linux's MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def release_freed_memory() -> None:
    """Return glibc's freed heap to the OS: a load's temporaries otherwise stay in RSS (and in its peak,
    when the next layer's temporaries are placed beside them). A hint only: a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
