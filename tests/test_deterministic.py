"""Deterministic mode: a request's tokens and logprobs are bit-identical whatever else happens."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.kernels.attention import paged_attention
from superslm.kernels.attention_invariant import paged_attention_invariant, tree_sum
from tests.test_engine import engine_page_bytes, prompts
from tests.tiny_models import SingleSequence, build_hf_model


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def model(request, tmp_path_factory) -> superslm.Model:
    folder = tmp_path_factory.mktemp(f"det-{request.param}")
    build_hf_model(request.param, folder)
    return superslm.load(folder)


def run(model: superslm.Model, ps: list[list[int]], budget: int | None = None, **kw) -> list[tuple]:
    """Tokens and logprobs of each prompt; a prompt's seed is a function of the prompt alone."""
    engine = model.engine(**{"slots": 8, "context": 128, "deterministic": True, **kw})
    samplings = [Sampling(temperature=0.9, top_p=0.95, seed=sum(p), logprobs=3, ignore_eos=True) for p in ps]
    ids = [engine.add(Request(p, 10, s)) for p, s in zip(ps, samplings)]
    got: dict[int, list] = {i: [] for i in ids}
    while engine.busy():
        for p in engine.advance(layer_budget=budget):
            got[p.id] += [(lp.token, lp.logprob, lp.top) for lp in p.logprobs]
    return [tuple(got[i]) for i in ids]


def test_tokens_and_logprobs_are_bit_identical(model) -> None:
    ps = prompts(8, seed=21, lo=5, hi=40)
    alone = [run(model, [p], slots=1)[0] for p in ps]
    assert run(model, ps) == alone
    for chunk in (1, 7, 64):
        assert run(model, ps, chunk=chunk) == alone, f"chunk {chunk}"
    assert run(model, ps[::-1])[::-1] == alone  # batch order
    assert run(model, ps[:3], budget=1) == alone[:3]  # layer budget 1
    # preemption and resume, and a warm prefix cache
    engine_kw = dict(page_size=4, kv_budget=40 * engine_page_bytes(model, 4))
    assert run(model, ps, **engine_kw) == alone
    engine = model.engine(slots=8, context=128, deterministic=True, page_size=4)
    s = Sampling(temperature=0.9, seed=0, logprobs=3, ignore_eos=True)
    cold = engine.generate([Request(ps[0], 10, s)])[0]
    warm = engine.generate([Request(ps[0], 10, s)])[0]
    assert warm.cached > 0
    assert [(x.token, x.logprob, x.top) for x in warm.logprobs] == [(x.token, x.logprob, x.top) for x in cold.logprobs]


def test_invariant_attention_matches_reference(model) -> None:
    torch.manual_seed(0)
    seq = SingleSequence(model.net, seed=3)
    tokens = prompts(1, seed=22, lo=50, hi=50)[0]
    with torch.no_grad():
        seq.step(tokens)
    from superslm.kernels.attention import AttnMetadata

    a = model.arch
    pos = torch.arange(40, 50)
    ps = seq.page_size
    slots = torch.tensor([seq.block_table[p // ps] * ps + p % ps for p in pos.tolist()])
    meta = AttnMetadata(pos, slots, (0, 10), (50,), (seq.block_table,), ps)
    q = torch.randn(10, a.heads, a.head_dim)
    for window in (None, 6):
        want = paged_attention(q, seq.kv.k[0], seq.kv.v[0], meta, window, a.attn_scale)
        got = paged_attention_invariant(q, seq.kv.k[0], seq.kv.v[0], meta, window, a.attn_scale)
        assert (got - want).abs().max() <= 1e-5


def test_tree_sum_ignores_zero_padding() -> None:
    x = torch.rand(3, 37)
    base = tree_sum(torch.cat([x, torch.zeros(3, 64 - 37)], -1))
    longer = tree_sum(torch.cat([x, torch.zeros(3, 256 - 37)], -1))
    assert torch.equal(base, longer) and torch.allclose(base, x.sum(-1))
