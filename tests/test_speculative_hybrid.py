"""Speculative decoding on models with gated delta-rule layers (tiny random Qwen3.5 and Qwen3-Next): a drafting
sequence's rows step one at a time, the recurrent state after each kept in scratch rows and the kept one restored;
with the prefix cache, save/restore, and fewer scratch rows than drafts."""

from __future__ import annotations

import pytest
import torch

from superslm import Request, Sampling
from superslm.engine.speculative import Speculative
from tests.test_speculative import HYBRIDS, copy_prompts, generate, model_zoo, same_ends


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return model_zoo(tmp_path_factory)


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_drafts_with_the_prefix_cache_and_save_restore(zoo, family) -> None:
    """A delta-rule model drafting with a prefix cache: checkpoints are taken after verification only, some from
    the scratch row of a kept draft row that ends a page (a boundary inside a step); a repeated prompt and a next
    turn resume from them and answer as an engine without drafts or cache (bit-identically in deterministic mode).
    A request saved mid-answer and restored into another drafting engine goes on with the same tokens."""
    model = zoo(family)
    p = copy_prompts(1, seed=12)[0]
    s = Sampling(logprobs=1, ignore_eos=True)
    spec = Speculative(k=6, min_n=1)
    for deterministic in (False, True):
        kw = dict(slots=2, context=160, page_size=4, deterministic=deterministic)
        plain = model.engine(**kw, prefix_caching=False)
        engine = model.engine(**kw, speculative=spec)
        scratch, copy_row, sources = engine.states.scratch_rows, engine.saved_states.copy_row, []

        def spy(src, src_row, row, copy_row=copy_row, sources=sources, scratch=scratch):  # type: ignore[no-untyped-def]
            sources.append(src_row in scratch)
            copy_row(src, src_row, row)

        engine.saved_states.copy_row = spy
        want = plain.generate([Request(p, 24, s)])[0]
        cold = engine.generate([Request(p, 24, s)])[0]
        warm = engine.generate([Request(p, 24, s)])[0]
        assert cold.tokens == warm.tokens == want.tokens and warm.cached > 0
        turn = p + cold.tokens + [5, 6, 7]
        nxt = engine.generate([Request(turn, 16, s)])[0]
        assert nxt.cached > len(p)  # resumed inside the answer, from states checkpointed in drafting steps
        again = plain.generate([Request(turn, 16, s)])[0]
        assert nxt.tokens == again.tokens
        if deterministic:
            for a, b in ((cold, want), (warm, want), (nxt, again)):
                assert a.logprobs == b.logprobs
        assert any(sources) and not all(sources)
        # each page boundary inside the answer (but the last step's: the sequence ended there) was checkpointed,
        # from a scratch row or the sequence's own: a prompt that stops one token past it resumes exactly there
        # (8 slots: room for 32 checkpoints, none evicted)
        engine = model.engine(**{**kw, "slots": 8}, speculative=spec)
        assert engine.generate([Request(p, 24, s)])[0].tokens == want.tokens
        full = p + want.tokens
        for b in range((len(full) - 1) // 4 * 4, len(p), -4):
            turn = full[:b] + [5]
            got, ref = engine.generate([Request(turn, 4, s)])[0], plain.generate([Request(turn, 4, s)])[0]
            # the last step (at most k + 1 rows) may have passed b: no checkpoint there
            assert got.tokens == ref.tokens and (got.cached == b or b > len(full) - 2 - spec.k), b
            if deterministic:
                assert got.logprobs == ref.logprobs, b
        assert engine.stats()["drafts_accepted"] > 0 and engine.pool.num_used == 0
        assert sorted(engine.scheduler.free_states) == list(range(8))

    engine = model.engine(slots=2, context=160, page_size=4, speculative=spec)
    rid = engine.add(Request(p, 30, Sampling(ignore_eos=True)))
    first: list[int] = []
    while len(first) < 8:
        for pr in engine.advance():
            first += pr.tokens
    assert engine.stats()["drafts_accepted"] > 0
    other = model.engine(slots=2, context=160, page_size=4, speculative=spec)
    other.restore(engine.save(rid))
    rest: list[int] = []
    while other.busy():
        for pr in other.advance():
            rest += pr.tokens
    assert first + rest == generate(model, [Request(p, 30, Sampling(ignore_eos=True))])[0][0].tokens


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_draft_rows_see_plain_decodings_states(zoo, family) -> None:
    """The layers themselves, in deterministic mode: a decode row and 3 drafts in one step give each row the bits
    of plain decoding's one-row steps, leave in the scratch rows the states plain decoding has after each row but
    the last, and in the sequence's own row the state after the last."""
    from superslm.cache.kv import KVCache
    from superslm.cache.state import RecurrentStates
    from superslm.kernels.attention import AttnMetadata

    net = zoo(family).net
    a, d = net.arch, net.arch.delta
    prompt, rows = copy_prompts(1, seed=14)[0], [5, 9, 11, 7]

    def runner(scratch: int):  # type: ignore[no-untyped-def]
        kv = KVCache(net.kv_layers, 32, 4, a.kv_heads, a.head_dim, net.dtype)
        st = RecurrentStates(net.state_layers, 1, d.conv_width, d.conv, d.v_heads, d.k_dim, d.v_dim, net.dtype,
                             scratch=scratch)
        done = [0]

        def run(tokens: list[int], drafts: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
            n, start = len(tokens), done[0]
            meta = AttnMetadata(torch.arange(start, start + n), torch.arange(start, start + n), (0, n), (start + n,),
                                (tuple(range(32)),), 4, deterministic=True, state_slots=(0,), state_drafts=drafts)
            with torch.inference_mode():
                h = net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v, states=st)
                done[0] += n
                return net.logits(h[:n], True)  # deterministic mode pads the rows to a multiple of 16

        return run, st

    run, st = runner(0)
    run(prompt)
    plain, after = [], []
    for t in rows:
        plain.append(run([t]))
        after.append((st.conv[:, 0].clone(), st.ssm[:, 0].clone()))
    run, st = runner(3)
    run(prompt)
    got = run(rows, drafts=((1, 2, 3),))
    assert torch.equal(got, torch.cat(plain))
    for j, (conv, ssm) in enumerate(after):
        row = j + 1 if j < 3 else 0  # scratch rows 1..3 after rows 0..2; the sequence's own row after row 3
        assert torch.equal(st.conv[:, row], conv) and torch.equal(st.ssm[:, row], ssm), j


def test_hybrid_drafts_fit_the_scratch_rows(zoo, monkeypatch) -> None:
    """Scratch rows for k drafts only (a budget that holds no more): the scheduler cuts the step's drafts to them,
    and the tokens stay plain decoding's."""
    from superslm.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_CHECKPOINT_BYTES", 1)
    model = zoo("qwen3_5")
    ps = copy_prompts(8, seed=13)

    def reqs():
        return [Request(p, 30, Sampling(ignore_eos=True)) for p in ps]

    plain, _ = generate(model, reqs())
    cut, e = generate(model, reqs(), speculative=Speculative(k=3, min_n=1, row_cost=0.0))
    assert e.states.scratch == 3
    same_ends(cut, plain)
    assert e.stats()["drafts_accepted"] > 0
