"""The device-side sampling kernels equal their torch references, and the references equal what
superslm.sampling's sampler produces: under TRITON_INTERPRET=1 on the CPU, on the GPU where present.

Small vocabularies on purpose (the interpreter runs each program in Python); 777 is off the tiles.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.sampling_args import LogitBias, Penalties  # noqa: E402
from superslm.sampling import (  # noqa: E402
    PenaltyState,
    SamplerState,
    Sampling,
    on_device,  # noqa: E402
    sample,
)
from superslm.sampling.batch import sampling_batch  # noqa: E402

INF = math.inf




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, ceil(V / 32)], bit j of word w = token 32 w + j (bits past V set)."""
    b, v = allowed.shape
    words = -(-v // 32)
    bits = torch.ones(b, words * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    packed = (bits.view(b, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def few_allowed(b: int, v: int, rows: tuple[int, ...], seed: int) -> torch.Tensor:
    """Rows in `rows` allow 5 random tokens (one in the last, partial word); the others all."""
    allowed = torch.ones(b, v, dtype=torch.bool)
    g = gen(seed)
    for r in rows:
        allowed[r] = False
        allowed[r, torch.randperm(v, generator=g)[:4]] = True
        allowed[r, v - 3] = True
    return pack_bitmask(allowed)


# --- shaping --------------------------------------------------------------------------------------


def shaping_inputs(b: int, v: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = gen(seed)
    logits = torch.randn(b, v, generator=g) * 4
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.3][:b])
    bitmask = few_allowed(b, v, (1,) if b > 1 else (), seed)
    # row 0: three pairs (one at the vocabulary's end), row 2: none, others one each
    per_row = [3, 1, 0, 1, 2][:b]
    tokens = torch.cat([torch.tensor([v - 1]), torch.randperm(v - 1, generator=g)[: sum(per_row) - 1]])
    offsets = torch.tensor([0, *per_row]).cumsum(0).to(torch.int32)
    bias = LogitBias(offsets, tokens.to(torch.int32), (torch.rand(len(tokens), generator=g) - 0.5) * 40)
    # penalties on rows 0 (all three), 2 (repetition only), 3 (presence, frequency), 4 (frequency)
    pen_rows = torch.tensor([0, -1, 1, 2, 3][:b], dtype=torch.int32)
    p = int((pen_rows >= 0).sum())
    counts = torch.randint(0, 4, (p, v), generator=g, dtype=torch.int32) * (torch.rand(p, v, generator=g) < 0.05)
    prompt_mask = torch.rand(p, v, generator=g) < 0.1
    factors = torch.tensor([[0.5, 0.3, 1.3], [0.0, 0.0, 1.0], [0.0, 0.0, 0.8], [-1.0, 1.5, 1.0], [0.0, -0.4, 1.0]])
    penalties = Penalties(pen_rows, counts, prompt_mask, factors[:b])
    return logits, temperature, bitmask, bias, penalties


@pytest.mark.parametrize("v", [1000, 777])
@pytest.mark.parametrize("b", [1, 5])
@pytest.mark.parametrize("stages", ["all", "none", "mask", "bias", "penalties"])
def test_shape_logits(b: int, v: int, stages: str) -> None:
    logits, temperature, bitmask, bias, penalties = shaping_inputs(b, v, seed=b * v)
    args = [logits.to(DEV), temperature.to(DEV)]
    args.append(bitmask.to(DEV) if stages in ("all", "mask") else None)
    args.append(LogitBias(*(t.to(DEV) for t in bias)) if stages in ("all", "bias") else None)
    args.append(Penalties(*(t.to(DEV) for t in penalties)) if stages in ("all", "penalties") else None)
    ref = on_device.shape_logits_reference(*args)
    out = tk.shape_logits(*args)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)  # in practice bit for bit
    assert torch.equal(out.isneginf(), ref.isneginf())


def test_shape_logits_bf16() -> None:
    """bf16 logits (what models emit) are shaped in float32; a strided row view is fine."""
    logits, temperature, bitmask, bias, penalties = shaping_inputs(5, 777, seed=3)
    wide = torch.randn(5, 800, generator=gen(4)).to(torch.bfloat16)
    wide[:, 10:787] = logits.to(torch.bfloat16)
    x = wide[:, 10:787].to(DEV)
    args = (temperature.to(DEV), bitmask.to(DEV), LogitBias(*(t.to(DEV) for t in bias)),
            Penalties(*(t.to(DEV) for t in penalties)))  # fmt: skip
    torch.testing.assert_close(tk.shape_logits(x, *args), on_device.shape_logits_reference(x, *args), rtol=1e-6, atol=0)


# --- selection ------------------------------------------------------------------------------------

# (temperature, log(min_p), top_k, top_p) per row: greedy and sampled rows, each filter alone and mixed
ROWS = [
    (0.0, -INF, 0, 1.0),  # greedy
    (1.0, -INF, 0, 1.0),  # plain sampling
    (1.0, -INF, 1, 1.0),  # top_k 1: the argmax
    (0.8, -INF, 50, 1.0),
    (1.0, -INF, 0, 0.9),
    (1.0, math.log(0.1), 0, 1.0),
    (1.2, math.log(0.05), 50, 0.9),  # all three
    (0.0, math.log(0.5), 1, 0.5),  # greedy rows ignore the filters
    (1.0, -INF, 2000, 0.3),  # k >= V is off
]


def select_inputs(rows: list[tuple[float, float, int, float]], logits: torch.Tensor, seed: int) -> tuple:
    temperature, lmp, top_k, top_p = (torch.tensor(c) for c in zip(*rows, strict=True))
    keys = torch.randint(0, 2**32, (len(rows), 2), generator=gen(seed))
    args = (logits, temperature.float(), lmp.float(), top_k.to(torch.int32), top_p.float(), keys)
    return tuple(a.to(DEV) for a in args)


def check_select(args: tuple) -> torch.Tensor:
    """Tokens equal, and the filtered logits (the kept sets) too; returns the tokens."""
    b, v = args[0].shape
    f_ref = torch.full((b, v), 7.0, device=DEV)
    f_out = torch.full((b, v), 7.0, device=DEV)
    ref = on_device.select_tokens_reference(*args, f_ref)
    out = tk.select_tokens(*args, f_out)
    assert torch.equal(f_out, f_ref), (f_out != f_ref).sum(1)
    assert torch.equal(out, ref)
    assert torch.equal(tk.select_tokens(*args), ref)  # no filtered output: greedy rows skip the race
    return out


@pytest.mark.parametrize("v", [1000, 777])
@pytest.mark.parametrize("b", [1, 5, len(ROWS)])
def test_select_tokens(b: int, v: int) -> None:
    rows = ROWS[:b] if b < len(ROWS) else ROWS
    if b == 1:
        rows = [ROWS[6]]
    for scale, seed in ((1.0, 0), (3.0, 1)):  # flat (top_p keeps many) and peaked rows
        logits = torch.randn(len(rows), v, generator=gen(v + seed)) * scale
        tokens = check_select(select_inputs(rows, logits, seed=b + seed))
        if b >= 3:  # row 0 greedy, row 2 top_k 1: both the argmax
            assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.slow
def test_select_tokens_ties() -> None:
    """Few distinct values: top_k keeps the whole tie at the k-th value; top_p cuts inside a tie
    group in token-id order; the greedy argmax is the first maximal token. 24 noise streams."""
    v = 777
    base = torch.randint(0, 6, (v,), generator=gen(5)).float() * 0.25
    base[[40, 700]] = 2.0  # a tied maximum
    base[[3, 333]] = torch.nextafter(torch.tensor(1.25), torch.tensor(0.0))  # keys next to top_k's k-th
    rows = [(0.0, -INF, 0, 1.0), (1.0, -INF, 50, 1.0), (1.0, -INF, 0, 0.5), (0.5, math.log(0.3), 0, 0.7),
            (1.0, -INF, 100, 0.2), (1.0, -INF, 1, 1.0)] * 4  # fmt: skip
    logits = base.expand(len(rows), v).clone()
    tokens = check_select(select_inputs(rows, logits, seed=6))
    assert tokens[0] == 40 and tokens[5] in (40, 700)


def test_select_tokens_bitmask_few() -> None:
    """Shaped with a bitmask that allows 5 tokens: every row's token is one of them."""
    b, v = 5, 1000
    logits, _, bitmask, _, _ = shaping_inputs(b, v, seed=8)
    bitmask = few_allowed(b, v, tuple(range(b)), seed=9)
    rows = [ROWS[i] for i in (0, 1, 3, 4, 6)]
    temperature = torch.tensor([r[0] for r in rows])
    shaped = on_device.shape_logits_reference(logits.to(DEV), temperature.to(DEV), bitmask.to(DEV))
    tokens = check_select(select_inputs(rows, shaped.cpu(), seed=10))
    assert bool(shaped.gather(1, tokens.unsqueeze(1)).isfinite().all())


# --- the references are the sampler ---------------------------------------------------------------


def sampler_rows(v: int) -> list[SamplerState]:
    g = gen(11)

    def hist() -> PenaltyState:
        out = Counter({int(t): int(n) for t, n in zip(torch.randint(0, v, (12,), generator=g),
                                                      torch.randint(1, 4, (12,), generator=g))})  # fmt: skip
        return PenaltyState(frozenset(int(t) for t in torch.randint(0, v, (30,), generator=g)), out)

    params = [
        Sampling(),
        Sampling(temperature=0.9, seed=1),
        Sampling(temperature=0.7, top_k=50, seed=2, presence_penalty=0.6),
        Sampling(temperature=1.0, top_p=0.9, seed=3, frequency_penalty=0.4, logit_bias={5: 30.0, v - 1: -10.0}),
        Sampling(temperature=1.1, min_p=0.1, seed=4, repetition_penalty=1.3),
        Sampling(repetition_penalty=1.2, frequency_penalty=-0.5, logit_bias={7: 5.0}),  # greedy
        Sampling(temperature=0.6, top_k=1, top_p=0.5, seed=5),
        Sampling(temperature=1.5, top_k=20, top_p=0.8, min_p=0.02, seed=6, presence_penalty=-1.0),
    ]
    return [SamplerState(p, seed=p.seed or 0, step=3 * i, penalties=hist() if p.uses_penalties else None)
            for i, p in enumerate(params)]  # fmt: skip


@pytest.mark.parametrize("v", [1000, 777])
def test_references_are_the_sampler(v: int) -> None:
    states = sampler_rows(v)
    b = len(states)
    logits = (torch.randn(b, v, generator=gen(12)) * 2).to(DEV)
    bitmask = few_allowed(b, v, (2, 5), seed=13).to(DEV)
    want = sample(logits, states, bitmask=bitmask).tokens
    batch = sampling_batch(states, v, DEV)
    shaped = on_device.shape_logits_reference(logits, batch.temperature, bitmask, batch.bias, batch.penalties)
    sel = (batch.temperature, batch.log_min_p, batch.top_k, batch.top_p, batch.keys)
    assert torch.equal(on_device.select_tokens_reference(shaped, *sel), want)
    # and the kernels, end to end
    out = tk.select_tokens(tk.shape_logits(logits, batch.temperature, bitmask, batch.bias, batch.penalties), *sel)
    assert torch.equal(out, want)


@pytest.mark.parametrize("env", ["triton", "torch"])
def test_the_sampler_runs_fused_on_the_kernels(env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """sample() takes the two device kernels where they are Triton (here: the interpreter) and gives the
    staged path's tokens; forced with the torch references too. Rows asking for logprobs take them too."""
    monkeypatch.setenv(dispatch.ENV, env)
    states = sampler_rows(777)
    logits = (torch.randn(len(states), 777, generator=gen(15)) * 2).to(DEV)
    bitmask = few_allowed(len(states), 777, (2, 5), seed=16).to(DEV)
    calls: list[str] = []
    for name in ("shape_logits", "select_tokens"):
        fn = getattr(on_device, name)
        monkeypatch.setattr(on_device, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    for mask in (None, bitmask):
        want = sample(logits, states, bitmask=mask, fused=False).tokens
        calls.clear()
        got = sample(logits, states, bitmask=mask, fused=None if env == "triton" else True).tokens
        assert calls == ["shape_logits", "select_tokens"]
        assert torch.equal(got, want)
    calls.clear()
    assert sample(logits, states, fused=None).tokens.shape == (len(states),)
    assert calls == (["shape_logits", "select_tokens"] if env == "triton" else [])
    # a row's token does not hang on whether another row asks for logprobs (it used to send the whole step
    # down the staged path, whose reductions on a GPU are laid out by the row count)
    hot = Sampling(temperature=0.9, top_p=0.8, top_k=50)
    alone = [SamplerState(hot, seed=5), SamplerState(hot, seed=6)]
    with_lp = [SamplerState(hot, seed=5), SamplerState(Sampling(temperature=0.9, top_p=0.8, top_k=50,
                                                                logprobs=3), seed=6)]
    calls.clear()
    res = sample(logits[:2], with_lp, fused=True)
    assert calls == ["shape_logits", "select_tokens"]
    assert torch.equal(res.tokens, sample(logits[:2], alone, fused=True).tokens)
    assert torch.equal(res.tokens, sample(logits[:2], with_lp, fused=False).tokens)
    staged = sample(logits[:2], with_lp, fused=False).logprobs()
    assert res.logprob_rows == (1,) and res.logprobs() == staged and staged[1].rank >= 1
    calls.clear()
    # plain greedy rows: the first argmax, no kernel (ties included: the kernels take the first index too)
    greedy = [SamplerState(Sampling(), seed=0)] * 3
    tied = logits[:3].clone()
    tied[:, 7] = tied[:, 700] = tied.max() + 1
    got = sample(tied, greedy, fused=True).tokens
    assert calls == [] and got.tolist() == [7, 7, 7]
    assert torch.equal(got, sample(tied, greedy, fused=False).tokens)
    b = sampling_batch(greedy, 777, tied.device)
    assert torch.equal(got, on_device.select_tokens(on_device.shape_logits(tied, b.temperature), b.temperature,
                                                   b.log_min_p, b.top_k, b.top_p, b.keys))


# --- dispatcher -----------------------------------------------------------------------------------


def test_dispatch_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    states = sampler_rows(300)[:3]
    logits = torch.randn(3, 300, generator=gen(14)).to(DEV)
    batch = sampling_batch(states, 300, DEV)
    sel = (batch.temperature, batch.log_min_p, batch.top_k, batch.top_p, batch.keys)
    calls: list[str] = []
    for owner, name in ((tk, "shape_logits"), (tk, "select_tokens"), (on_device, "shape_logits_reference"),
                        (on_device, "select_tokens_reference")):  # fmt: skip
        fn = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    results = []
    for choice in ("triton", "torch"):
        monkeypatch.setenv(dispatch.ENV, choice)
        shaped = on_device.shape_logits(logits, batch.temperature, None, batch.bias, batch.penalties)
        results.append(on_device.select_tokens(shaped, *sel))
    assert calls == ["shape_logits", "select_tokens", "shape_logits_reference", "select_tokens_reference"]
    assert torch.equal(results[0], results[1])
