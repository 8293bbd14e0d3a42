"""Host memory helpers (superslm/memory.py): freeze_heap, which the CLI, `superslm serve` and `superslm bench` call
once their model is loaded."""

from __future__ import annotations

import gc
import weakref

from superslm.memory import freeze_heap


class _Node:
    pass


def test_freeze_heap_collects_then_freezes_the_live_objects() -> None:
    garbage = _Node()
    garbage.self = garbage  # type: ignore[attr-defined]
    gone = weakref.ref(garbage)
    del garbage
    live = _Node()
    live.self = live  # type: ignore[attr-defined]
    kept = weakref.ref(live)
    try:
        freeze_heap()
        assert gone() is None  # unreachable cycles are collected first, not frozen with the rest
        del live
        gc.collect()
        assert kept() is not None  # a frozen cycle is out of the collections' reach
    finally:
        gc.unfreeze()  # the test worker's heap as it was
    gc.collect()
    assert kept() is None
