"""Certified greedy tokens from an int8 head (kernels/cpu/greedy.cpp, cpu_decode.greedy_head): the same
tokens as the argmax of the exact int8 kernels' logits (AVX-512 VNNI, or AVX2 where VNNI is missing), ties to
the first index, and a clean refusal where the bound cannot help."""

from __future__ import annotations

import os

import pytest
import torch

import superslm
from superslm import Request, Sampling, cext
from superslm.kernels import cpu_decode
from superslm.quant.dense import Int8Linear


def _ext():
    """The extension whose int8 kernels run here: the VNNI build, or the AVX2 one."""
    ext = cext.vnni()
    if ext is not None:
        return ext
    ext = cext.extension()
    return ext if ext is not None and ext.avx2_available() else None


pytestmark = pytest.mark.skipif(
    os.environ.get("SUPERSLM_CPU_KERNELS") == "0" or _ext() is None, reason="needs the VNNI or AVX2 kernels"
)


def _head(n: int, k: int, seed: int, ties: int = 0) -> Int8Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + torch.rand(n, 1, generator=g))
    if ties:  # duplicate rows: equal logits, the argmax must be the first of them
        w[n // 2 : n // 2 + ties] = w[n // 3]
    return Int8Linear.from_dense(w)


def _hidden(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :3] *= 8  # a few outlier channels, as real hidden states have
    return x.to(torch.bfloat16)


def _exact(head: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The head's logits as `logits` computes them here (the VNNI GEMM, or the AVX2 kernels row by row)."""
    if cext.vnni() is not None:
        ext = cext.vnni()
        return ext.int8_gemm(x, head.codes, head.scale, ext.int8_rowsum(head.codes)).float()
    return cpu_decode.vnni_linear(head, x).float()


def test_the_exact_logits_are_the_heads() -> None:
    """The reference the tests compare against is the head's own arithmetic: within int8 rounding of the float
    product (and, on AVX2, the same bits row by row as in a batch)."""
    head = _head(777, 128, 4)
    x = _hidden(5, 128, 9)
    got = _exact(head, x)
    ref = x.float() @ head.dequantize().float().T
    assert (got - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
    assert torch.equal(torch.cat([_exact(head, x[i : i + 1]) for i in range(5)]), got)


@pytest.mark.parametrize("m", [4, 7, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_equal_the_exact_argmax(m: int, seed: int) -> None:
    head = _head(3001, 128, seed, ties=5)
    x = _hidden(m, 128, seed + 10)
    want = _exact(head, x).argmax(dim=1)
    got = cpu_decode.greedy_head(head, x)
    assert got is not None and torch.equal(got, want)


def test_near_ties_the_approximation_reverses() -> None:
    """Rows whose top logits differ by less than the one-part approximation's error (codes one apart in a
    few places): the approximate order is often wrong, the certified tokens never are."""
    g = torch.Generator().manual_seed(7)
    n, k = 256, 64
    base = torch.randint(-100, 100, (k,), generator=g, dtype=torch.int32)
    codes = base.repeat(n, 1)
    for r in range(1, n):
        at = torch.randperm(k, generator=g)[:6]
        codes[r, at] += torch.randint(-1, 2, (6,), generator=g, dtype=torch.int32)
    head = Int8Linear(codes.clamp(-127, 127).to(torch.int8), torch.full((n,), 0.01, dtype=torch.bfloat16), k, n)
    x = (base.float() * 0.05 + torch.randn(32, k, generator=g)).to(torch.bfloat16)
    ext = _ext()
    full = _exact(head, x)
    for i in range(0, 32, 8):
        assert torch.equal(cpu_decode.greedy_head(head, x[i : i + 8]), full[i : i + 8].argmax(dim=1))
    # the approximation alone (first int8 part only) picks another token on some rows
    xf = x.float()
    sh = xf.abs().amax(1, keepdim=True) / 127
    approx = (torch.round(xf / sh) * sh) @ (codes.float() * 0.01).T
    assert (approx.argmax(dim=1) != full.argmax(dim=1)).any()
    assert ext is not None


def test_an_outlier_channel_is_taken_exactly() -> None:
    """One channel at ~20x the others' rms (SmolLM2's final hidden states have one): multiplied in float
    beside the int8 part, it no longer sets the int8 step, and the candidates stay few."""
    ext = _ext()
    head = _head(4096, 192, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 192, generator=g)
    x[:, 17] = 20.0 * torch.sign(torch.randn(8, generator=g))
    x[:, 40] *= 6
    x = x.to(torch.bfloat16)
    rowsum = ext.int8_rowsum(head.codes)
    cands, ok = ext.int8_greedy_candidates(x, head.codes, head.scale, rowsum, ext.int8_rownorm(head.codes, head.scale),
                                           4096)
    assert ok and cands.numel() < 64
    assert torch.equal(cpu_decode.greedy_head(head, x), _exact(head, x).argmax(dim=1))


def test_the_exact_kernels_second_part_is_bounded_with_their_step() -> None:
    """The bound's second-part term uses the step of the full row's split (what int8_gemm uses), not of the
    row without its outlier channels: a token whose exact logit rests on that rounding stays a candidate.
    (From a review: with the rest's step the argmax, token 0, was dropped.)"""
    import numpy as np

    ext = _ext()
    k = 64
    np.random.seed(0)
    j = np.random.randint(-127, 128, size=k).astype(np.float64)
    j[1:6] = [127, -127, 127, -127, 127]
    x = j * 2.0**-7  # the rest sits on the one-part grid exactly: its own residual is 0
    x[0] = float(torch.tensor(60 * np.sqrt(np.mean(x[1:] ** 2))).bfloat16().float())  # an outlier channel: 37.5
    assert x[0] == 37.5
    xf = torch.tensor(x, dtype=torch.float32).numpy()
    sh = np.float32(np.abs(xf).max() / np.float32(127))
    sl = np.float32(sh / np.float32(254))
    qh = np.clip(np.rint(xf / sh), -127, 127)
    e = xf.astype(np.float64) - qh * np.float64(sh) - np.clip(np.rint((xf - qh * sh) / sl), -127, 127) * np.float64(sl)
    c0 = np.zeros(k, dtype=np.int64)
    c0[1:] = np.where(e[1:] > 0, -127, 127)
    c0[0] = int(np.clip(-round((x[1:] * c0[1:]).sum() / x[0]), -127, 127))
    rows, scales = [c0], [0.01]
    for t in np.linspace(0.0, 0.072, 200):  # tokens on the outlier channel alone, graded just below token 0
        cb = np.zeros(k, dtype=np.int64)
        cb[0] = 1
        rows.append(cb)
        scales.append(t / 37.5)
    codes = torch.tensor(np.stack(rows), dtype=torch.int8)
    head = Int8Linear(codes, torch.tensor(scales).to(torch.bfloat16), k, codes.shape[0])
    xs = torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).repeat(4, 1)
    want = _exact(head, xs).argmax(dim=1)
    assert want.tolist() == [0, 0, 0, 0]
    assert torch.equal(cpu_decode.greedy_head(head, xs), want)
    # a row the exact kernels cannot split (one channel at ~200x the rest) is not certified at all
    other = _head(512, 64, 22)
    wild = _hidden(4, 64, 21).float()
    wild[:, 5] = 200.0
    w2 = ext.int8_rownorm(other.codes, other.scale)
    cands, ok = ext.int8_greedy_candidates(wild.to(torch.bfloat16), other.codes, other.scale,
                                           ext.int8_rowsum(other.codes), w2, 4096)
    assert not ok and cands.numel() == 0


def test_the_rounding_of_the_one_part_is_bounded_where_the_logits_are_small() -> None:
    """The top logits near zero, where the bound's relative term (2^-8 |logit|) is no help: token 0's codes are
    all zero (logit 0), token 1 has codes +-60 on channels whose one-part rounding residuals r all push its exact
    logit above 0 while its one-part approximation falls below (sum hi sign(r) = -1, sum |r| > the step): only
    the residual term of the bound keeps token 1, the exact argmax, among the candidates."""
    import itertools

    import numpy as np

    k, n = 64, 48
    for seed in range(50):
        g = np.random.default_rng(seed)
        x = torch.tensor(g.standard_normal(k), dtype=torch.float32).to(torch.bfloat16)
        xf = x.float().numpy().astype(np.float64)
        rest = xf.copy()
        rest[np.argsort(-np.abs(xf))[:4]] = 0.0  # the four largest channels are multiplied exactly in float
        sh = np.float32(np.abs(rest).max()) / np.float32(127)
        hi = np.clip(np.rint(rest / sh), -127, 127)
        r = rest - hi * sh
        pool = [i for i in range(k) if rest[i] != 0 and 0.25 * sh < abs(r[i]) < 0.45 * sh]
        for size in (3, 4):
            pick = next((c for c in itertools.combinations(pool, size)
                         if sum(hi[i] * np.sign(r[i]) for i in c) == -1 and sum(abs(r[i]) for i in c) > 1.1 * sh), None)
            if pick is not None:
                break
        if pick is not None:
            break
    assert pick is not None
    codes = torch.zeros(n, k, dtype=torch.int8)
    for i in pick:
        codes[1, i] = 60 * int(np.sign(r[i]))  # 60x: past the bound's float terms (outliers, relative)
    neg = torch.tensor(-np.sign(xf) * 60, dtype=torch.int8)  # the rest: far below zero
    codes[2:] = neg
    head = Int8Linear(codes, torch.full((n,), 0.01, dtype=torch.bfloat16), k, n)
    xs = x.repeat(4, 1)
    full = _exact(head, xs)
    assert full[0, 1] > 0 and full[0, 0] == 0 and (full[0, 2:] < 0).all()
    approx = sum(hi[i] * np.sign(r[i]) for i in pick) * sh * 0.6
    assert approx < 0  # the one-part logit of token 1 is below token 0's
    assert torch.equal(cpu_decode.greedy_head(head, xs), full.argmax(dim=1))
    assert cpu_decode.greedy_head(head, xs).tolist() == [1, 1, 1, 1]


def test_candidates_hold_every_tied_maximum() -> None:
    ext = _ext()
    head = _head(2048, 256, 3, ties=7)
    # rows that favour the duplicated row: a tie of 8 equal maxima
    x = (head.dequantize()[2048 // 3 : 2048 // 3 + 1].repeat(6, 1) * 3 + _hidden(6, 256, 4).float()).to(torch.bfloat16)
    full = _exact(head, x)
    w2 = (head.codes.float().norm(dim=1) * head.scale.float() * (1 + 2**-16)).contiguous()
    rowsum = ext.int8_rowsum(head.codes)
    cands, ok = ext.int8_greedy_candidates(x, head.codes, head.scale, rowsum, w2, 4096)
    assert ok and torch.equal(cands, cands.sort().values) and cands.unique().numel() == cands.numel()
    mine = set(cands.tolist())
    for r in range(6):
        best = set(torch.nonzero(full[r] == full[r].max()).flatten().tolist())
        assert len(best) == 8 and best <= mine
    assert len(mine) < 2048 // 4
    assert not ext.int8_greedy_candidates(x, head.codes, head.scale, rowsum, w2, len(mine) - 1)[1]  # over the limit
    assert torch.equal(cpu_decode.greedy_head(head, x), full.argmax(dim=1))


def test_refuses_where_it_cannot_help(monkeypatch: pytest.MonkeyPatch) -> None:
    head = _head(1024, 64, 5)
    x = _hidden(8, 64, 6)
    assert cpu_decode.greedy_head(head, x[:3]) is None  # few rows: the head is read at memory speed anyway
    if cext.vnni() is None:  # the AVX2 kernels: in the default mode only, up to the rows they take
        assert cpu_decode.greedy_head(head, x, deterministic=True) is None
        many = _hidden(cext.extension().avx2_gemm_rows() + 1, 64, 7)
        assert cpu_decode.greedy_head(head, many) is None
        assert head.__dict__.get("_greedy_stats", [0, 0]) == [0, 0]  # refused before trying
    bad = x.clone()
    bad[2, 5] = float("nan")
    assert cpu_decode.greedy_head(head, bad) is None  # a row the int8 parts cannot carry
    monkeypatch.setattr(cpu_decode, "GREEDY_MAX_CANDIDATES", 0)
    for _ in range(7):
        assert cpu_decode.greedy_head(head, x) is None
    calls, fallbacks = head._greedy_stats
    assert calls == 8 and fallbacks == 8
    monkeypatch.setattr(cpu_decode, "GREEDY_MAX_CANDIDATES", 4096)
    assert cpu_decode.greedy_head(head, x) is None  # given up on: every call fell back
    assert head._greedy_stats[0] == 8


def test_engine_streams_get_the_same_tokens(gemma3_gguf, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma-3's int8 head at 8 greedy streams: the certified path changes no token, and it ran. On the VNNI
    kernels in deterministic mode (whose full logits are those kernels' at any row count), on the AVX2 ones in
    the default mode (deterministic mode keeps torch's kernel for the head there)."""
    vnni = cext.vnni() is not None
    streams = 8
    model = superslm.load(gemma3_gguf)
    ids = model.tokenizer.encode("The river runs through the old town and", add_special_tokens=False)
    reqs = [Request(ids[: 4 + i], 12, Sampling(ignore_eos=True)) for i in range(streams)]
    calls = []
    real = cpu_decode.greedy_head
    monkeypatch.setattr(cpu_decode, "greedy_head", lambda *a: calls.append(1) or real(*a))
    got = [c.tokens for c in model.engine(slots=8, context=64, deterministic=vnni).generate(reqs)]
    assert calls and model.net.head._greedy_stats[1] == 0
    monkeypatch.setattr(cpu_decode, "GREEDY_MIN_ROWS", 10**9)
    calls.clear()
    want = [c.tokens for c in model.engine(slots=8, context=64, deterministic=vnni).generate(reqs)]
    assert not calls and got == want


@pytest.mark.parametrize("k", [128, 120])
def test_a_rotated_head_runs_on_the_int8_kernels(k: int) -> None:
    """A Hadamard-rotated int8 head (superslm convert's default): its input rotated row by row in float
    (hadamard_rows, padded 120 -> 128), then the same kernels; within a rounding of the module's own forward,
    the same bits for a row in any batch, and greedy tokens equal to the argmax of those logits."""
    from superslm.kernels.dispatch import hadamard_rotate_reference

    g = torch.Generator().manual_seed(3)
    head = Int8Linear.from_dense(torch.randn(2001, k, generator=g), rotate=5)
    assert head.rotation is not None and head.k_pad == 128
    x = _hidden(9, k, 4)
    ext = _ext()
    rot = ext.hadamard_rows(x, head.rotation.signs, head.rotation.block, head.k_pad)
    padded = torch.nn.functional.pad(x.float(), (0, head.k_pad - k))
    want_rot = hadamard_rotate_reference(padded.double(), head.rotation.signs.double(), head.rotation.block)
    assert rot.dtype == torch.bfloat16
    torch.testing.assert_close(rot.double(), want_rot, atol=0, rtol=2**-8)  # one bf16 rounding
    vnni = cext.vnni() is not None
    one = torch.cat([cpu_decode.vnni_linear(head, x[i : i + 1]) for i in range(9)])
    many = cpu_decode.vnni_linear(head, x, deterministic=vnni)  # AVX2: the default mode's row kernel
    assert torch.equal(one, many)  # row by row: batch-invariant
    ref = head(x).float()
    assert (one.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
    if vnni:
        logits = ext.int8_gemm(rot, head.codes, head.scale, ext.int8_rowsum(head.codes)).float()
    else:
        logits = ext.int8_gemm_avx2(rot, head.codes, head.scale).float()
    assert torch.equal(one.float(), logits.to(torch.bfloat16).float())
    got = cpu_decode.greedy_head(head, x)
    assert got is not None and torch.equal(got, logits.argmax(dim=1))


def test_a_head_wider_than_the_greedy_kernel_takes_the_full_logits() -> None:
    """Hidden sizes past 1024 (Qwen2.5-1.5B: 1536, Gemma-3-1B: 1152): no certified tokens, no error."""
    for rotate in (None, 5):
        head = Int8Linear.from_dense(torch.randn(300, 1152), rotate=rotate)
        assert cpu_decode.greedy_head(head, _hidden(4, 1152, 1)) is None
        assert cpu_decode.vnni_linear(head, _hidden(1, 1152, 1)) is not None
