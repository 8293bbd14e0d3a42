"""The engine on tiny random-weight models: batching, chunking, prefix cache, preemption, sampling."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.errors import ContextLengthExceeded, InvalidArgument, TokenOutOfRange, UnknownRequest
from tests.tiny_models import build_hf_model, hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[superslm.Model, object]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    hf = build_hf_model("qwen3", folder)
    return superslm.load(folder), hf


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> superslm.Model:
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    build_hf_model("gemma3", folder)
    return superslm.load(folder)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(model: superslm.Model, ps: list[list[int]], n: int = 12, **engine_kwargs) -> list[list[int]]:
    engine = model.engine(**{"slots": 8, "context": 128, **engine_kwargs})
    reqs = [Request(p, n, Sampling(ignore_eos=True)) for p in ps]
    return [c.tokens for c in engine.generate(reqs)]


def test_greedy_equals_transformers(tiny) -> None:
    model, hf = tiny
    for p in prompts(3, seed=1):
        assert greedy(model, [p], 10)[0] == hf_greedy(hf, p, 10)


@pytest.mark.parametrize("family", ["tiny", "gemma"])
def test_same_tokens_alone_batched_chunked(family, tiny, gemma) -> None:
    model = tiny[0] if family == "tiny" else gemma
    ps = prompts(8, seed=2)
    alone = [greedy(model, [p], slots=1)[0] for p in ps]
    assert greedy(model, ps) == alone
    for chunk in (1, 7, 64):
        assert greedy(model, ps, chunk=chunk, rows=64) == alone, f"chunk {chunk}"


def test_prefix_cache_cold_and_warm(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=4, context=128, page_size=4)
    shared = prompts(1, seed=3, lo=30, hi=30)[0]
    req = [Request(shared + [5, 6], 8, Sampling(ignore_eos=True))]
    cold = engine.generate(req)[0]
    warm = engine.generate(req)[0]
    assert cold.cached == 0 and warm.cached == 28  # 7 full pages of 4; the last token is always computed
    assert warm.tokens == cold.tokens
    other = engine.generate([Request(shared + [9], 8, Sampling(ignore_eos=True))])[0]
    assert other.cached == 28
    assert other.tokens == greedy(model, [shared + [9]], 8, prefix_caching=False)[0]
    # a different salt never shares pages
    salted = engine.generate([Request(shared + [5, 6], 8, Sampling(ignore_eos=True), salt="x")])[0]
    assert salted.cached == 0 and salted.tokens == cold.tokens


def test_preemption_resumes_identically(tiny) -> None:
    model, _ = tiny
    ps = prompts(8, seed=4, lo=20, hi=30)
    alone = [greedy(model, [p], 24, slots=1)[0] for p in ps]
    # 4 tokens a page: 8 sequences of ~50 tokens need ~100 pages; give them 40
    engine = model.engine(slots=8, context=128, page_size=4, kv_budget=40 * engine_page_bytes(model, 4))
    got = engine.generate([Request(p, 24, Sampling(ignore_eos=True)) for p in ps])
    assert engine.scheduler.num_preemptions > 0
    assert [c.tokens for c in got] == alone
    engine.pool.check()
    assert engine.pool.num_used == 0


def engine_page_bytes(model: superslm.Model, page_size: int, kv: str | None = None) -> int:
    """Bytes of one KV page of an engine the tests build for `model` in format `kv` (None: SUPERSLM_TEST_KV's
    format where set, else the model's dtype)."""
    from superslm.cache.kv import KVCache

    a = model.arch
    kv = kv or os.environ.get("SUPERSLM_TEST_KV") or "auto"
    return KVCache.page_bytes(model.net.kv_layers, page_size, a.kv_heads, a.head_dim, model.dtype, kv)


def test_request_that_can_never_fit_ends_with_length(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=2, context=128, page_size=4, kv_budget=3 * engine_page_bytes(model, 4))
    long, short = prompts(1, lo=30, hi=30)[0], [3, 4, 5]
    out = engine.generate([Request(long, 4), Request(short, 20, Sampling(ignore_eos=True))])
    assert out[0].end == "length" and out[0].tokens == []
    assert out[1].end == "length" and 0 < len(out[1].tokens) < 20  # grew out of the pool alone
    assert engine.pool.num_used == 0


def test_seeded_sampling_is_batch_invariant(tiny) -> None:
    model, _ = tiny
    s = Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    p = prompts(1, seed=5)[0]
    alone = model.engine(slots=1, context=128).generate([Request(p, 16, s)])[0].tokens
    others = [Request(q, 16, Sampling(temperature=0.8, seed=i)) for i, q in enumerate(prompts(6, seed=6))]
    batch = model.engine(slots=8, context=128).generate(others[:3] + [Request(p, 16, s)] + others[3:])
    assert batch[3].tokens == alone
    unseeded = model.engine(slots=1, context=128).generate(
        [Request(p, 16, Sampling(temperature=1.0, ignore_eos=True))]
    )
    assert len(unseeded[0].tokens) == 16


@pytest.mark.float_kv
def test_sampled_frequencies_match_shaped_distribution(tiny) -> None:
    """Chi-square of 2,000 first tokens (distinct seeds) against softmax(top-k(logits / T))."""
    model, hf = tiny
    p = prompts(1, seed=7)[0]
    s = dict(temperature=0.7, top_k=8, ignore_eos=True)
    with torch.no_grad():
        logits = hf(torch.tensor([p])).logits[0, -1].double() / 0.7
    top = torch.topk(logits, 8)
    probs = torch.softmax(top.values, -1)
    engine = model.engine(slots=64, context=64)
    n = 2000
    out = engine.generate([Request(p, 1, Sampling(seed=i, **s)) for i in range(n)])
    counts = torch.zeros(8, dtype=torch.float64)
    index = {t: i for i, t in enumerate(top.indices.tolist())}
    for c in out:
        assert c.tokens[0] in index, "sampled a token outside the top k"
        counts[index[c.tokens[0]]] += 1
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 24.32) = 0.001
    assert chi2 < 24.32, (chi2, counts.tolist(), expected.tolist())


