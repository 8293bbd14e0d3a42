"""The C++ CPU kernels called one at a time (kernels/cpu/gemv.cpp, gemm.cpp, avx2*.cpp): the VNNI int4 and int8 GEMVs
and GEMMs against torch's kernels, every row's bits alone or batched, and the arguments they refuse. The decode plan
that runs them layer by layer is tests/test_cpu_decode.py's."""

from __future__ import annotations

import pytest
import torch

from superslm.kernels import cpu_decode


@pytest.mark.parametrize("shape", [(300, 64), (4099, 576), (1001, 640), (64, 40)])
def test_vnni_int8_gemv_equals_torch_kernel(shape) -> None:
    from superslm.quant.dense import Int8Linear

    n, k = shape
    g = torch.Generator().manual_seed(n)
    m = Int8Linear.from_dense(torch.randn(n, k, generator=g))
    x = (torch.randn(1, k, generator=g) * torch.rand(1, k, generator=g) ** 4).to(torch.bfloat16)  # wide range
    want = _torch_int8(m, x)
    got = cpu_decode.vnni_linear(m, x)
    ext = cpu_decode.extension()
    # without VNNI the AVX2 GEMV (tests/test_cpu_avx2.py) runs one row, with the same arithmetic
    if not (ext.vnni_available() or ext.avx2_available()) or m.k_pad % 64 or m.k_pad != k:
        assert got is None
        return
    assert got is not None and got.dtype == torch.bfloat16
    assert torch.equal(ext.int8_rowsum(m.codes), m.codes.sum(1, dtype=torch.int32))
    # two int8 parts carry x to ~1/64516 of its largest element: the result is within bf16 rounding
    assert ((got.float() - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all()
    zero = cpu_decode.vnni_linear(m, torch.zeros_like(x))  # AVX2: None, torch's kernel takes an all-zero row
    assert torch.equal(zero.float(), torch.zeros(1, n)) if ext.vnni_available() else zero is None
    two = cpu_decode.vnni_linear(m, x.repeat(2, 1))  # VNNI: torch's kernel, or ours where faster (gemm_rows)
    if not ext.vnni_available():  # AVX2: the row kernel (kernels/cpu/avx2_rows.cpp), each row the GEMV's bits
        assert two is not None and torch.equal(two[1:], got)
    else:
        assert two is None if ext.gemm_rows(True) > 2 else torch.equal(two[1:], got)


def _torch_int8(m, x: torch.Tensor) -> torch.Tensor:
    """torch's packed int8 kernel on an unrotated Int8Linear, float32."""
    assert m.rotation is None
    x = torch.nn.functional.pad(x, (0, m.k_pad - x.shape[1]))
    y = torch.ops.aten._weight_int8pack_mm(x, m.codes, m.scale).float()
    return y if m.bias is None else y + m.bias.float()


@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (960, 576, 32), (192, 512, 64), (128, 256, 128), (64, 512, 256)])
def test_vnni_int4_gemv_equals_torch_kernel(n: int, k: int, group: int) -> None:
    from superslm.quant.int4 import Int4Linear

    ext = cpu_decode.extension()
    g = torch.Generator().manual_seed(k + group)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g), group=group)
    x = (torch.randn(1, m.k_pad, generator=g) * torch.rand(1, m.k_pad, generator=g) ** 4).to(torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, group, m.scales_zeros).float()
    got = ext.int4_gemv(x, m.qweight, m.scales_zeros, group)
    if not ext.vnni_available():
        assert got is None
        return
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # every row of the 64-row blocks lands where torch puts it, within bf16 rounding
    assert ((got.float() - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all()
    zero = ext.int4_gemv(torch.zeros_like(x), m.qweight, m.scales_zeros, group)
    assert torch.equal(zero.float(), torch.zeros_like(want))
    # a NaN anywhere goes to torch's kernel (None here), never into the integer parts
    bad = x.clone()
    bad[0, 3] = float("nan")
    assert ext.int4_gemv(bad, m.qweight, m.scales_zeros, group) is None


def test_vnni_int8_falls_back_on_nan_and_outliers() -> None:
    from superslm.quant.dense import Int8Linear

    if not cpu_decode.extension().vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the GEMV is torch's kernel")

    g = torch.Generator().manual_seed(3)
    m = Int8Linear.from_dense(torch.randn(256, 512, generator=g))
    x = (torch.randn(1, 512, generator=g) * 0.05).to(torch.bfloat16)
    x[0, 7] = 2000.0  # one massive activation: the split's error would swamp the small ones
    assert torch.equal(cpu_decode.vnni_linear(m, x).float(), m(x).float())  # torch's kernel, bit for bit
    nan = x.clone()
    nan[0, 1:] = float("nan")
    assert torch.isnan(cpu_decode.vnni_linear(m, nan)).all()


@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (960, 576, 32), (192, 512, 64), (128, 256, 128), (64, 512, 256)])
def test_vnni_int4_gemm_rows_equal_the_single_row_gemv(n: int, k: int, group: int) -> None:
    """Each row of the multi-row kernel has the bits the one-row GEMV gives it alone (batch invariance);
    a row with a NaN goes to torch's kernel alone and leaves the other rows untouched."""
    from superslm.quant.int4 import Int4Linear

    ext = cpu_decode.extension()
    if not ext.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    g = torch.Generator().manual_seed(n + group)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g), group=group)
    for rows in (2, 3, 16, 37):
        x = (torch.randn(rows, m.k_pad, generator=g) * torch.rand(rows, m.k_pad, generator=g) ** 4).to(torch.bfloat16)
        x[1, 5] = float("nan")
        got = ext.int4_gemm(x, m.qweight, m.scales_zeros, group)
        for r in range(rows):
            one = ext.int4_gemv(x[r : r + 1], m.qweight, m.scales_zeros, group)
            if one is None:  # torch's kernel, as the GEMM sends that row
                assert r == 1
                one = torch.ops.aten._weight_int4pack_mm_for_cpu(x[r : r + 1], m.qweight, group, m.scales_zeros)
            assert torch.equal(got[r : r + 1].view(torch.int16), one.view(torch.int16)), (rows, r)
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, group, m.scales_zeros).float()
        ok = torch.arange(rows) != 1
        assert ((got[ok].float() - want[ok]).abs() <= 2**-7 * want[ok].abs() + 1e-3 * want[ok].abs().max()).all()
    # no row that can be split: all of them go to torch's kernel
    bad = torch.full((3, m.k_pad), float("nan"), dtype=torch.bfloat16)
    assert torch.isnan(ext.int4_gemm(bad, m.qweight, m.scales_zeros, group)).all()


