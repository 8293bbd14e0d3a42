"""Speculative decoding with the model's own MTP block (`speculative="mtp"`) on tiny random Qwen3.5 and Qwen3-Next
models with an MTP layer: the same tokens (and in deterministic mode the same logprobs) as plain decoding, the
proposals equal to a reference that runs `mtp.draft` over the whole verified sequence from a fresh KV, no page or
state row left behind, and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache.kv import KVCache
from superslm.engine.mtp_drafter import MTPSpeculator
from superslm.engine.speculative import MTP_DEPTH, Speculative
from superslm.errors import InvalidArgument, UnsupportedModel
from superslm.kernels.attention import AttnMetadata
from superslm.models.mtp import draft
from tests.test_mtp import build_mtp_folder, hidden_states
from tests.test_speculative import copy_prompts, run_checking_pages, same_ends

FAMILIES = ("qwen3_5", "qwen3_next")
#: drafts at every step whatever the acceptance estimates say (rows and the MTP's work priced free)
ALWAYS = Speculative(method="mtp", k=MTP_DEPTH, row_cost=0.0, draft_cost=0.0)


def predicting(model: superslm.Model, eps: float = 0.4) -> superslm.Model:
    """Make the MTP a good guesser, honestly: every layer's output scaled by eps (body and MTP), so the body's next
    token is mostly a bigram of the token it reads, and the MTP fed the embedding alone (fc = [I, 0], enorm 1) with
    the body's final norm: it drafts that same bigram one position ahead. Drafts are then often kept, not always."""
    net = model.net
    dim = net.arch.dim
    with torch.no_grad():
        for layer in [*net.layers, *net.mtp.layers]:
            for parent, attr, name in layer.linears():
                if name.split(".")[-1] in ("out", "o", "down") or "down" in name:
                    w = getattr(parent, attr).weight
                    w.mul_(eps)
        fc = net.mtp.fc.weight
        fc.zero_()
        fc[:, :dim] = torch.eye(dim, dtype=fc.dtype)
        net.mtp.enorm.fill_(1.0)
        net.mtp.norm.copy_(net.norm_weight)
    return model


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """(family, predicting) -> a tiny float32 model with an MTP block, built on first use."""
    built: dict[tuple[str, bool], superslm.Model] = {}

    def get(family: str, good: bool = False) -> superslm.Model:
        if (family, good) not in built:
            folder = tmp_path_factory.mktemp(f"mtp-{family}")
            build_mtp_folder(family, folder)
            model = superslm.load(folder, dtype="float32", quant="none")
            built[family, good] = predicting(model) if good else model
        return built[family, good]

    return get


