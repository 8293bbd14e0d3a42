"""Host memory helpers (superslm/memory.py): freeze_heap, which the CLI, `superslm serve` and `superslm bench` call
once their model is loaded."""

from __future__ import annotations

import gc
import weakref

from superslm.memory import freeze_heap


class _Node:
    pass


def test_freeze_heap_collects_then_freezes_the_live_objects() -> None:
    cycle = _Node()
    cycle.self = cycle  # type: ignore[attr-defined]
    gone = weakref.ref(cycle)
    del cycle
    kept = _Node()
    before = gc.get_freeze_count()
    try:
        freeze_heap()
        assert gone() is None  # unreachable cycles are collected first, not frozen with the rest
        assert gc.get_freeze_count() > before
        assert gc.is_tracked(kept) and kept is not None
    finally:
        gc.unfreeze()  # the test worker's heap as it was
