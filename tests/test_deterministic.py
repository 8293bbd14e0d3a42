"""Deterministic mode: a request's tokens and logprobs are bit-identical whatever else happens."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache.kv import slot_mapping
from superslm.kernels import attention_invariant
from superslm.kernels.attention import AttnMetadata, paged_attention
from superslm.kernels.attention_invariant import KEYS, ROWS, block_sum, paged_attention_invariant
from superslm.kernels.row_blocks import BLOCK, by_row_blocks
from tests.test_engine import engine_page_bytes, prompts
from tests.tiny_models import SingleSequence, build_hf_model


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def model(request, tmp_path_factory) -> superslm.Model:
    folder = tmp_path_factory.mktemp(f"det-{request.param}")
    build_hf_model(request.param, folder)
    return superslm.load(folder)


def run(model: superslm.Model, ps: list[list[int]], budget: int | None = None, tokens: int = 10, **kw) -> list[tuple]:
    """Tokens and logprobs of each prompt; a prompt's seed is a function of the prompt alone."""
    engine = model.engine(**{"slots": 8, "context": 128, "deterministic": True, **kw})
    samplings = [Sampling(temperature=0.9, top_p=0.95, seed=sum(p), logprobs=3, ignore_eos=True) for p in ps]
    ids = [engine.add(Request(p, tokens, s)) for p, s in zip(ps, samplings)]
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


def test_matmul_rows_do_not_depend_on_the_batch() -> None:
    """What the invariant attention assumes of the batched matmuls where the tests run: with one matrix
    shape (ROWS query rows by KEYS keys), a row's results have the same bits whatever the batch count, the
    matrix's place in the batch and the other rows of its matrix (scores: baddbmm with the mask bias and
    the keys transposed; then P @ [V | 1] over one block)."""
    g = torch.Generator().manual_seed(5)
    for d in (32, 64, 128, 256):
        for scores in (True, False):
            k, n = (d, KEYS) if scores else (KEYS, d + 1)
            a, b = torch.randn(k, generator=g), torch.randn(k, n, generator=g)
            want = None
            for batch in (1, 3, 24, 50, 768):
                x, y = torch.randn(batch, ROWS, k, generator=g), torch.randn(batch, n, k, generator=g)
                i, c = batch % ROWS, batch // 2
                x[c, i], y[c] = a, b.T
                if scores:
                    got = torch.baddbmm(torch.zeros(batch, ROWS, n), x, y.transpose(1, 2), alpha=0.125)[c, i]
                else:
                    got = torch.bmm(x, y.transpose(1, 2).contiguous())[c, i]
                want = got if want is None else want
                assert torch.equal(got, want), (d, scores, batch)


def test_block_sum_is_sequential_and_ignores_zero_blocks() -> None:
    g = torch.Generator().manual_seed(6)
    for blocks in (3, 15, 22, 43, 130):
        x = torch.randn(6, blocks, 4, 33, generator=g)
        want = x[:, 0].double()
        for i in range(1, blocks):
            want = want + x[:, i].double()
        got = block_sum(x)
        assert torch.equal(got, want.to(x.dtype))
        for before, after, batch in ((0, 1, 6), (2, 16, 9), (5, blocks + 7, 16)):
            y = torch.zeros(batch, before + blocks + after, 4, 33)
            y[:6, before : before + blocks] = x
            assert torch.equal(block_sum(y)[:6], got), (blocks, before, after, batch)


