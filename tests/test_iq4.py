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
from superslm.quant.iq4 import TABLE, GGUFIQ4Linear, iq4_dequantize, iq4_matmul

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
    """sum over groups of 32 of max|x| over the group times sum |w| over it: what the int8 parts' rounding
    (at most max|x| / 64516 an element) can move a product by, times 64516."""
    m, k = x.shape
    xmax = x.double().abs().view(m, k // 32, 32).amax(-1)  # [M, groups]
    wsum = w.double().abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, groups]
    return xmax @ wsum.t()


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
    assert block.name in m.describe() and m.nbytes() == n * k // 2 + n * k // 8 + 16
    got = m.dequantize().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(ref[perm.numpy()]).view(np.uint32))
    ext = cext.extension()
    if ext is not None:
        again = ext.iq4_dequantize(m.qweight, m.scales, m.table).numpy()
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))
    with pytest.raises(InvalidArgument):
        GGUFIQ4Linear.from_gguf(raw, Q4_K, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFIQ4Linear.from_gguf(raw[:-1], block, (n, k))


@pytest.mark.parametrize("shape", [(64, 64), (100, 640), (387, 1024)])
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
            y = ext.iq4_gemv(x[r : r + 1], q, s, t).double()
            # the output's bf16 rounding, and the int8 parts' (max|x| / 64516 an element, per group)
            tol = U * ref[r].abs() + group_bound(x[r : r + 1], w)[0] / 32258 + 1e-6
            assert ((y[0] - ref[r]).abs() <= tol).all()
            assert ((y[0] - twin[r]).abs() <= tol + U * twin[r].abs()).all()
    odd = torch.randn(2, k, generator=g).bfloat16()
    odd[0, 1] = float("nan")
    odd[1, 5] = 3e4  # an outlier the int8 parts cannot carry: the GEMV takes the float32 product
    assert torch.isnan(ext.iq4_gemv(odd[:1], q, s, t)).all()
    y = ext.iq4_gemv(odd[1:], q, s, t)
    assert torch.equal(y, ext.iq4_gemm(odd[1:], q, s, t, False))
    with pytest.raises(RuntimeError, match="scales float32"):
        ext.iq4_gemv(odd[1:], q, s.bfloat16(), t)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.iq4_gemv(odd[1:, :48], q[:, :24], s[:, :1], t)


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
        # x w rounded to bf16, the bias added in float, rounded again; the int8 parts' rounding (one row)
        r, p = ref[: len(rows)], xw[: len(rows)]
        assert ((y.double() - r).abs() <= U * (p.abs() + r.abs()) + group_bound(rows, w) / 32258 + 1e-6).all()
    # .to(bf16) on a model keeps the scales exact
    m.to(torch.bfloat16)
    assert m.scales.dtype == torch.float32 and torch.equal(m.dequantize(), w)
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
