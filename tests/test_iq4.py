"""GGUF IQ4_NL / IQ4_XS weights as they are (quant/iq4.py, kernels/cpu/iq4.cpp): the file's values bit for bit,
the kernels against their torch twin and a float64 reference, the module's fallbacks, and the mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import _IQ4_VALUES, IQ4_NL, IQ4_XS, Q4_K
from superslm.quant import load_linear
from superslm.quant.dense import Int8Linear
from superslm.quant.gguf_map import iq4_runs, linear_from_gguf
from superslm.quant.iq4 import (
    TABLE,
    GGUFIQ4Linear,
    _fma32,
    group_scales,
    iq4_dequantize,
    iq4_gemv,
    iq4_matmul,
    iq4_split_reference,
    quantize_groups,
)

U = 2.0**-8


def iq4_blocks(block: type, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a weight [n, k]: every code and sub-scale bit pattern, finite f16 d of many sizes."""
    rng = np.random.default_rng(seed)
    m = n * k // block.block_size
    raw = rng.integers(0, 256, (m, block.type_size), dtype=np.uint8)
    d = (rng.standard_normal((m, 1)) * 10.0 ** rng.integers(-5, 0, (m, 1))).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8)
    return raw.reshape(-1)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """w float32 [n, k] -> IQ4_NL bytes: per 32 values d = (the value of largest magnitude) / -127, each code the
    table's nearest value (ggml's first guess, without its scale search)."""
    g = w.reshape(-1, 32)
    big = g[np.arange(len(g)), np.abs(g).argmax(1)]
    d = (big / _IQ4_VALUES[0]).astype(np.float16)
    inv = np.where(d != 0, 1 / d.astype(np.float32), 0)
    codes = np.abs(g[..., None] * inv[:, None, None] - _IQ4_VALUES).argmin(-1).astype(np.uint8)  # [blocks, 32]
    out = np.empty((len(g), 18), dtype=np.uint8)
    out[:, :2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out.reshape(-1)


def group_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over groups of 32 of max|x| over the group times sum |w| over it [M, N]: the GEMV's int8 x moves an
    element by at most max|x| / 254 (half its step max|x| / 127), so a product by at most this / 254."""
    m, k = x.shape
    xmax = x.double().abs().view(m, k // 32, 32).amax(-1)  # [M, groups]
    wsum = w.double().abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, groups]
    return xmax @ wsum.t()


def gemv_tol(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """How far the GEMV of one row x [1, K] may be from the float64 product ref [N]: x's int8 rounding, float32
    sums of k / 32 + 3 terms (each scale * dx rounded once, one fma a group, the lanes' reduction), and the
    output's bf16 rounding of all that."""
    k = x.shape[1]
    act = group_bound(x, w)[0] / 254
    floats = 1.01 * (k // 32 + 4) * 2.0**-24 * ((x.double().abs() + 1e-30) @ w.double().abs().t())[0] * (1 + 1 / 127)
    return U * (ref.abs() + act + floats) + act + floats


def hostile_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """rows x [rows, K] bf16 (rows >= 8) whose first group is 50x the others in every row, and rows the kernels
    must treat apart: 3 a NaN, 4 an inf, 5 all zero, 6 an all-zero group, 7 an outlier (3e4)."""
    x = torch.randn(rows, k, generator=g).bfloat16()
    x[:, :32] *= 50  # a group far larger than the others: each group gets its own int8 step
    x[3, 7] = float("nan")
    x[4, 9] = float("inf")
    x[5] = 0
    x[6, 32:64] = 0
    x[7, 1] = 3e4
    return x


def needs_kernels() -> None:
    if not iq4_runs():
        pytest.skip("no C++ IQ4 kernels here: IQ4 becomes int8")


@pytest.mark.parametrize("block", [IQ4_NL, IQ4_XS])
def test_the_weight_is_the_files_bit_for_bit(block: type) -> None:
    n, k = 70, 512
    raw = iq4_blocks(block, n, k, seed=block.type_id)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    ref = quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType[block.name]).reshape(n, k)
    m = GGUFIQ4Linear.from_gguf(raw, block, (n, k), row_perm=perm)
    # scales: IQ4_NL's float32 a group, IQ4_XS's packed (a float32 d a block of 256, an int8 ls - 32 a group)
    scale_bytes = n * k // 8 if block is IQ4_NL else n * (k // 64 + k // 32)
    assert block.name in m.describe() and m.nbytes() == n * k // 2 + scale_bytes + 16
    got = m.dequantize().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(ref[perm.numpy()]).view(np.uint32))
    ext = cext.extension()
    if ext is not None:
        again = ext.iq4_dequantize(m.qweight, m.scales, m.table).numpy()
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))
    if block is IQ4_XS and ext is not None and iq4_runs():
        # the packed scales give every kernel the bits of the same scales as floats (d * (ls - 32) is exact)
        flat = GGUFIQ4Linear(m.qweight, group_scales(m.scales, k), k, n, table=m.table)
        assert flat.scales.dtype == torch.float32 and m.scales.dtype == torch.uint8
        assert m.nbytes() < flat.nbytes()
        x = torch.randn(200, k, generator=torch.Generator().manual_seed(3)).bfloat16()
        for rows in (1, 5, 200):
            for det in (False, True):
                a = ext.iq4_linear(x[:rows], m.qweight, m.scales, m.table, det)
                b = ext.iq4_linear(x[:rows], flat.qweight, flat.scales, flat.table, det)
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (rows, det)
        assert torch.equal(ext.iq4_gemm(x, m.qweight, m.scales, m.table, False),
                           ext.iq4_gemm(x, flat.qweight, flat.scales, flat.table, False))
        with pytest.raises(RuntimeError, match="packed"):
            ext.iq4_gemv(x[:1], m.qweight, m.scales[:, :-1].contiguous(), m.table)
    with pytest.raises(InvalidArgument):
        GGUFIQ4Linear(m.qweight, m.scales[:, :-1], k, n)
    with pytest.raises(InvalidArgument):
        GGUFIQ4Linear.from_gguf(raw, Q4_K, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFIQ4Linear.from_gguf(raw[:-1], block, (n, k))


@pytest.mark.parametrize("shape", [(64, 96), (100, 640), (387, 1056)])  # 3, 20 and 33 groups
def test_kernels_against_their_twin_and_the_weight(shape) -> None:
    needs_kernels()
    ext = cext.extension()
    n, k = shape
    raw = iq4_blocks(IQ4_NL, n, k, seed=n)
    m = GGUFIQ4Linear.from_gguf(raw, IQ4_NL, shape)
    q, s, t = m.qweight, m.scales, m.table
    w = iq4_dequantize(q, s, t)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 3, 40):
        x = torch.randn(rows, k, generator=g).bfloat16()
        x[:, :32] *= 50  # a group far larger than the others: each group gets its own int8 parts
        ref = x.double() @ w.double().t()
        # float32 sums of k terms (k 2^-24 of sum |w x| at most), then the bf16 rounding of the output
        float_tol = U * ref.abs() + 1.01 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        twin = iq4_matmul(x, q, s, t).double()
        assert ((twin - ref).abs() <= float_tol).all()
        gemm = ext.iq4_gemm(x, q, s, t, False)
        assert gemm.dtype == torch.bfloat16 and gemm.shape == (rows, n)
        assert ((gemm.double() - ref).abs() <= float_tol).all()
        # deterministic mode's GEMM: each row the bits of 16-row products, whatever the rows beside it
        det = ext.iq4_gemm(x, q, s, t, True)
        for r in (0, rows - 1):
            alone = ext.iq4_gemm(x[r : r + 1], q, s, t, True)
            assert torch.equal(alone.view(torch.int16), det[r : r + 1].view(torch.int16))
        for r in range(rows):
            y = ext.iq4_gemv(x[r : r + 1], q, s, t)
            assert y.dtype == torch.bfloat16 and y.shape == (1, n)
            assert torch.equal(y.view(torch.int16), iq4_gemv(x[r : r + 1], q, s, t).view(torch.int16))
            assert ((y[0].double() - ref[r]).abs() <= gemv_tol(x[r : r + 1], w, ref[r])).all()
    odd = torch.randn(3, k, generator=g).bfloat16()
    odd[0, 1] = float("nan")
    odd[1, 5] = float("inf")  # no int8 step for it: the GEMV takes the float32 product
    odd[2, 5] = 3e4  # an outlier: its own group's step is coarse, the other groups keep theirs
    odd[2, 40:72] = 0  # an all-zero group
    assert torch.isnan(ext.iq4_gemv(odd[:1], q, s, t)).all()
    y = ext.iq4_gemv(odd[1:2], q, s, t)
    assert torch.equal(y, ext.iq4_gemm(odd[1:2], q, s, t, False))
    assert torch.equal(y, iq4_gemv(odd[1:2], q, s, t))
    y = ext.iq4_gemv(odd[2:], q, s, t)
    assert torch.equal(y.view(torch.int16), iq4_gemv(odd[2:], q, s, t).view(torch.int16))
    ref = (odd[2:].double() @ w.double().t())[0]
    assert ((y[0].double() - ref).abs() <= gemv_tol(odd[2:], w, ref)).all()
    with pytest.raises(RuntimeError, match="scales float32"):
        ext.iq4_gemv(odd[1:2], q, s.bfloat16(), t)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.iq4_gemv(odd[1:2, :48], q[:, :24], s[:, :1], t)


