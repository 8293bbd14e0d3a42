"""Speculative decoding with n-gram drafts: the same tokens, logprobs and ends as plain decoding, the drafts' pages
rolled back, the sampled law unchanged; on tiny random models (which fall into loops the n-grams guess), and one
slow test on SmolLM2."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.engine import Engine
from superslm.engine.speculative import NgramDrafter, Speculative, Speculator
from superslm.errors import InvalidArgument
from tests.test_engine import engine_page_bytes
from tests.tiny_models import CONFIGS, SingleSequence, build_hf_model

FAMILIES = ("llama", "qwen3", "gemma3", "phi3")
#: families with gated delta-rule layers: a recurrent state per sequence that every row advances
HYBRIDS = ("qwen3_5", "qwen3_next")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return model_zoo(tmp_path_factory)


def model_zoo(tmp_path_factory):
    """family -> a tiny random model of it, built on first use."""
    built: dict[str, superslm.Model] = {}

    def get(family: str) -> superslm.Model:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"spec-{family}")
            if family not in HYBRIDS:
                build_hf_model(family, folder)
                built[family] = superslm.load(folder)
                return built[family]
            # random hybrids hardly loop (the delta rule's state keeps moving the answer): with the head tied to the
            # embeddings and each delta-rule layer's output halved they fall into loops the n-grams guess (about
            # 70% of drafts kept) and leave some, as the attention families do
            cls, kwargs = CONFIGS[family]
            build_hf_model(family, folder, spec=(cls, {**kwargs, "tie_word_embeddings": True}))
            model = built[family] = superslm.load(folder)
            with torch.no_grad():
                for layer in model.net.layers:
                    if layer.kind == "delta":
                        layer.mixer.out.weight.mul_(0.5)
        return built[family]

    return get


def copy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (a random run, then its first part again), and plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        run = [rng.randrange(2, 300) for _ in range(rng.randint(6, 20))]
        out.append(run + run[: len(run) // 2] if i % 2 == 0 else run)
    return out


def generate(model: superslm.Model, reqs: list[Request], **kwargs):
    """The completions of `reqs` on a fresh engine, and the engine (its pool checked clean after)."""
    engine = model.engine(**{"slots": 4, "context": 160, "page_size": 4, **kwargs})
    out = engine.generate(reqs)
    engine.pool.check()
    assert engine.pool.num_used == 0
    return out, engine


def same_ends(a, b) -> None:
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    assert [c.end for c in a] == [c.end for c in b]


# --- the drafter ----------------------------------------------------------------------------------


def reference_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching suffix, by brute force (past
    the end the copy repeats its own start)."""
    last = len(tokens) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        for end in range(last - 1, n - 2, -1):
            if tokens[end + 1 - n : end + 1] == tokens[last + 1 - n :]:
                out = tokens[end + 1 : end + 1 + k]
                while len(out) < k:
                    out.append(out[len(out) - (last - end)])
                return out
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (2, 4), (1, 5)])
def test_ngram_lookup_equals_a_brute_force_search(min_n, max_n) -> None:
    rng = random.Random(min_n * 10 + max_n)
    proposed = 0
    for _ in range(30):
        alphabet = rng.randint(2, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))]
        drafter = NgramDrafter(min_n, max_n)
        for _ in range(60):
            k = rng.randint(1, 6)
            got = drafter.propose(tokens, k)
            assert got == reference_lookup(tokens, k, min_n, max_n), (tokens, k)
            proposed += bool(got)
            tokens = tokens + [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]  # tokens only grow
    assert proposed > 100
    # the most recent occurrence wins, and a loop goes on past the end
    assert NgramDrafter(2, 2).propose([5, 6, 1, 9, 5, 6, 2, 9, 5, 6], 2) == [2, 9]
    assert NgramDrafter(1, 3).propose([3, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert NgramDrafter(2, 3).propose([1, 2, 3, 4], 3) == []


def test_adaptive_draft_length_and_free_checks() -> None:
    """The draft length follows the acceptance estimate (none where a plain step gives more for its cost), guesses
    not drafted are checked against the plain step's token and bring drafting back; no drafts for rows that may not
    draft or at the last token."""
    c = Speculative(k=6)
    assert c.best_k(1.0, 6) == 6 and c.best_k(1.0, 2) == 2 and c.best_k(0.1, 6) == 0
    assert [c.best_k(p, 6) for p in (0.3, 0.6, 0.9)] == sorted(c.best_k(p, 6) for p in (0.3, 0.6, 0.9))
    assert Speculative(row_cost=0.0).best_k(0.05, 8) == 8  # free rows: always worth drafting
    spec = Speculator(c)
    seq = SimpleNamespace(request=SimpleNamespace(speculative=True), grammar=None, spec=None, max_tokens=100,
                          sampler=SimpleNamespace(params=Sampling()), output=[], tokens=[1, 2, 3, 1, 2, 3, 1, 2])
    assert spec.propose(seq) == [3, 1, 2, 3, 1, 2]  # optimistic at first
    for _ in range(10):
        spec.record(seq, 6, 0)
    assert seq.spec.rate < 0.2
    assert spec.propose(seq) == []  # not worth a row; its guess (3) waits for the plain step's token
    seq.tokens.append(3)
    seq.output.append(3)
    rate = seq.spec.rate
    drafts = spec.propose(seq)
    assert seq.spec.rate > rate  # the free check: the guess was right
    plain = 0
    while not drafts:  # the copy goes on, each plain step's token the guess: the estimate climbs back
        seq.tokens.append(seq.spec.guess)
        seq.output.append(seq.spec.guess)
        drafts, plain = spec.propose(seq), plain + 1
    assert 1 <= plain <= 4
    verified = [len(drafts)]
    while len(drafts) < 6 and len(verified) < 10:  # the copy goes on: longer drafts, full within a few steps
        spec.record(seq, len(drafts), len(drafts))
        drafts = spec.propose(seq)
        verified.append(len(drafts))
    assert verified == sorted(verified) and verified[-1] == 6
    for _ in range(10):
        spec.record(seq, 6, 0)
    assert spec.propose(seq) == []
    seq.tokens.append(9)  # a wrong guess lowers the estimate
    rate = seq.spec.rate
    assert spec.propose(seq) == [] and seq.spec.rate < rate
    kept = sum(verified[:-1])
    assert spec.stats() == {"drafts_proposed": 120 + kept, "drafts_accepted": kept,
                            "acceptance_rate": kept / (120 + kept), "draft_steps": 20 + len(verified) - 1}
    seq.max_tokens = len(seq.output) + 1  # the next token is its last: nothing to verify after it
    assert spec.propose(seq) == []
    seq.max_tokens, seq.request.speculative = 100, False
    assert spec.propose(seq) == []


def test_draft_counts_maximize_the_steps_tokens_per_cost() -> None:
    """The joint draft counts of a step's sequences are the best of all combinations (brute force: expected tokens
    over the step's cost); a draft that pays beside one sequence does not beside seven others."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(400):
        c = Speculative(k=rng.randint(1, 4), row_cost=rng.choice([0.0, 0.1, 0.25, 0.5]),
                        fixed_cost=rng.choice([0.0, 0.5, 0.85, 2.0]), row_tile=rng.choice([1, 2, 4]),
                        draft_cost=rng.choice([None, 0.0, 0.1, 0.45]))  # fmt: skip
        rates = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(rng.randint(1, 3))]
        rooms = [rng.randint(0, 4) for _ in rates]

        def value(ks, c=c, rates=rates):  # type: ignore[no-untyped-def]
            tokens = sum(sum(p**j for j in range(k + 1)) for p, k in zip(rates, ks, strict=True))
            return tokens / (c.step_cost(len(rates) + sum(ks)) + (c.draft_cost or 0.0) * sum(ks))

        best = max(value(ks) for ks in itertools.product(*(range(min(c.k, r) + 1) for r in rooms)))
        got = c.draft_counts(rates, rooms)
        assert all(0 <= k <= min(c.k, r) for k, r in zip(got, rooms, strict=True))
        assert value(got) >= best * (1 - 1e-9)
    c = Speculative()
    assert c.step_cost(1) == 1 and c.step_cost(2) == c.step_cost(4) < c.step_cost(5)  # rows in tiles of 4
    assert c.draft_counts([0.7], [8]) == [3] and c.draft_counts([0.7] * 8, [8] * 8) == [0] * 8
    assert c.draft_counts([0.95] * 8, [8] * 8) == [3] * 8  # copying pays at batch 8 too, in shorter drafts
    assert c.draft_counts([0.95, 0.2], [8, 8]) == [6, 0]  # each sequence by its own estimate


def test_step_cost_curves_and_the_machines_prices() -> None:
    """A (rows, cost) curve prices steps straight between its points and past the last along its last segment;
    the draft counts stay the best of all combinations under it; an unpriced engine on a CPU with the AVX2 row
    kernels and no VNNI takes AVX2_COSTS, a priced one or another machine keeps its prices."""
    import itertools

    from superslm import cext
    from superslm.engine.speculative import AVX2_COSTS, AVX2_PRIOR, VNNI_PRICES

    c = Speculative(costs=((1, 1.0), (2, 1.5), (4, 2.0), (8, 5.0)))
    assert [c.step_cost(r) for r in (1, 2, 3, 4, 6, 8, 10)] == [1.0, 1.5, 1.75, 2.0, 3.5, 5.0, 6.5]
    rng = random.Random(1)
    for _ in range(100):
        rates = [rng.random() for _ in range(rng.randint(1, 3))]
        got = c.draft_counts(rates, [3] * len(rates))

        def value(ks, rates=rates):  # type: ignore[no-untyped-def]
            tokens = sum(sum(p**j for j in range(k + 1)) for p, k in zip(rates, ks, strict=True))
            return tokens / c.step_cost(len(rates) + sum(ks))

        assert value(got) >= max(value(ks) for ks in itertools.product(range(4), repeat=len(rates))) * (1 - 1e-9)
    # unpriced: VNNI's prices, rows in tiles of 4; a field given keeps the others at theirs
    assert Speculative().step_cost(5) == VNNI_PRICES[0] + VNNI_PRICES[1] * 8
    assert Speculative(row_tile=1).step_cost(5) == VNNI_PRICES[0] + VNNI_PRICES[1] * 5
    for bad in (((1, 1.0),), ((2, 1.0), (1, 2.0)), ((1, 1.0), (2, -1.0)), ((0, 1.0), (2, 2.0)), [(1, 1.0), (2, 2.0)]):
        with pytest.raises(InvalidArgument, match="costs"):
            Speculative(costs=bad).validate()  # type: ignore[arg-type]
    for bad_prior in (1.5, -0.1, True):
        with pytest.raises(InvalidArgument, match="prior"):
            Speculative(prior=bad_prior).validate()
    with pytest.raises(InvalidArgument, match="one or the other"):
        Speculative(costs=AVX2_COSTS, row_cost=0.1).validate()
    assert Speculative.of({"costs": [[1, 1.0], [4, 2.0]]}).costs == ((1, 1.0), (4, 2.0))  # JSON's lists
    ext = cext.extension()
    avx2_rows = (ext is not None and not cext.torch_kernels_forced() and ext.avx2_available()
                 and not ext.vnni_available())
    assert Speculative().for_device(torch.device("cpu")).costs == (AVX2_COSTS if avx2_rows else None)
    assert Speculative().for_device(torch.device("cpu")).prior == (AVX2_PRIOR if avx2_rows else None)
    assert Speculative(prior=0.5).for_device(torch.device("cpu")).prior == 0.5
    assert Speculative().for_device(torch.device("cpu"), deterministic=True).costs is None  # torch's kernel rows
    assert Speculative().for_device(torch.device("meta")).costs is None
    priced = Speculative(row_cost=0.0)
    assert priced.for_device(torch.device("cpu")) is priced
    assert Speculative(method="mtp", k=3).for_device(torch.device("cpu")).costs is None  # its draft_cost's prices
    # AVX2's curve: a step of 64 rows takes the prompt GEMMs, dearer than 63 rows' row kernels: sure drafts stop short
    c = Speculative(costs=AVX2_COSTS)
    assert c.step_cost(64) > c.step_cost(63) and sum(c.draft_counts([1.0] * 8, [8] * 8)) == 63 - 8
    assert c.draft_counts([1.0], [8]) == [8] and c.draft_counts([0.3] * 8, [8] * 8) == [0] * 8


# --- the engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES + HYBRIDS)
def test_greedy_tokens_equal_with_drafts(zoo, family) -> None:
    model = zoo(family)
    ps = copy_prompts(6, seed=1)

    def reqs():
        return [Request(p, 40, Sampling(ignore_eos=True)) for p in ps]

    plain, e0 = generate(model, reqs())
    spec, e1 = generate(model, reqs(), speculative="ngram")
    same_ends(spec, plain)
    st = e1.stats()
    assert st["drafts_accepted"] > 0 and st["drafts_proposed"] > st["drafts_accepted"]
    assert st["acceptance_rate"] == st["drafts_accepted"] / st["drafts_proposed"]
    assert e1.stats()["steps"] < e0.stats()["steps"]  # the accepted drafts saved steps
    assert e0.stats()["drafts_proposed"] == 0


@pytest.mark.parametrize("family", ["llama", "gemma3", *HYBRIDS])
def test_deterministic_mode_is_bit_identical(zoo, family) -> None:
    """Tokens and logprobs with == alone: greedy and seeded sampling, penalties, in batches."""
    model = zoo(family)
    ps = copy_prompts(6, seed=2)
    samplings = [Sampling(logprobs=3, ignore_eos=True), Sampling(temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
                 Sampling(repetition_penalty=1.2, presence_penalty=0.3, logprobs=1, ignore_eos=True)]

    def reqs():
        return [Request(p, 30, samplings[i % 3]) for i, p in enumerate(ps)]

    plain, _ = generate(model, reqs(), deterministic=True)
    spec, e = generate(model, reqs(), deterministic=True, speculative=Speculative(k=6, min_n=1))
    same_ends(spec, plain)
    assert [c.logprobs for c in spec] == [c.logprobs for c in plain]
    assert e.stats()["drafts_accepted"] > 0


def test_logprobs_equal_plain_decode(zoo) -> None:
    """Within float rounding on float pages. On quantized pages a draft's key rounded otherwise can land on the
    next code, and every later token reads that code: there a step of one code (~1e-4 here) is the bound."""
    tol = 1e-3 if os.environ.get("SUPERSLM_TEST_KV") else 1e-5
    model = zoo("qwen3")
    ps = copy_prompts(4, seed=3)

    def reqs():
        return [Request(p, 30, Sampling(logprobs=5, ignore_eos=True, temperature=0.0 if i % 2 else 0.7, seed=i))
                for i, p in enumerate(ps)]

    plain, _ = generate(model, reqs())
    spec, e = generate(model, reqs(), speculative="ngram")
    same_ends(spec, plain)
    assert e.stats()["drafts_accepted"] > 0
    for a, b in zip(spec, plain, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (x.token, x.rank, [t for t, _ in x.top]) == (y.token, y.rank, [t for t, _ in y.top])
            assert abs(x.logprob - y.logprob) <= tol
            assert max(abs(v - w) for (_, v), (_, w) in zip(x.top, y.top)) <= tol


def test_stops_lengths_min_tokens_and_penalties_equal(zoo) -> None:
    model = zoo("llama")
    p = copy_prompts(1, seed=4)[0]
    free = generate(model, [Request(p, 40, Sampling(ignore_eos=True))])[0][0]
    tid = free.tokens[-1]  # a token of the loop the answer ends in
    least = free.tokens.index(tid) + 2
    assert tid in free.tokens[least:], "the loop brings the stop token back after min_tokens"
    cases = [
        Sampling(stop=(free.text[12:15],), ignore_eos=True),
        Sampling(stop_token_ids=(tid,), ignore_eos=True),
        Sampling(stop_token_ids=(tid,), min_tokens=least, ignore_eos=True),
        Sampling(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1, ignore_eos=True),
        Sampling(logit_bias={free.tokens[5]: 2.0}, temperature=0.9, seed=3, ignore_eos=True),
        Sampling(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, seed=7, ignore_eos=True),
        Sampling(bad_words=(model.tokenizer.decode([free.tokens[6]]),), ignore_eos=True),
    ]

    def reqs():
        return [Request(p, m, s) for s in cases for m in (1, 2, 3, 7, 40) if m >= s.min_tokens]

    plain, _ = generate(model, reqs(), slots=8)
    spec, e = generate(model, reqs(), slots=8, speculative=Speculative(k=5, min_n=1))
    same_ends(spec, plain)
    assert {c.end for c in spec} == {"stop", "length"}
    assert e.stats()["drafts_accepted"] > 0


def test_penalties_count_the_drafts_before_each_row(zoo) -> None:
    """A loop under a small frequency penalty breaks where the counts pass its margin: a row after drafts must
    count them (without, 29 of these 32 answers differ)."""
    model = zoo("llama")

    def reqs():
        return [Request(p, 60, Sampling(frequency_penalty=f, ignore_eos=True))
                for p in copy_prompts(8, seed=4) for f in (0.05, 0.1, 0.2, 0.4)]

    plain, _ = generate(model, reqs(), slots=8)
    spec, e = generate(model, reqs(), slots=8, speculative=Speculative(k=6, min_n=1))
    same_ends(spec, plain)
    assert e.stats()["drafts_accepted"] > 100


def test_sampled_law_is_plain_sampling(zoo) -> None:
    """Chi-square of 3,000 seeded answers of 3 tokens from 4 allowed tokens, against the model's own
    probabilities of each triple; the same tokens as plain decoding seed by seed too."""
    model = zoo("llama")
    allowed = (11, 23, 57, 101)
    rng = random.Random(5)
    prompt = [rng.choice(allowed) for _ in range(40)]  # every 2-gram of the 4 occurs: every step drafts
    temp = 1.5

    def reqs():
        return [Request(prompt, 3, Sampling(temperature=temp, seed=i, allowed_token_ids=allowed, ignore_eos=True))
                for i in range(3000)]

    # prior 1: 3-token answers at batch 64 draft from their first step (a lower prior waits for a free check)
    spec, e = generate(model, reqs(), slots=64, context=64, speculative=Speculative(k=4, min_n=1, prior=1.0))
    st = e.stats()
    assert 0 < st["drafts_accepted"] < st["drafts_proposed"]  # both the kept and the rejected path are taken
    plain, _ = generate(model, reqs(), slots=64, context=64)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]

    index = {t: i for i, t in enumerate(allowed)}
    ids = torch.tensor(allowed)

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = SingleSequence(model.net).step(prompt + tokens)[-1].double()
        return torch.softmax(logits[ids] / temp, -1)

    expected = torch.zeros(4, 4, 4, dtype=torch.float64)
    p1 = probs([])
    for a in allowed:
        p2 = probs([a])
        for b in allowed:
            expected[index[a], index[b]] = p1[index[a]] * p2[index[b]] * probs([a, b])
    counts = torch.zeros(4, 4, 4, dtype=torch.float64)
    for c in spec:
        counts[tuple(index[t] for t in c.tokens)] += 1
    expected = expected.flatten() * len(spec)
    counts = counts.flatten()
    keep = expected >= 5  # the cells too rare for the test are pooled into one
    exp, got = expected[keep], counts[keep]
    if not keep.all():
        exp = torch.cat([exp, expected[~keep].sum().reshape(1)])
        got = torch.cat([got, counts[~keep].sum().reshape(1)])
    chi2 = float(((got - exp) ** 2 / exp).sum())
    dof = exp.shape[0] - 1
    # P(chi2 > critical) = 0.001 (Wilson-Hilferty, within 1% of the exact quantile for dof >= 10)
    critical = dof * (1 - 2 / (9 * dof) + 3.090 * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 20 and chi2 < critical, (chi2, critical, dof)


@pytest.mark.parametrize("family", ["qwen3", *HYBRIDS])
def test_rollback_leaves_no_page_behind(zoo, family) -> None:
    """Random requests (greedy, sampled, random lengths), cancels and a KV budget that preempts: after every step
    each running sequence holds exactly the pages of its computed tokens and the pool's references check out; a
    delta-rule model's state rows all come back."""
    model = zoo(family)
    engine = model.engine(slots=6, context=96, page_size=4, kv_budget=40 * engine_page_bytes(model, 4),
                          speculative=Speculative(k=6, min_n=1))
    run_checking_pages(engine, copy_prompts(60, seed=6))


def run_checking_pages(engine: Engine, prompts: list[list[int]],
                       check: Callable[[Any], None] | None = None) -> None:
    """Requests of `prompts` (random lengths, greedy or sampled), about 1% of the live ones cancelled each step, until
    all end: after every step each running sequence holds exactly the pages of its computed tokens (and passes
    `check`) and the pool's references check out; at the end the engine preempted, kept some drafts and rejected
    others, and every page and state row is back."""
    rng = random.Random(6)
    ids = [engine.add(Request(p, rng.randint(1, 40), Sampling(temperature=rng.choice([0.0, 0.0, 1.0]), seed=i)))
           for i, p in enumerate(prompts)]
    live, ended = set(ids), set()
    while engine.busy():
        for p in engine.advance():
            if p.end:
                live.discard(p.id)
                ended.add(p.id)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == engine.scheduler.pages_for(seq.num_computed_tokens)
            if check is not None:
                check(seq)
        for rid in list(live):
            if rng.random() < 0.01:
                engine.cancel(rid)
                live.discard(rid)
        engine.pool.check()
    st = engine.stats()
    assert ended == set(ids)
    assert st["preemptions"] > 0 and 0 < st["drafts_accepted"] < st["drafts_proposed"]
    assert engine.pool.num_used == 0 and engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages
    if engine.states is not None:
        assert sorted(engine.scheduler.free_states) == list(range(engine.slots))

@pytest.mark.parametrize("family", ["gemma3", *HYBRIDS])
def test_preemption_and_small_steps_give_the_same_tokens(zoo, family) -> None:
    """Drafts cut by a small row budget beside prompt chunks, a KV budget that preempts, a layer budget."""
    model = zoo(family)
    ps = copy_prompts(8, seed=7)

    def reqs():
        return [Request(p, 30, Sampling(ignore_eos=True)) for p in ps]

    plain, _ = generate(model, reqs(), slots=8)
    small_steps, e = generate(model, reqs(), slots=8, rows=10, chunk=5, speculative="ngram")
    same_ends(small_steps, plain)
    assert e.stats()["drafts_accepted"] > 0
    preempted, e = generate(model, reqs(), slots=8, kv_budget=40 * engine_page_bytes(model, 4), speculative="ngram")
    same_ends(preempted, plain)
    assert e.stats()["preemptions"] > 0 and e.stats()["drafts_accepted"] > 0
    # rows priced free: drafts at batch 4 whatever the acceptance estimates say
    engine = model.engine(slots=4, context=160, page_size=4, speculative=Speculative(row_cost=0.0))
    rids = [engine.add(r) for r in reqs()[:4]]
    got: dict[int, list[int]] = {r: [] for r in rids}
    while engine.busy():
        for p in engine.advance(layer_budget=1):
            got[p.id] += p.tokens
    assert [got[r] for r in rids] == [c.tokens for c in plain[:4]]
    assert engine.stats()["drafts_accepted"] > 0


def test_opt_out_and_per_request_stats(zoo) -> None:
    model = zoo("llama")
    p = copy_prompts(1, seed=1)[0]
    engine = model.engine(slots=2, context=160, page_size=4, speculative="ngram")
    on = engine.add(Request(p, 30, Sampling(ignore_eos=True)))
    off = engine.add(Request(p, 30, Sampling(ignore_eos=True), speculative=False))
    seen: dict[int, dict] = {}
    tokens: dict[int, list[int]] = {on: [], off: []}
    while engine.busy():
        for rid in (on, off):
            if rid in engine.output.seqs:
                seen[rid] = engine.stats(rid)
        for pr in engine.advance():
            tokens[pr.id] += pr.tokens
    assert tokens[on] == tokens[off]
    assert seen[off]["drafts_proposed"] == 0
    assert 0 < seen[on]["drafts_accepted"] <= seen[on]["drafts_proposed"]
    st = engine.stats()
    assert st["drafts_proposed"] >= seen[on]["drafts_proposed"] and st["draft_steps"] > 0
    for bad in ("no", 0, None):  # only a bool: "no" would otherwise read as true
        with pytest.raises(InvalidArgument, match="speculative"):
            engine.add(Request(p, 4, speculative=bad))


def test_lora_rows_draft_exactly(tmp_path) -> None:
    from tests.test_lora import make_adapter

    hf = build_hf_model("qwen3", tmp_path)
    make_adapter(hf, tmp_path / "a", 1, rslora=False)
    model = superslm.load(tmp_path)
    adapter = model.adapter(tmp_path / "a")
    ps = copy_prompts(4, seed=8)

    def reqs():
        return [Request(p, 30, Sampling(ignore_eos=True), adapter=adapter if i % 2 == 0 else None)
                for i, p in enumerate(ps)]

    plain, _ = generate(model, reqs())
    spec, e = generate(model, reqs(), speculative="ngram")
    same_ends(spec, plain)
    assert e.stats()["drafts_accepted"] > 0


def test_refusals(zoo) -> None:
    model = zoo("llama")
    for bad in ("medusa", 3, Speculative(k=0), Speculative(min_n=3, max_n=2), Speculative(method="eagle"),
                Speculative(row_cost=-1.0), Speculative(decay=1.0)):
        with pytest.raises(InvalidArgument):
            model.engine(slots=1, context=32, speculative=bad)
    # a delta-rule model drafts: scratch rows for the states after each draft row, k a slot here (tiny states)
    hybrid = zoo("qwen3_5")
    engine = hybrid.engine(slots=2, context=32, speculative=Speculative(k=5))
    assert engine.states is not None and engine.states.scratch == 10 and engine.scheduler.draft_rows == 10
    assert hybrid.engine(slots=2, context=32).states.scratch == 0  # no drafts: no scratch rows


@pytest.mark.float_kv  # equal tokens need float pages: one key code rounded otherwise turns a near tie
def test_smollm2_copy_rewrite_equal_tokens(smollm2_gguf) -> None:
    """The real model rewriting a snippet with one change: the same greedy tokens, drafts kept."""
    model = superslm.load(smollm2_gguf)
    snippet = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    chat = [{"role": "user", "content": f"Rewrite this code, renaming w to width:\n```python\n{snippet}```"}]
    prompt = model.chat_tokens(chat)
    plain, _ = generate(model, [Request(prompt, 60)], slots=1, context=512, page_size=16)
    spec, e = generate(model, [Request(prompt, 60)], slots=1, context=512, page_size=16, speculative="ngram")
    same_ends(spec, plain)
    assert e.stats()["drafts_accepted"] > 10
    # deterministic mode: the plan's rows are the same bits at any row count, so logprobs too
    exact = dict(slots=1, context=512, page_size=16, deterministic=True)
    plain, _ = generate(model, [Request(prompt, 40, Sampling(logprobs=2))], **exact)
    spec, e = generate(model, [Request(prompt, 40, Sampling(logprobs=2))], **exact, speculative="ngram")
    same_ends(spec, plain)
    assert spec[0].logprobs == plain[0].logprobs
    assert e.stats()["drafts_accepted"] > 0