@pytest.mark.float_kv
def test_logprobs_equal_transformers(tiny) -> None:
    model, hf = tiny
    p = prompts(1, seed=8)[0]
    c = model.engine(slots=1, context=128).generate([Request(p, 6, Sampling(logprobs=5, ignore_eos=True))])[0]
    with torch.no_grad():
        full = hf(torch.tensor([p + c.tokens])).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(c.logprobs):
        row = full[len(p) - 1 + i]
        assert lp.token == c.tokens[i]
        assert abs(lp.logprob - row[lp.token].item()) <= 1e-4
        want = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, want.values.tolist())) <= 1e-4


def test_logit_bias_and_penalties(tiny) -> None:
    model, hf = tiny
    p = prompts(1, seed=9)[0]
    forced = model.engine(slots=1, context=128).generate(
        [Request(p, 5, Sampling(logit_bias={77: 100.0}, ignore_eos=True))]
    )[0]
    assert forced.tokens == [77] * 5
    # repetition + frequency penalties, greedy: check each step against a direct computation
    s = Sampling(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, ignore_eos=True)
    c = model.engine(slots=1, context=128).generate([Request(p, 8, s)])[0]
    seen = list(p)
    with torch.no_grad():
        for i, tok in enumerate(c.tokens):
            logits = hf(torch.tensor([seen])).logits[0, -1].double()
            out = c.tokens[:i]
            for t in set(seen):
                logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
            for t in set(out):
                logits[t] -= 0.5 * out.count(t) + 0.25
            assert tok == int(logits.argmax())
            seen.append(tok)


def test_stop_strings_and_stop_ids(tiny) -> None:
    model, _ = tiny
    p = prompts(1, seed=10)[0]
    free = model.engine(slots=1, context=128).generate([Request(p, 12, Sampling(ignore_eos=True))])[0]
    text = free.text
    assert len(text) > 4
    stop = text[2:4]
    c = model.engine(slots=1, context=128).generate(
        [Request(p, 12, Sampling(stop=(stop,), ignore_eos=True))]
    )[0]
    assert c.end == "stop" and c.text == text[: text.index(stop)]
    tid = free.tokens[3]
    c = model.engine(slots=1, context=128).generate(
        [Request(p, 12, Sampling(stop_token_ids=(tid,), ignore_eos=True))]
    )[0]
    assert c.end == "stop" and c.tokens == free.tokens[: free.tokens.index(tid)]