@pytest.mark.parametrize("shape", [(70, 96), (37, 1056), (130, 2048)])  # 3, 33 and 64 groups
def test_rows_kernel_gives_each_row_its_gemv_bits(shape) -> None:
    """Several rows share each unpacked block of codes (kernels/cpu/iq4.cpp rows_kernel), yet each row's output is
    bit for bit its one-row GEMV's and the twin's, whatever the row count, its place among the rows, the rows
    beside it (a NaN, an inf, an all-zero row or group, an outlier) and the threads that ran it."""
    needs_kernels()
    ext = cext.extension()
    n, k = shape
    block = IQ4_XS if k % 256 == 0 else IQ4_NL  # XS: the packed scales
    m = GGUFIQ4Linear.from_gguf(iq4_blocks(block, n, k, seed=k), block, shape)
    q, s, t = m.qweight, m.scales, m.table
    x = hostile_rows(45, k, torch.Generator().manual_seed(n))
    alone = torch.cat([ext.iq4_gemv(x[r : r + 1], q, s, t) for r in range(len(x))])
    assert torch.isnan(alone[3]).all()
    assert torch.equal(alone[4:5].view(torch.int16), ext.iq4_gemm(x[4:5], q, s, t, False).view(torch.int16))
    for r in (0, 4, 6, 7, len(x) - 1):
        assert torch.equal(alone[r : r + 1].view(torch.int16), iq4_gemv(x[r : r + 1], q, s, t).view(torch.int16)), r
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            for lo, hi in ((0, 2), (0, 7), (1, 14), (8, 45), (0, 45)):
                got = ext.iq4_gemv(x[lo:hi], q, s, t)
                assert got.shape == (hi - lo, n) and got.dtype == torch.bfloat16
                assert torch.equal(got.view(torch.int16), alone[lo:hi].view(torch.int16)), (nt, lo, hi)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(iq4_gemv(x[5:8], q, s, t).view(torch.int16), alone[5:8].view(torch.int16))
    assert ext.iq4_gemv(x[:0], q, s, t).shape == (0, n)
    # a table the sign trick cannot take (-128): every row the float32 product alone
    bad = t.clone()
    bad[0] = -128
    got = ext.iq4_gemv(x[8:11], q, s, bad)
    assert torch.equal(got, torch.cat([ext.iq4_gemm(x[r : r + 1], q, s, bad, False) for r in range(8, 11)]))
    assert torch.equal(got, iq4_gemv(x[8:11], q, s, bad))