@pytest.mark.parametrize("shape", [(300, 64), (4099, 576), (1001, 640)])
def test_vnni_int8_gemm_rows_equal_the_single_row_gemv(shape) -> None:
    """Deterministic rows of the int8 head: each row of the multi-row kernel has the one-row GEMV's bits;
    a NaN row goes to torch's kernel alone."""
    from superslm.quant.dense import Int8Linear

    ext = cpu_decode.extension()
    if not ext.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    n, k = shape
    g = torch.Generator().manual_seed(n)
    m = Int8Linear.from_dense(torch.randn(n, k, generator=g))
    for rows in (2, 3, 16, 37):
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) ** 4).to(torch.bfloat16)
        x[1, 5] = float("nan")
        got = cpu_decode.vnni_linear(m, x, deterministic=True)
        default = cpu_decode.vnni_linear(m, x)  # several rows, default mode: torch's kernel, or ours from gemm_rows
        if rows < ext.gemm_rows(True):
            assert default is None
        else:
            assert torch.equal(default.view(torch.int16), got.view(torch.int16))
        for r in range(rows):
            one = cpu_decode.vnni_linear(m, x[r : r + 1])
            assert torch.equal(got[r : r + 1].view(torch.int16), one.view(torch.int16)), (rows, r)
        want = _torch_int8(m, x)
        ok = torch.arange(rows) != 1
        assert ((got[ok].float() - want[ok]).abs() <= 2**-7 * want[ok].abs() + 1e-3 * want[ok].abs().max()).all()
        assert torch.isnan(got[1]).all()
    bad = torch.full((3, k), float("nan"), dtype=torch.bfloat16)
    assert torch.isnan(cpu_decode.vnni_linear(m, bad, deterministic=True)).all()


def test_kernels_refuse_bad_arguments() -> None:
    from superslm.quant.dense import Int8Linear
    from superslm.quant.int4 import Int4Linear

    ext = cpu_decode.extension()
    m = Int4Linear.from_dense(torch.randn(64, 128), group=32)
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(RuntimeError, match="group"):
        ext.int4_gemv(x, m.qweight, m.scales_zeros, 0)
    with pytest.raises(RuntimeError, match="packed codes"):
        ext.int4_gemm(torch.randn(2, 64).bfloat16(), m.qweight, m.scales_zeros, 32)
    q = Int8Linear.from_dense(torch.randn(64, 128))
    with pytest.raises(RuntimeError, match="rowsum"):
        ext.int8_gemv(x, q.codes, q.scale, torch.zeros(3, dtype=torch.int32))
    # rows of no values (K 0): an error, not a division by zero in the kernels' work split
    empty = torch.empty(3, 0).bfloat16()
    with pytest.raises(RuntimeError, match="positive multiple"):
        ext.int4_gemm_avx2(empty, torch.empty(64, 0, dtype=torch.uint8), torch.empty(0, 64, 2).bfloat16(), 32, 0)
    with pytest.raises(RuntimeError, match="positive multiple"):
        ext.int8_gemm_avx2(empty, torch.empty(64, 0, dtype=torch.int8), q.scale)
    with pytest.raises(RuntimeError, match="positive multiple"):
        ext.iq4_linear(empty, torch.empty(64, 0, dtype=torch.uint8), torch.empty(64, 0),
                       torch.zeros(16, dtype=torch.int8), False)


def test_float32_rows_get_the_same_bits_alone_or_batched() -> None:
    from superslm.quant.dense import Int8Linear
    from superslm.quant.int4 import Int4Linear

    ext = cpu_decode.extension()
    if not ext.vnni_available():
        pytest.skip("no VNNI")
    x = torch.randn(5, 256)  # float32: both kernels see it rounded to bf16
    m4 = Int4Linear.from_dense(torch.randn(128, 256), group=32)
    m8 = Int8Linear.from_dense(torch.randn(128, 256))
    many4 = ext.int4_gemm(x, m4.qweight, m4.scales_zeros, 32)
    many8 = cpu_decode.vnni_linear(m8, x, deterministic=True)
    for r in range(5):
        assert torch.equal(ext.int4_gemv(x[r : r + 1], m4.qweight, m4.scales_zeros, 32), many4[r : r + 1])
        assert torch.equal(cpu_decode.vnni_linear(m8, x[r : r + 1]), many8[r : r + 1])