def reference_drafts(net, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The MTP's k drafts after `tokens` (their last one not computed yet), from scratch: the body over tokens[:-1]
    in one sequence, `mtp.draft` over rows (h_p, tokens[p + 1]) at positions p in a fresh KV, then each draft fed
    back with the MTP's output at the next position. Also each draft's margin over the runner-up logit."""
    c = len(tokens) - 1
    a, ps = net.arch, 4
    pages = -(-(c + k) // ps)
    kv = KVCache(1, pages, ps, a.kv_heads, a.head_dim, net.dtype, kv="fp32")
    table = tuple(range(pages))
    with torch.inference_mode():
        hidden = hidden_states(net, tokens[:c])
        pos = torch.arange(c)
        logits, out = draft(net, hidden, torch.tensor(tokens[1:]), AttnMetadata(pos, pos, (0, c), (c,), (table,), ps),
                            kv.k[0], kv.v[0])
        last, h = logits[-1], out[-1:]
        drafts, margins = [], []
        for j in range(k):
            top = last.topk(2)
            drafts.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if j + 1 == k:
                break
            p = torch.tensor([c + j])
            meta = AttnMetadata(p, p, (0, 1), (c + j + 1,), (table,), ps)
            logits, h = draft(net, h, torch.tensor([drafts[-1]]), meta, kv.k[0], kv.v[0], step=j + 1)
            last = logits[0]
    return drafts, margins


def spy(engine) -> list[tuple[list[int], list[int]]]:
    """Each proposal the engine's MTP makes: (the sequence's tokens then, its drafts before any cut)."""
    spec = engine.speculator
    assert isinstance(spec, MTPSpeculator)
    seen: list[tuple[list[int], list[int]]] = []
    chain = spec.chain

    def record(firsts, want):  # type: ignore[no-untyped-def]
        drafts = chain(firsts, want)
        for f, d in zip(firsts, drafts, strict=True):
            if f is not None and d:
                assert len(f[0].tokens) == f[2] + 1  # the newest token's position: the first draft follows it
                seen.append((list(f[0].tokens), list(d)))
        return drafts

    spec.chain = record
    return seen


def check_proposals(net, seen: list[tuple[list[int], list[int]]], limit: int = 60) -> int:
    """Every recorded proposal (up to `limit`, spread over the run) equals the reference's drafts, up to the first
    near tie of the reference's logits; returns the drafts compared."""
    compared = 0
    for tokens, drafts in seen[:: max(1, len(seen) // limit)]:
        want, margins = reference_drafts(net, tokens, len(drafts))
        for got, w, m in zip(drafts, want, margins, strict=True):
            if m < 1e-3:
                break  # a near tie: rounding may pick either, and the drafts after it follow that choice
            assert got == w, (tokens, drafts, want)
            compared += 1
    return compared


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def run(model, reqs, **kwargs):
    engine = model.engine(**{"slots": 4, "context": 160, "page_size": 4, "kv": "fp32", **kwargs})
    seen = spy(engine) if kwargs.get("speculative") is not None else []
    out = engine.generate(reqs)
    engine.pool.check()
    assert engine.pool.num_used == 0
    return out, engine, seen


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_and_drafts_are_the_references(zoo, family) -> None:
    """A batch of prompts of different lengths read in chunks beside decode rows: the same tokens with MTP drafts
    as without, some drafts kept and some rejected (rollback), each proposal the reference's."""
    model = zoo(family, good=True)

    def reqs():
        return [Request(p, 36, Sampling(ignore_eos=True)) for p in prompts(6, seed=1)]

    plain, e0, _ = run(model, reqs(), rows=16, chunk=5)
    spec, e1, seen = run(model, reqs(), rows=16, chunk=5, speculative=ALWAYS)
    same_ends(spec, plain)
    st = e1.stats()
    assert 0 < st["drafts_accepted"] < st["drafts_proposed"]
    assert st["steps"] < e0.stats()["steps"]
    assert max(len(d) for _, d in seen) == MTP_DEPTH
    assert check_proposals(model.net, seen) > 50


@pytest.mark.parametrize("family", FAMILIES)
def test_random_mtp_proposals_follow_the_reference(zoo, family) -> None:
    """The MTP's random weights (its drafts hardly ever kept: every step rolls back): its KV bookkeeping across
    prompt chunks, decode steps, rollbacks, a prefix cache hit and preemption gives the reference's proposals."""
    from tests.test_engine import engine_page_bytes

    model = zoo(family)
    ps = prompts(5, seed=2)
    ps.append(ps[0] + [7, 8, 9, 10, 11])  # a prefix cache hit on the first one's pages, once it is done

    def reqs():
        return [Request(p, 24, Sampling(ignore_eos=True)) for p in ps]

    plain, _, _ = run(model, reqs(), rows=12, chunk=7)
    spec, e, seen = run(model, reqs(), rows=12, chunk=7, speculative=ALWAYS)
    same_ends(spec, plain)
    assert check_proposals(model.net, seen) > 40
    # a pool that preempts: the preempted sequence's MTP rows are computed again with its prompt and answer
    budget = 18 * engine_page_bytes(model, 4, "fp32") * 2  # the body's attention layer and the MTP's
    spec, e, seen = run(model, reqs(), rows=12, chunk=7, speculative=ALWAYS, kv_budget=budget)
    same_ends(spec, plain)
    assert e.stats()["preemptions"] > 0
    assert check_proposals(model.net, seen) > 40


@pytest.mark.parametrize("page_size", [4, 2])
def test_prefix_cache_hit_drafts_as_the_reference(zoo, page_size) -> None:
    """A second request starting with the first one's prompt and answer resumes from its cached pages (less the
    last matched one) and drafts what the reference drafts over its whole sequence (the random MTP: its drafts
    follow every row of its KV)."""
    model = zoo("qwen3_5")
    # 8 slots: room for 32 checkpoints of the recurrent states, none of this test's evicted
    engine = model.engine(slots=8, context=160, page_size=page_size, kv="fp32", speculative=ALWAYS)
    seen = spy(engine)
    p = prompts(1, seed=3)[0]
    first = engine.generate([Request(p, 20, Sampling(ignore_eos=True))])[0]
    turn = p + first.tokens + [5, 6, 7]
    seen.clear()
    second = engine.generate([Request(turn, 20, Sampling(ignore_eos=True))])[0]
    assert second.cached > len(p)
    plain = model.engine(slots=2, context=160, page_size=page_size, kv="fp32", prefix_caching=False)
    assert second.tokens == plain.generate([Request(turn, 20, Sampling(ignore_eos=True))])[0].tokens
    assert check_proposals(model.net, seen) > 10
    # a prompt that leaves the cached tokens at a page boundary: the last matched page's last MTP row read the
    # token after it, which this prompt changes (the match drops that page and computes it again)
    full = p + first.tokens
    b = len(full) // (2 * page_size) * page_size
    seen.clear()
    other = engine.generate([Request(full[:b] + [(full[b] + 1) % 300 or 2], 12, Sampling(ignore_eos=True))])[0]
    assert other.cached == b - page_size
    assert check_proposals(model.net, seen) > 5


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_mode_is_bit_identical(zoo, family) -> None:
    """Tokens and logprobs with == alone: greedy and seeded sampling, penalties, in a batch."""
    model = zoo(family, good=True)
    samplings = [Sampling(logprobs=3, ignore_eos=True), Sampling(temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
                 Sampling(repetition_penalty=1.2, presence_penalty=0.3, logprobs=1, ignore_eos=True)]

    def reqs():
        return [Request(p, 32, samplings[i % 3]) for i, p in enumerate(prompts(6, seed=4))]

    plain, _, _ = run(model, reqs(), deterministic=True, kv="auto")
    spec, e, _ = run(model, reqs(), deterministic=True, kv="auto", speculative=ALWAYS)
    same_ends(spec, plain)
    assert [c.logprobs for c in spec] == [c.logprobs for c in plain]
    assert e.stats()["drafts_accepted"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_no_page_or_state_row_left_behind(zoo, family) -> None:
    """Random requests (greedy and sampled, random lengths), cancels and a KV budget that preempts: after every step
    each running sequence holds exactly the pages of its computed tokens (the chained drafts' rows live in scratch
    pages outside the pool), the pool's references check out, and every state row comes back."""
    from tests.test_engine import engine_page_bytes

    model = zoo(family, good=True)
    budget = 40 * engine_page_bytes(model, 4) * 2
    engine = model.engine(slots=6, context=96, page_size=4, kv_budget=budget, speculative=ALWAYS)

    def mtp_rows_whole(seq) -> None:
        assert seq.mtp_rows in (0, seq.num_computed_tokens)

    assert engine.states is not None  # its state rows are checked coming back
    run_checking_pages(engine, copy_prompts(40, seed=6), mtp_rows_whole)

def test_adaptive_opt_out_layer_budget_and_stats(zoo) -> None:
    """The default "mtp" prices the MTP's work (draft_cost from the weights) and drafts by the acceptance estimate;
    a request that opts out drafts nothing and gives the same tokens; a layer budget gives the same tokens."""
    model = zoo("qwen3_5", good=True)
    p = prompts(1, seed=5)[0]
    engine = model.engine(slots=2, context=160, page_size=4, speculative="mtp")
    c = engine.speculator.config
    assert c.method == "mtp" and c.k == MTP_DEPTH and 0 < c.draft_cost < 1
    on = engine.add(Request(p, 30, Sampling(ignore_eos=True)))
    off = engine.add(Request(p, 30, Sampling(ignore_eos=True), speculative=False))
    seen: dict[int, dict] = {}
    tokens: dict[int, list[int]] = {on: [], off: []}
    while engine.busy():
        for rid in (on, off):
            if rid in engine.output.seqs:
                seen[rid] = engine.stats(rid)
        for pr in engine.advance(layer_budget=2):
            tokens[pr.id] += pr.tokens
    assert tokens[on] == tokens[off]
    assert seen[off]["drafts_proposed"] == 0
    assert 0 < seen[on]["drafts_accepted"] <= seen[on]["drafts_proposed"]
    # random MTP weights: its drafts are not kept, the estimate falls and drafting stops but for the probes
    model = zoo("qwen3_5")
    engine = model.engine(slots=1, context=160, page_size=4, speculative="mtp")
    engine.generate([Request(p, 60, Sampling(ignore_eos=True))])
    st = engine.stats()
    assert st["drafts_proposed"] < 30 and st["draft_steps"] < 20


def test_refusals(zoo, tmp_path) -> None:
    from tests.tiny_models import build_hf_model

    model = zoo("qwen3_5")
    for bad in (Speculative(method="mtp", k=4), {"method": "mtp", "k": 0}, {"method": "medusa"},
                {"method": "mtp", "depth": 2}):
        with pytest.raises(InvalidArgument):
            model.engine(slots=1, context=32, speculative=bad)
    with pytest.raises(InvalidArgument):
        model.engine(slots=1, context=32, speculative="mtp", graphs=True)
    e = model.engine(slots=1, context=32, speculative={"method": "mtp", "num_speculative_tokens": 2})
    assert e.speculator.config.k == 2 and e.kv.k.shape[0] == model.net.kv_layers + 1
    build_hf_model("qwen3_5", tmp_path / "plain")
    plain = superslm.load(tmp_path / "plain")
    with pytest.raises(UnsupportedModel, match="mtp"):
        plain.engine(slots=1, context=32, speculative="mtp")
    assert plain.engine(slots=1, context=32, speculative="ngram").kv.k.shape[0] == plain.net.kv_layers


@pytest.mark.parametrize("length", [8, 10])
def test_prefix_handles_draft_as_the_reference(zoo, length) -> None:
    """A prefix handle computes its MTP rows but the last (which reads the adopter's first token); each adopter
    writes that row in its own copy of the handle's last page (a full one too) and drafts as the reference."""
    model = zoo("qwen3_5")
    engine = model.engine(slots=3, context=160, page_size=4, kv="fp32", speculative=ALWAYS)
    seen = spy(engine)
    head = prompts(1, seed=7)[0][:1] + list(range(20, 20 + length - 1))
    handle = engine.prefix(head)
    tails = [[31, 32, 33], [41], [51, 52, 53, 54, 55, 56]]
    got = engine.generate([Request(t, 16, Sampling(ignore_eos=True), prefix=handle) for t in tails])
    plain = model.engine(slots=3, context=160, page_size=4, kv="fp32")
    want = plain.generate([Request(head + t, 16, Sampling(ignore_eos=True)) for t in tails])
    same_ends(got, want)
    assert check_proposals(model.net, seen) > 20
    engine.release(handle)
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_serve_speculative_argument() -> None:
    import argparse

    from superslm.serve.cli import speculative_arg

    assert speculative_arg("mtp") == "mtp" and speculative_arg("ngram") == "ngram"
    assert speculative_arg('{"method": "mtp", "num_speculative_tokens": 1}') == {"method": "mtp",
                                                                                 "num_speculative_tokens": 1}
    for bad in ("eagle", "[1]", "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            speculative_arg(bad)


def test_save_restore_between_engines(zoo) -> None:
    """A request saved mid-answer by an MTP engine goes on in another one with the same tokens and the reference's
    proposals (its blob carries the MTP's KV rows); blobs cross to an engine without the MTP's layer and back (that
    one then goes on without drafts)."""
    model = zoo("qwen3_5")
    p = prompts(1, seed=8)[0]
    want = model.engine(slots=1, context=160, page_size=4, kv="fp32").generate(
        [Request(p, 30, Sampling(ignore_eos=True))])[0].tokens

    def first_part(engine):  # type: ignore[no-untyped-def]
        rid = engine.add(Request(p, 30, Sampling(ignore_eos=True)))
        got: list[int] = []
        while len(got) < 10:
            for pr in engine.advance():
                got += pr.tokens
        return rid, got

    def rest(engine) -> list[int]:  # type: ignore[no-untyped-def]
        got: list[int] = []
        while engine.busy():
            for pr in engine.advance():
                got += pr.tokens
        engine.pool.check()
        return got

    def mtp_engine():  # type: ignore[no-untyped-def]
        return model.engine(slots=1, context=160, page_size=4, kv="fp32", speculative=ALWAYS)

    a = mtp_engine()
    rid, head = first_part(a)
    b = mtp_engine()
    seen = spy(b)
    b.restore(a.save(rid))
    assert head + rest(b) == want
    assert check_proposals(model.net, seen) > 10
    plain = model.engine(slots=1, context=160, page_size=4, kv="fp32", speculative="ngram")
    a = mtp_engine()
    rid, head = first_part(a)
    plain.restore(a.save(rid))
    assert head + rest(plain) == want
    rid, head = first_part(plain)
    c = mtp_engine()
    c.restore(plain.save(rid))
    assert head + rest(c) == want and c.stats()["drafts_proposed"] == 0


def test_grammar_rows_draft_exactly(zoo) -> None:
    """Under a grammar the MTP's drafts are cut where the grammar refuses them; the tokens are plain decoding's."""
    from superslm.grammar import Constraint

    model = zoo("qwen3_5", good=True)
    constraints = [Constraint.regex(r"[a-z ]{1,60}"), Constraint.regex(r"(ab|abc|[a-c ])+")]
    samplings = [dict(), dict(temperature=0.8, seed=3), dict(logprobs=2)]

    def reqs():
        return [Request(p, 30, Sampling(grammar=constraints[i % 2], **samplings[i % 3]))
                for i, p in enumerate(prompts(6, seed=10))]

    plain, _, _ = run(model, reqs())
    spec, e, _ = run(model, reqs(), speculative=ALWAYS)
    same_ends(spec, plain)
    assert e.stats()["drafts_accepted"] > 0