@pytest.mark.parametrize("shape", [(70, 96), (37, 1056), (130, 2048)])  # 3, 33 and 64 groups; N % 32 != 0
def test_prompt_kernel_against_its_twin_and_the_weight(avx2_only, shape) -> None:
    """Prompt chunks on CPUs without VNNI (kernels/cpu/avx2_rows.cpp iq4_gemm_avx2): x split per group into two
    int8 parts, exact int32 sums of the table values. Bit for bit its twin; within the split's rounding (half a
    step of max|x| / (127 * 254) an element) and float32 sums of the exact product; a row's bits the same whatever
    the rows beside it and the threads; rows it cannot split (a NaN, an inf, an outlier) through iq4_gemm."""
    ext = avx2_only
    n, k = shape
    block = IQ4_XS if k % 256 == 0 else IQ4_NL  # XS: the packed scales
    m = GGUFIQ4Linear.from_gguf(iq4_blocks(block, n, k, seed=k + 1), block, shape)
    q, s, t = m.qweight, m.scales, m.table
    w = iq4_dequantize(q, s, t)
    x = hostile_rows(40, k, torch.Generator().manual_seed(n + 1))  # the split declines rows 3, 4 and 7
    got = ext.iq4_gemm_avx2(x, q, s, t)
    assert got.shape == (40, n) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), iq4_split_reference(x, q, s, t).view(torch.int16))
    declined = [3, 4, 7]
    assert torch.equal(got[declined].view(torch.int16), ext.iq4_gemm(x[declined], q, s, t, False).view(torch.int16))
    good = [r for r in range(40) if r not in declined]
    ref = x[good].double() @ w.double().t()
    split = group_bound(x[good], w) / (127 * 254 * 2)
    floats = 1.01 * (k // 32 + 2) * 2.0**-24 * (x[good].double().abs() @ w.double().abs().t() + split)
    assert ((got[good].double() - ref).abs() <= U * ref.abs() + (1 + U) * (split + floats)).all()
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            for lo, hi in ((0, 1), (2, 9), (8, 40)):
                again = ext.iq4_gemm_avx2(x[lo:hi], q, s, t)
                assert torch.equal(again.view(torch.int16), got[lo:hi].view(torch.int16)), (nt, lo, hi)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="scales float32"):
        ext.iq4_gemm_avx2(x, q, s.bfloat16(), t)


