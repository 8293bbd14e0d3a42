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


def freeze_heap() -> None:
    """For a process that keeps the models it has loaded from here on (a CLI command, a one-model server, a
    benchmark): collect what loading left unreachable, then move every live object to the garbage collector's
    permanent generation, so its full collections stop walking them (~180k objects after `import torch`: a full
    collection took 60 ms, and their share of a small model's decode was 3-8%; vLLM freezes its heap after start-up
    too). Those objects are still freed by their reference counts; reference cycles among them are never
    collected, so code that loads and drops models in a loop should not call it."""
    import gc

    gc.collect()
    gc.freeze()
