"""Handing memory a load no longer needs back to the OS (bottom layer: no superslm imports)."""

from __future__ import annotations


def release_freed_memory() -> None:
    """Return glibc's freed heap to the OS: a load's temporaries otherwise stay in RSS (and in its peak,
    when the next layer's temporaries are placed beside them). A hint only: a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
