"""GGUF Q8_0 weights as they are (quant/q80.py, kernels/cpu/q80.cpp): the file's values bit for bit (random blocks
and gguf-py's own quantizer), the kernels against their torch twin and a float64 reference, each row's bits whatever
rows come with it, the module's fallbacks, and the mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import Q6_K, Q8_0
from superslm.quant import load_linear
from superslm.quant.dense import Int8Linear
from superslm.quant.gguf_map import linear_from_gguf, nearest_format, q80_runs
from superslm.quant.q80 import GEMV_ROWS, GGUFQ80Linear, q80_dequantize, q80_gemv, q80_kernels, q80_matmul, q80_params
from tests.test_iq4 import gemv_tol

U = 2.0**-8


def q80_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a weight [n, k]: every code (-128 too, which ggml never writes), finite f16 d of many
    sizes."""
    rng = np.random.default_rng(seed)
    m = n * k // 32
    raw = rng.integers(0, 256, (m, 34), dtype=np.uint8)
    d = (rng.standard_normal((m, 1)) * 10.0 ** rng.integers(-5, 0, (m, 1))).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8)
    return raw.reshape(-1)


def needs_kernels() -> None:
    if q80_kernels() is None:
        pytest.skip("no C++ Q8_0 kernels here")


def test_the_weight_is_the_files_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 70, 320
    raw = q80_blocks(n, k, seed=1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    ref = quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q8_0).reshape(n, k)
    monkeypatch.setattr("superslm.quant.q80.ROWS", 16)  # rows copied in blocks, the file's pages released between
    released = []
    m = GGUFQ80Linear.from_gguf_parts([(raw, Q8_0, (n, k), perm)], release=lambda: released.append(1))
    assert len(released) == 5
    assert "Q8_0" in m.describe() and m.nbytes() == n * k + n * k // 16  # the file's 34 bytes a block
    got = m.dequantize().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(ref[perm.numpy()]).view(np.uint32))
    # gguf-py's quantizer (ggml's Q8_0 rounding) read back as its own dequantizer reads it
    w = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
    q = quants.quantize(w, GGMLQuantizationType.Q8_0)
    codes, d = q80_params(q.reshape(-1), Q8_0, (n, k))
    mine = q80_dequantize(codes, d).numpy()
    np.testing.assert_array_equal(mine, quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(n, k))
    ext = cext.extension()
    if ext is not None and ext.q80_available():
        again = ext.q80_dequantize(m.codes, m.d).numpy()
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))
    with pytest.raises(InvalidArgument):
        GGUFQ80Linear.from_gguf(raw, Q6_K, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFQ80Linear.from_gguf(raw[:-34], Q8_0, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFQ80Linear.from_gguf(raw, Q8_0, (n, k), row_perm=torch.zeros(n, dtype=torch.long))
    with pytest.raises(InvalidArgument):
        GGUFQ80Linear(m.codes, m.d.float(), k, n)


@pytest.mark.parametrize("shape", [(37, 96), (100, 640), (67, 1056)])  # 3, 20 and 33 groups; N not a multiple of 4
def test_kernels_against_their_twin_and_the_weight(shape) -> None:
    needs_kernels()
    ext = cext.extension()
    n, k = shape
    m = GGUFQ80Linear.from_gguf(q80_blocks(n, k, seed=n), Q8_0, shape)
    c, d = m.codes, m.d
    assert (c == -128).any()  # maddubs' unsigned operand is |code|: 128 is taken right
    w = q80_dequantize(c, d)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=g).bfloat16()
    x[:, :32] *= 50  # a group far larger than the others: each group gets its own int8 step
    ref = x.double() @ w.double().t()
    # float32 sums of k terms (k 2^-24 of sum |w x| at most), then the bf16 rounding of the output
    float_tol = U * ref.abs() + 1.01 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    twin = q80_matmul(x, c, d).double()
    assert ((twin - ref).abs() <= float_tol).all()
    gemm = ext.q80_gemm(x, c, d, False)
    assert gemm.dtype == torch.bfloat16 and gemm.shape == (9, n)
    assert ((gemm.double() - ref).abs() <= float_tol).all()
    # deterministic mode's GEMM: each row the bits of 16-row products, whatever the rows beside it
    det = ext.q80_gemm(x, c, d, True)
    for r in (0, 8):
        assert torch.equal(ext.q80_gemm(x[r : r + 1], c, d, True).view(torch.int16), det[r : r + 1].view(torch.int16))
    alone = torch.cat([ext.q80_gemv(x[r : r + 1], c, d) for r in range(9)])
    assert torch.equal(alone.view(torch.int16), q80_gemv(x, c, d).view(torch.int16))
    for r in range(9):
        assert ((alone[r].double() - ref[r]).abs() <= gemv_tol(x[r : r + 1], w, ref[r])).all()
    for rows in (2, 3, 4, 5, 9):  # tiles of 1 to 4 rows of x: each row the bits it gets alone
        y = ext.q80_gemv(x[:rows], c, d)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        assert torch.equal(y.view(torch.int16), alone[:rows].view(torch.int16))
    odd = torch.randn(4, k, generator=g).bfloat16()
    odd[0, 1] = float("nan")
    odd[1, 5] = float("inf")  # no int8 step for it: the GEMV takes the float32 product for that row
    odd[2, 5] = 3e4  # an outlier: its own group's step is coarse, the other groups keep theirs
    odd[2, 40:72] = 0  # an all-zero group
    y = ext.q80_gemv(odd, c, d)
    assert torch.isnan(y[0]).all()
    assert torch.equal(y[1:2].view(torch.int16), ext.q80_gemm(odd[1:2], c, d, False).view(torch.int16))
    torch.testing.assert_close(y[1:2], q80_gemv(odd[1:2], c, d), rtol=0, atol=0, equal_nan=True)  # inf - inf: NaN
    assert torch.equal(y[2:].view(torch.int16), q80_gemv(odd[2:], c, d).view(torch.int16))
    assert torch.equal(y[3:].view(torch.int16), ext.q80_gemv(odd[3:], c, d).view(torch.int16))
    ref = (odd[2:3].double() @ w.double().t())[0]
    assert ((y[2].double() - ref).abs() <= gemv_tol(odd[2:3], w, ref)).all()
    with pytest.raises(RuntimeError, match="d float16"):
        ext.q80_gemv(odd, c, d.float())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.q80_gemv(odd[:, :48], c[:, :48], d[:, :1])


def test_ggml_quantized_weights_err_as_int8_x_allows() -> None:
    """ggml's own Q8_0 blocks of a Gaussian weight: the GEMV's output error against the float64 product with the
    file's weights is x's int8 rounding (well under 1% of the outputs' rms here), the weights themselves exact."""
    needs_kernels()
    n, k = 512, 640
    rng = np.random.default_rng(5)
    q = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q8_0)
    m = GGUFQ80Linear.from_gguf(q.reshape(-1), Q8_0, (n, k))
    w = m.dequantize().double()
    x = torch.from_numpy(rng.standard_normal((4, k)).astype(np.float32)).bfloat16()
    ref = x.double() @ w.t()
    y = m(x).double()
    assert ((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item() < 0.01


def test_module_maps_runs_saves_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 96, 512
    raw_q = q80_blocks(n, k, seed=1)
    raw_k = q80_blocks(32, k, seed=2)
    bias = torch.randn(n + 32)
    gq80 = {"Q8_0": ("gq80", {})}
    assert nearest_format(Q8_0) == ("int8", {})  # the default: int8 per channel (faster at one row here)
    assert isinstance(linear_from_gguf([(raw_q, Q8_0, (n, k), None)]), Int8Linear)
    if not q80_runs():
        assert isinstance(linear_from_gguf([(raw_q, Q8_0, (n, k), None)], mapping=gq80), Int8Linear)
        return
    assert nearest_format(Q8_0, gq80) == ("gq80", {})
    with pytest.raises(InvalidArgument):
        nearest_format(Q6_K, {"Q6_K": ("gq80", {})})
    m = linear_from_gguf([(raw_q, Q8_0, (n, k), None), (raw_k, Q8_0, (32, k), None)], bias, gq80)
    assert isinstance(m, GGUFQ80Linear) and m.out_features == n + 32
    w = m.dequantize()
    x = torch.randn(GEMV_ROWS + 4, k).bfloat16()
    xw = x.double() @ w.double().t()
    ref = xw + bias.double()
    for rows in (1, 4, GEMV_ROWS, GEMV_ROWS + 4):  # the GEMV up to GEMV_ROWS rows, the float32 GEMM past them
        y = m(x[:rows])
        assert y.dtype == torch.bfloat16
        r, p = ref[:rows], xw[:rows]
        floats = 1.01 * k * 2.0**-24 * (x[:rows].double().abs() @ w.double().abs().t())
        if rows <= GEMV_ROWS:
            slack = torch.stack([gemv_tol(x[i : i + 1], w, p[i]) for i in range(rows)])
        else:
            slack = floats
        assert ((y.double() - r).abs() <= U * (p.abs() + r.abs()) + (1 + U) * slack).all()
    # deterministic mode: 16-row float32 products at every row count, the C++ plan's bits (q80_gemm rows16)
    det = m.forward_row_blocks(x)
    assert torch.equal(det[:3], m.forward_row_blocks(x[:3]))
    want = (cext.extension().q80_gemm(x, m.codes, m.d, True).float() + m.bias).bfloat16()
    assert torch.equal(det.view(torch.int16), want.view(torch.int16))
    m.to(torch.bfloat16)  # .to(bf16) on a model keeps the file's f16 d
    assert m.d.dtype == torch.float16 and torch.equal(m.dequantize(), w)
    tensors, meta = m.to_tensors()
    again = load_linear(tensors, meta)
    assert isinstance(again, GGUFQ80Linear) and torch.equal(again.dequantize(), w)
    assert torch.equal(again(x), m(x))
    # no kernels (a folder read on another machine): a bf16 dense copy, each weight rounded once
    monkeypatch.setattr("superslm.quant.q80.q80_kernels", lambda: None)
    assert again.plan_args() is None
    y = again(x).double()
    assert ((y - ref).abs() <= U * (x.double().abs() @ w.double().abs().t() + xw.abs() + ref.abs())).all()
    monkeypatch.undo()
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    assert isinstance(linear_from_gguf([(raw_q, Q8_0, (n, k), None)]), Int8Linear)