def test_random_cancels_leave_the_pool_clean(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=8, context=96, page_size=4, kv_budget=60 * engine_page_bytes(model, 4))
    rng = random.Random(11)
    ids = [
        engine.add(Request(p, rng.randint(1, 20), Sampling(temperature=1.0, seed=i)))
        for i, p in enumerate(prompts(200, seed=11, hi=30))
    ]
    ends: dict[int, str] = {}
    live = set(ids)
    while engine.busy():
        for p in engine.advance():
            assert p.id not in ends, "a request reported after its end"
            if p.end:
                ends[p.id] = p.end
                live.discard(p.id)
        for rid in list(live):
            if rng.random() < 0.03:
                engine.cancel(rid)
                live.discard(rid)
        engine.pool.check()
    assert set(ends) == set(ids)
    assert "cancelled" in ends.values() and "length" in ends.values()
    assert engine.pool.num_used == 0
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages
    with pytest.raises(UnknownRequest):
        engine.cancel(ids[0])


def test_bad_requests_are_refused(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=1, context=32)
    with pytest.raises(ContextLengthExceeded):
        engine.add(Request(list(range(2, 40)), 4))
    with pytest.raises(TokenOutOfRange):
        engine.add(Request([1, 2, 100000], 4))
    with pytest.raises(InvalidArgument):
        engine.add(Request([], 4))
    with pytest.raises(InvalidArgument):
        engine.add(Request([3], 0))
    with pytest.raises(InvalidArgument):
        engine.add(Request([3], 4, Sampling(temperature=-1.0)))
    with pytest.raises(InvalidArgument):
        model.engine(slots=0)
    assert not engine.busy()


def test_layer_budget_gives_identical_tokens(tiny) -> None:
    model, _ = tiny
    ps = prompts(3, seed=12)
    want = greedy(model, ps, 6)
    engine = model.engine(slots=8, context=128)
    ids = [engine.add(Request(p, 6, Sampling(ignore_eos=True))) for p in ps]
    got: dict[int, list[int]] = {i: [] for i in ids}
    calls = 0
    while engine.busy():
        for p in engine.advance(layer_budget=1):
            got[p.id] += p.tokens
        calls += 1
    assert [got[i] for i in ids] == want
    assert calls >= 6 * model.arch.layers


def test_complete_from_text(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    text = model.engine(slots=1, context=64).complete("The quick", 5, Sampling(ignore_eos=True))
    ids = model.tokenizer.encode("The quick")
    assert text == model.tokenizer.decode(greedy(model, [ids], 5)[0])


@pytest.mark.float_kv
def test_low_level_step_equals_requests(tiny) -> None:
    model, hf = tiny
    a, b = prompts(2, seed=13)
    engine = model.engine(slots=2, context=128)
    # both prompts in one step, rows interleaved by slot; logits of each prompt's last row
    rows = [(t, 0) for t in a] + [(t, 1) for t in b]
    wanted = [False] * len(rows)
    wanted[len(a) - 1] = wanted[-1] = True
    logits = engine.step([t for t, _ in rows], [s for _, s in rows], wanted)
    with torch.no_grad():
        want_a = hf(torch.tensor([a])).logits[0, -1]
        want_b = hf(torch.tensor([b])).logits[0, -1]
    assert (logits[0] - want_a).abs().max() <= 1e-4 and (logits[1] - want_b).abs().max() <= 1e-4
    nxt = engine.step([int(want_a.argmax())], [0], [True])
    with torch.no_grad():
        want = hf(torch.tensor([a + [int(want_a.argmax())]])).logits[0, -1]
    assert (nxt[0] - want).abs().max() <= 1e-4
    used = engine.pool.num_used
    engine.reset(0)
    engine.reset(1)
    assert used > 0 and engine.pool.num_used == 0


def test_pinned_pages_never_hang_the_queue(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=2, context=64, page_size=4, kv_budget=8 * engine_page_bytes(model, 4))
    engine.step(list(range(3, 23)), [0] * 20, [False] * 20)  # a low-level slot pins 5 of 8 pages
    out = engine.generate([Request(list(range(3, 20)), 4, Sampling(ignore_eos=True))])[0]
    assert out.end == "length" and out.tokens == []
    engine.reset(0)
    assert engine.generate([Request(list(range(3, 20)), 4, Sampling(ignore_eos=True))])[0].tokens