def test_rows_kernel_in_the_module_and_deterministic_mode(avx2_only) -> None:
    """The module takes the rows kernel up to `iq4_gemv_rows` rows (each row its GEMV's bits), past them the
    prompt kernel (`iq4_linear`'s choice: the two-part AVX2 kernel on CPUs without VNNI, as here); deterministic
    mode (`forward_row_blocks`) the rows kernel at every row count, so a row's bits are the same alone or among any
    number of rows."""
    ext = avx2_only
    n, k = 64, 512
    m = GGUFIQ4Linear.from_gguf(iq4_blocks(IQ4_XS, n, k, seed=5), IQ4_XS, (n, k))
    limit = ext.iq4_gemv_rows(k, n)
    x = torch.randn(limit + 3, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    alone = torch.cat([ext.iq4_gemv(x[r : r + 1], m.qweight, m.scales, m.table) for r in range(len(x))])
    assert torch.equal(m(x[:5]), alone[:5])
    assert torch.equal(m(x[:limit]), alone[:limit])
    assert torch.equal(m(x), ext.iq4_gemm_avx2(x, m.qweight, m.scales, m.table))
    assert torch.equal(ext.iq4_linear(x, m.qweight, m.scales, m.table, False), m(x))
    assert torch.equal(ext.iq4_linear(x, m.qweight, m.scales, m.table, True), alone)
    assert m._tiles_rows(x)
    for rows in (1, 15, 17, len(x)):
        assert torch.equal(m.forward_row_blocks(x[:rows]), alone[:rows]), rows


def test_gemv_twin_rounds_as_the_kernel() -> None:
    """The twin's int8 x is llama.cpp's Q8_0 rounding (ties to even, |q| <= 127), and its fma rounds once."""
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5, -2.5] + [0.0] * 27 + [0.0] * 32])
    q, dx = quantize_groups(x)
    assert dx.tolist() == [1.0, 0.0] and q[0, :5].tolist() == [127, -64, 0, 2, -2] and not q[1].any()
    # the twin's fma against exact rational arithmetic, on random operands and on sums that land halfway between
    # two floats once rounded to float64 (where a product then a sum in float64 would round twice)
    from fractions import Fraction

    rng = np.random.default_rng(0)
    a = rng.integers(-64516, 64516, 400).astype(np.float32)
    b = (rng.standard_normal(400) * 1e-3).astype(np.float32)
    c = (rng.standard_normal(400) * 10.0 ** rng.integers(-6, 2, 400)).astype(np.float32)
    # halfway cases: odd products of odd integers in [2^24, 2^25) lie halfway between two floats (2 apart), and
    # c = +-2^-30 is lost when the sum is rounded to float64 first; 4097 * 4099 ties up to even, 4097 * 4101 down
    a[:4] = [4097, 4097, 4097, 4097]
    b[:4] = [4099, 4099, 4101, 4101]
    c[:4] = [2.0**-30, -(2.0**-30), 2.0**-30, -(2.0**-30)]
    got = _fma32(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)).numpy()
    for ai, bi, ci, gi in zip(a, b, c, got):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        near = np.float32(float(exact))
        cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
        dist = [abs(Fraction(float(v)) - exact) for v in cands]
        best = min(dist)
        ties = [v for v, d in zip(cands, dist) if d == best]
        want = ties[0] if len(ties) == 1 else next(v for v in ties if not (v.view(np.uint32) & 1))
        assert gi.view(np.uint32) == want.view(np.uint32), (ai, bi, ci, gi, want)