def _paged(lens: list[int], rows: list[int], page_size: int, seed: int) -> tuple:
    """Random block tables for sequences of `lens` tokens whose last `rows` tokens are queried."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(pages) + 3, generator=g).tolist()
    tables = [tuple(perm[sum(pages[:i]) : sum(pages[: i + 1])]) for i in range(len(lens))]
    pos = [p for n, r in zip(lens, rows) for p in range(n - r, n)]
    slots = [s for n, r, t in zip(lens, rows, tables) for s in slot_mapping(t, n - r, n, page_size)]
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r)
    return tables, pos, slots, starts, (sum(pages) + 3) * page_size


@pytest.mark.parametrize("dtype,budget", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 1 << 13)])
def test_invariant_attention_ignores_the_rest_of_the_step(dtype, budget, monkeypatch) -> None:
    """Each row gets the same bits in a mixed step (decodes, long and short chunks), alone, one row
    at a time, and with padding rows after the step's; and stays close to the SDPA reference. A small
    budget cuts the step into many groups."""
    if budget is not None:
        monkeypatch.setattr(attention_invariant, "GROUP_BUDGET", budget)
    heads, kv, d, ps = 6, 2, 32, 4
    lens, rows = [37, 5, 130, 70, 16, 90, 600], [1, 5, 70, 1, 9, 1, 1]  # decodes of 1 to 10 key blocks
    tables, pos, slots, starts, nslots = _paged(lens, rows, ps, seed=7)
    g = torch.Generator().manual_seed(8)
    kc, vc = (torch.randn(nslots, kv, d, generator=g).to(dtype) for _ in range(2))
    # value dim 0 is zero but in the last 35 keys of the 70-token chunk: before them, any leak from a
    # masked (later) key would show in the output's dim 0
    vc[..., 0] = 0
    vc[[tables[2][p // ps] * ps + p % ps for p in range(lens[2] - 35, lens[2])], :, 0] = 1
    q = torch.randn(len(pos), heads, d, generator=g).to(dtype)

    def meta(p, sl, st, ln, tb):
        return AttnMetadata(torch.tensor(p), torch.tensor(sl), tuple(st), tuple(ln), tuple(tb), ps, deterministic=True)

    for window in (None, 6, 50):
        step = meta(pos, slots, starts, lens, tables)
        full = paged_attention_invariant(q, kc, vc, step, window, d**-0.5)
        want = paged_attention(q.float(), kc.float(), vc.float(), step, window, d**-0.5)
        assert (full.float() - want).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
        assert not full[starts[2] : starts[2] + 35, :, 0].any()
        padded = paged_attention_invariant(torch.cat([q, q[:3]]), kc, vc, step, window, d**-0.5)
        assert torch.equal(padded[: len(pos)], full) and not padded[len(pos) :].any()
        for s, (a, b) in enumerate(zip(starts, starts[1:])):
            alone = meta(pos[a:b], slots[a:b], (0, b - a), (lens[s],), (tables[s],))
            assert torch.equal(paged_attention_invariant(q[a:b], kc, vc, alone, window, d**-0.5), full[a:b])
            for r in range(a, b, 3):  # as if the prompt had been fed one token per step
                one = meta(pos[r : r + 1], slots[r : r + 1], (0, 1), (pos[r] + 1,), (tables[s],))
                got = paged_attention_invariant(q[r : r + 1], kc, vc, one, window, d**-0.5)
                assert torch.equal(got, full[r : r + 1]), (window, s, r)


def test_row_blocks_give_each_row_one_shape() -> None:
    """Deterministic linears multiply 16 rows at a time: a row's bits are those of its row alone (padded
    to 16), whatever the step's row count, at the shapes where MKL on an Intel Xeon summed a 64-row GEMM's
    rows otherwise (SmolLM2's down projection, 2 threads)."""
    g = torch.Generator().manual_seed(4)
    shapes: list[int] = []

    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(576, 1536, generator=g).to(dtype)
        x = torch.randn(130, 1536, generator=g).to(dtype)

        def linear(rows: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            shapes.append(rows.shape[0])
            return torch.nn.functional.linear(rows, w)

        alone = torch.cat([by_row_blocks(linear, x[i : i + 1]) for i in range(len(x))])
        for n in (1, 15, 16, 17, 64, 128, 130):
            assert torch.equal(by_row_blocks(linear, x[:n]), alone[:n]), (dtype, n)
    assert set(shapes) == {BLOCK}


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    """One Llama layer with SmolLM2's widths: where BLAS shape choices show."""
    from tests.tiny_models import CONFIGS

    folder = tmp_path_factory.mktemp("det-wide")
    kw = dict(CONFIGS["llama"][1], hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
              num_attention_heads=9, num_key_value_heads=3)  # fmt: skip
    CONFIGS["wide"] = ("LlamaConfig", kw)
    try:
        build_hf_model("wide", folder)
    finally:
        del CONFIGS["wide"]
    return folder


@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("plan", [True, False])
def test_dense_fp32_rows_are_batch_invariant(wide_folder, plan: bool, quant: str | None) -> None:
    """A dense float32 model (BLAS GEMMs, no packed kernels), and the same with rotated int4 linears (on the
    torch path the rotation is a bf16 matmul), in the C++ plan and on the torch path: a request's tokens and
    logprobs alone equal those in a batch of long prompts and in other chunkings."""
    model = superslm.load(wide_folder, quant=quant)
    if quant is not None:
        assert model.net.layers[0].down.rotation is not None and model.net.row_multiple == BLOCK
    model.net.fast_decode = plan
    ps = prompts(4, seed=23, lo=60, hi=90)
    kw = dict(slots=4, context=160)
    alone = [run(model, [p], **kw)[0] for p in ps]
    assert run(model, ps, **kw) == alone
    assert run(model, ps, chunk=16, **kw) == alone
