"""Handles and blobs across engines: prefix handles belong to their engine, a restored sequence fits the
context it lands in, generate() leaves other requests' reports to advance(), and bad ones are refused
without a hang or a leaked page."""

from __future__ import annotations

import sys

import pytest

from superslm import Request, Sampling
from superslm.errors import ContextLengthExceeded, InvalidArgument
from tests.test_engine import engine_page_bytes, prompts, tiny  # noqa: F401  (the module's fixture)

S = Sampling(ignore_eos=True)


def _clean(engine) -> None:
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_prefix_needs_a_prompt_of_its_own_and_its_engine(tiny) -> None:  # noqa: F811
    """An empty prompt after a prefix never produced logits (the engine stepped forever); a handle from another
    engine named page ids of that engine's pool (an AssertionError that wedged this engine, or another request's
    KV read silently)."""
    model, _ = tiny
    a, b = model.engine(slots=2, context=64, page_size=4), model.engine(slots=2, context=64, page_size=4)
    p = prompts(1, seed=5, lo=12, hi=12)[0]
    pre = a.prefix(p[:9])
    with pytest.raises(InvalidArgument, match="empty"):
        a.add(Request([], 4, S, prefix=pre))
    with pytest.raises(InvalidArgument, match="this engine"):
        b.add(Request(p[9:], 4, S, prefix=pre))
    want = b.generate([Request(p, 4, S)])[0].tokens
    assert a.generate([Request(p[9:], 4, S, prefix=pre)])[0].tokens == want  # both engines still work
    with pytest.raises(InvalidArgument, match="this engine"):
        b.release(pre)  # it freed b's pages of the same ids (b's own prefix's among them)
    a.release(pre)
    for engine in (a, b):
        assert not engine.busy()
        _clean(engine)


def test_restore_into_a_smaller_context_stops_where_it_ends(tiny) -> None:  # noqa: F811
    model, _ = tiny
    big, small = model.engine(slots=1, context=128), model.engine(slots=1, context=36)
    p = prompts(1, seed=6, lo=30, hi=30)[0]
    rid = big.add(Request(p, 40, S))
    big.advance()
    big.advance()
    blob = big.save(rid)
    i = small.restore(blob)
    tokens: list[int] = []
    ends = []
    while small.busy():
        for pr in small.advance():
            tokens += pr.tokens
            ends.append(pr.end)
    assert len(p) + 1 + len(tokens) <= 36 and ends[-1] == "length", (len(tokens), ends)
    _clean(small)
    # a sequence that already fills the smaller context has nothing left to run there
    for _ in range(6):
        big.advance()
    with pytest.raises(ContextLengthExceeded):
        small.restore(big.save(rid))
    assert not small.busy() and i not in small.output.seqs
    _clean(small)


def test_generate_leaves_other_requests_reports_to_advance(tiny) -> None:  # noqa: F811
    model, _ = tiny
    e = model.engine(slots=4, context=64)
    p, q = prompts(2, seed=7)
    x = e.add(Request(p, 3, S))
    e.generate([Request(q, 6, S)])
    seen = [pr for _ in range(3) for pr in e.advance() if pr.id == x]
    assert sum(len(pr.tokens) for pr in seen) == 3 and seen[-1].end == "length"
    assert not e.busy()
    _clean(e)


def test_the_scheduler_alone_grants_and_frees_pages(tiny, monkeypatch) -> None:  # noqa: F811
    """Every page a sequence, a restored one, a prefix handle (its own and an adopter's copy) or a low-level
    slot holds is taken and given back by engine/scheduler.py: a page granted elsewhere is one the scheduler's
    preemption and admission rules cannot see."""
    from superslm.cache import PagePool

    callers: set[str] = set()
    for name in ("allocate", "retain", "release"):
        real = getattr(PagePool, name)

        def spy(self, *args, _real=real, **kwargs):
            callers.add(sys._getframe(1).f_globals["__name__"])
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(PagePool, name, spy)
    model, _ = tiny
    # 8 pages of 4 tokens; the prefix holds 3 (9 tokens: two full pages shared, the third copied for each
    # adopter). The adopter (14 + 8 tokens: 4 pages of its own) and q (8 + 8: 4) cannot both grow: a preemption
    engine = model.engine(slots=2, context=64, page_size=4, kv_budget=8 * engine_page_bytes(model, 4))
    p, q = prompts(2, seed=7, lo=14, hi=14)
    q = q[:8]
    pre = engine.prefix(p[:9])
    done = engine.generate([Request(p[9:], 8, S, prefix=pre), Request(q, 8, S)])
    assert all(c.end == "length" for c in done)
    engine.release(pre)
    rid = engine.add(Request(q, 8, S))
    engine.advance()
    blob = engine.save(rid)
    engine.cancel(rid)
    engine.generate([])  # the restored sequence runs at once (a free slot and pages)
    i = engine.restore(blob)
    while engine.busy():
        engine.advance()
    engine.step(q[:5], [0] * 5, [False] * 4 + [True])
    engine.reset(0)
    assert i >= 0 and engine.scheduler.num_preemptions >= 1
    assert callers == {"superslm.engine.scheduler"}, callers
    _clean(engine)


def test_jump_forward_is_the_output_processors(tiny) -> None:  # noqa: F811
    """Engine.jump_forward stays a setting callers flip (benchmarks/structured.py does): it is the output
    processor's, not a copy of it."""
    model, _ = tiny
    engine = model.engine(slots=1, context=64, jump_forward=False)
    assert engine.jump_forward is False and engine.output.jump_forward is False
    engine.jump_forward = True
    assert engine.output.jump_forward is True