@pytest.mark.parametrize("block", [IQ4_NL, IQ4_XS])
def test_module_maps_runs_saves_and_falls_back(block: type, monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 96, 512
    raw_q = iq4_blocks(block, n, k, seed=1)
    raw_k = iq4_blocks(block, 32, k, seed=2)
    bias = torch.randn(n + 32)
    if not iq4_runs():
        assert isinstance(linear_from_gguf([(raw_q, block, (n, k), None)]), Int8Linear)
        return
    m = linear_from_gguf([(raw_q, block, (n, k), None), (raw_k, block, (32, k), None)], bias)
    assert isinstance(m, GGUFIQ4Linear) and m.out_features == n + 32
    w = m.dequantize()
    x = torch.randn(5, k).bfloat16()
    xw = x.double() @ w.double().t()
    ref = xw + bias.double()
    for rows in (x[:1], x):
        y = m(rows)
        assert y.dtype == torch.bfloat16
        # x w rounded to bf16 (one row: x's int8 rounding too, gemv_tol), the bias added in float, rounded again
        r, p = ref[: len(rows)], xw[: len(rows)]
        floats = 1.01 * k * 2.0**-24 * (rows.double().abs() @ w.double().abs().t())
        # the rows kernel: each row the GEMV's (x's int8 rounding)
        for i in range(len(rows)):
            slack = gemv_tol(rows[i : i + 1], w, p[i]) + floats[i]
            assert ((y[i].double() - r[i]).abs() <= U * (p[i].abs() + r[i].abs()) + (1 + U) * slack).all()
    # .to(bf16) on a model keeps the scales exact
    kept = m.scales.dtype
    m.to(torch.bfloat16)
    assert m.scales.dtype == kept == (torch.float32 if block is IQ4_NL else torch.uint8)
    assert torch.equal(m.dequantize(), w)
    tensors, meta = m.to_tensors()
    again = load_linear(tensors, meta)
    assert isinstance(again, GGUFIQ4Linear) and torch.equal(again.dequantize(), w)
    assert torch.equal(again(x), m(x))
    # no kernels (a folder read on another machine): a bf16 dense copy, each weight rounded once
    monkeypatch.setattr("superslm.quant.iq4.iq4_kernels", lambda: None)
    assert again.plan_args() is None
    y = again(x).double()
    assert ((y - ref).abs() <= U * (x.double().abs() @ w.double().abs().t() + xw.abs() + ref.abs())).all()
    assert (y - ref).abs().max() < 0.1 * ref.abs().max()
    monkeypatch.undo()
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    assert isinstance(linear_from_gguf([(raw_q, block, (n, k), None)]), Int8Linear)


def test_table_is_ggmls() -> None:
    assert TABLE.tolist() == [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    raw = quantize_iq4_nl(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    w = quants.dequantize(raw.reshape(4, -1), GGMLQuantizationType.IQ4_NL)
    assert np.corrcoef(w.reshape(-1), np.random.default_rng(0).standard_normal((4, 64)).reshape(-1))[0, 1] > 0.98
