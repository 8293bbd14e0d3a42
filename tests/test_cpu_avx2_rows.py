"""The AVX2 row kernels (kernels/cpu/avx2_rows.cpp) for CPUs without VNNI: every row bit for bit the one-row
AVX2 GEMV's (kernels/cpu/avx2.cpp), whatever the other rows; within bf16 rounding of torch's kernels (their
twin); a row the GEMV declines gets the bits of torch's kernel on that row alone (the declined rows go through
it in one call); the decode plan and the Python path (cpu_decode.rows_linear) take them for a few rows of the
default mode, never in deterministic mode."""

from __future__ import annotations

import os

import pytest
import torch

from superslm.kernels import cpu_decode, cpu_prompt
from superslm.models.layers import _linear
from superslm.quant.dense import Int8Linear
from superslm.quant.int4 import Int4Linear, cpu_block, pack_int4, unpack_int4

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _within_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    # two int8 parts carry x to ~1/32,000 of each group's largest element: within bf16 rounding of torch's
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all())


def _wide_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) ** 4).to(torch.bfloat16)


@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (960, 576, 32), (192, 512, 64), (128, 256, 128), (64, 512, 256),
                                       (3072, 576, 32), (128, 96, 32), (64, 1024, 256)])  # fmt: skip
def test_int4_rows_equal_the_gemv(avx2_ext, n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(n + k + group)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g), group=group)
    for rows in (2, 3, 4, 5, 16, 37):
        x = _wide_rows(rows, m.k_pad, g)
        x[1, :group] = 0  # an all-zero group: zero parts and sums, as the GEMV gives it
        got = avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, group, 0)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        for r in range(rows):
            one = avx2_ext.int4_gemv_avx2(x[r : r + 1], m.qweight, m.scales_zeros, group, 0)
            assert torch.equal(_bits(got[r : r + 1]), _bits(one)), (rows, r)
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, group, m.scales_zeros)
        assert _within_bf16(got, want)
        # float32 rows are rounded to bf16 first, as torch's kernel sees them
        assert torch.equal(_bits(avx2_ext.int4_gemm_avx2(x.float(), m.qweight, m.scales_zeros, group, 0)), _bits(got))


@pytest.mark.parametrize("block", [32, 64])
def test_int4_rows_read_both_torch_layouts(avx2_ext, block: int) -> None:
    g = torch.Generator().manual_seed(block)
    m = Int4Linear.from_dense(torch.randn(256, 192, generator=g), group=32)
    other = pack_int4(unpack_int4(m.qweight, cpu_block()), block)
    x = _wide_rows(5, 192, g)
    here = avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, 32, 0)
    assert torch.equal(_bits(avx2_ext.int4_gemm_avx2(x, other, m.scales_zeros, 32, block)), _bits(here))
    for r in range(5):
        one = avx2_ext.int4_gemv_avx2(x[r : r + 1], other, m.scales_zeros, 32, block)
        assert torch.equal(_bits(here[r : r + 1]), _bits(one))
    x[2, 7] = float("nan")  # a row no GEMV takes, in a layout torch's kernel does not read: the caller's
    assert (avx2_ext.int4_gemm_avx2(x, other, m.scales_zeros, 32, block) is None) == (block != cpu_block())
    with pytest.raises(RuntimeError, match="blocks of 32 or 64"):
        avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, 32, 16)
    with pytest.raises(RuntimeError, match="group"):
        avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, 0, 0)


def test_int4_rows_the_gemv_declines_take_torch_alone(avx2_ext) -> None:
    g = torch.Generator().manual_seed(1)
    m = Int4Linear.from_dense(torch.randn(128, 256, generator=g), group=32)
    x = _wide_rows(14, 256, g)
    x[1, 3] = float("nan")
    x[2, 9] = float("inf")
    # rows with one outlier over 64x its group's rms (small elements would lose their bits): declined, all in one
    # call of torch's kernel across its tiles of rows, each with the bits torch's kernel gives it alone
    outliers = (4, 6, 7, 9, 12, 13)
    for r in outliers:
        x[r] *= 0.01
        x[r, (40 + 9 * r) % 256] = 1000.0
    got = avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, 32, 0)
    for r in range(14):
        one = avx2_ext.int4_gemv_avx2(x[r : r + 1], m.qweight, m.scales_zeros, 32, 0)
        if r in (1, 2, *outliers):
            assert one is None
            one = torch.ops.aten._weight_int4pack_mm_for_cpu(x[r : r + 1], m.qweight, 32, m.scales_zeros)
        assert torch.equal(_bits(got[r : r + 1]), _bits(one)), r


@pytest.mark.parametrize("n,k,group", [(960, 576, 32), (192, 512, 64), (128, 96, 32), (64, 1024, 256), (192, 384, 128)])
def test_int4_prompt_rows_equal_the_gemv(avx2_ext, n: int, k: int, group: int) -> None:
    """A prompt chunk's rows (64, 65, 200: whole row pairs, an odd row, several k blocks): each row the one-row
    GEMV's bits, an all-zero group, a NaN, an inf and an outlier row among them (torch's kernel on that row
    alone); within bf16 rounding of torch's kernel, its twin."""
    g = torch.Generator().manual_seed(n + k + group)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g) * 0.05, group=group)
    for rows in (64, 65, 200):
        x = _wide_rows(rows, m.k_pad, g)
        x[1, :group] = 0
        x[rows // 2, 3] = float("nan")
        x[rows - 1, 1] = float("-inf")
        x[7] = 0.01
        x[7, group // 2] = 1000.0  # over 64x its group's rms: the GEMV declines the row
        x[9] *= 3e4  # outliers the split takes: a row's sums stay in int32
        got = avx2_ext.int4_gemm_avx2(x, m.qweight, m.scales_zeros, group, 0)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, m.qweight.shape[0])
        torchs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, group, m.scales_zeros)
        for r in range(rows):
            one = avx2_ext.int4_gemv_avx2(x[r : r + 1], m.qweight, m.scales_zeros, group, 0)
            if r in (7, rows // 2, rows - 1):
                assert one is None
                one = torch.ops.aten._weight_int4pack_mm_for_cpu(x[r : r + 1], m.qweight, group, m.scales_zeros)
            assert torch.equal(_bits(got[r : r + 1]), _bits(one)), (rows, r)
        fine = [r for r in range(rows) if r not in (rows // 2, rows - 1)]
        assert _within_bf16(got[fine], torchs[fine])


@pytest.mark.parametrize("n,k", [(300, 64), (4099, 576), (1001, 640), (7, 128), (2, 1024)])
def test_int8_rows_equal_the_gemv(avx2_ext, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    m = Int8Linear.from_dense(torch.randn(n, k, generator=g))
    codes = m.codes.clone()
    codes[0, :8] = torch.tensor([-128, 127, -128, -127, 0, 1, -1, 127], dtype=torch.int8)  # the extremes
    for rows in (3, 5, 16, 33):
        x = _wide_rows(rows, k, g)
        x[0, :8] = torch.tensor([-3.0, 3.0, -3.0, -3.0, 1.0, 1.0, -1.0, 3.0])  # the largest parts on the extremes
        x[1] = 0  # no split: torch's kernel on the row alone
        x[2, 5] = float("nan")
        # rows with one outlier (past 64x the others' rms): declined, several of them in one call of torch's
        # kernel, across its tiles of rows, each with the bits torch's kernel gives it alone
        outliers = [r for r in range(3, rows) if r % 3 == 0]
        for r in outliers:
            x[r] *= 0.01
            x[r, (7 * r) % k] = 1000.0
        got = avx2_ext.int8_gemm_avx2(x, codes, m.scale)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        for r in range(rows):
            one = avx2_ext.int8_gemv_avx2(x[r : r + 1], codes, m.scale)
            if r in (1, 2, *outliers):
                assert one is None
                one = torch.ops.aten._weight_int8pack_mm(x[r : r + 1], codes, m.scale)
            assert torch.equal(_bits(got[r : r + 1]), _bits(one)), (rows, r)
        ok = torch.arange(rows) != 2
        assert _within_bf16(got[ok], torch.ops.aten._weight_int8pack_mm(x, codes, m.scale)[ok])
    two = _wide_rows(2, k, g)  # one tile of two rows, no tail
    got = avx2_ext.int8_gemm_avx2(two, codes, m.scale)
    for r in range(2):
        assert torch.equal(_bits(got[r : r + 1]), _bits(avx2_ext.int8_gemv_avx2(two[r : r + 1], codes, m.scale)))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        avx2_ext.int8_gemm_avx2(x[:, :32], codes[:, :32].contiguous(), m.scale)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rows_linear_takes_the_row_kernels(avx2_only, fmt: str) -> None:
    """2..avx2_gemm_rows rows of the default mode: the row kernels (a rotated int8 module rotates in float first,
    as the plan does); one row the GEMV; deterministic mode and prompt chunks keep their paths."""
    avx2_ext = avx2_only
    g = torch.Generator().manual_seed(3)
    w = torch.randn(320, 256, generator=g)
    m = Int4Linear.from_dense(w, group=32) if fmt == "int4" else Int8Linear.from_dense(w)
    assert avx2_ext.avx2_gemm_rows() < cpu_prompt.PROMPT_ROWS
    for rows in (1, 2, 4, 16, avx2_ext.avx2_gemm_rows()):
        x = _wide_rows(rows, 256, g)
        got = cpu_decode.rows_linear(m, x)
        if fmt == "int4":
            kernel = avx2_ext.int4_gemv_avx2 if rows == 1 else avx2_ext.int4_gemm_avx2
            want = kernel(x, m.qweight, m.scales_zeros, 32, 0)
        else:
            want = (avx2_ext.int8_gemv_avx2 if rows == 1 else avx2_ext.int8_gemm_avx2)(x, m.codes, m.scale)
        assert got is not None and torch.equal(_bits(got), _bits(want)), rows
        assert torch.equal(_bits(_linear(m, x, False)), _bits(got))
        assert _within_bf16(got, m(x))
        assert torch.equal(_bits(_linear(m, x, True)), _bits(m(x)))  # deterministic: torch's kernel
    assert cpu_decode.rows_linear(m, _wide_rows(avx2_ext.avx2_gemm_rows() + 1, 256, g)) is None
    if fmt == "int8":
        x = _wide_rows(3, 256, g)
        assert torch.equal(_bits(cpu_decode.vnni_linear(m, x)), _bits(avx2_ext.int8_gemm_avx2(x, m.codes, m.scale)))
        assert cpu_decode.vnni_linear(m, x, deterministic=True) is None


def test_rows_linear_on_concatenated_parts(avx2_only) -> None:
    from superslm.quant.gguf_map import ConcatLinear

    avx2_ext = avx2_only
    g = torch.Generator().manual_seed(4)
    a = Int4Linear.from_dense(torch.randn(128, 256, generator=g), group=32)
    b = Int8Linear.from_dense(torch.randn(64, 256, generator=g))
    cat = ConcatLinear([a, b])
    x = _wide_rows(3, 256, g)
    got = cpu_decode.rows_linear(cat, x)
    want = torch.cat([avx2_ext.int4_gemm_avx2(x, a.qweight, a.scales_zeros, 32, 0),
                      avx2_ext.int8_gemm_avx2(x, b.codes, b.scale)], 1)  # fmt: skip
    assert got is not None and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("body", ["int4", "int8"])
def test_several_rows_in_the_plan(avx2_only, tmp_path, body: str) -> None:
    """Three decoding sequences (three rows): the plan's linears take the row kernels, within bf16 rounding of
    the same plan on torch's kernels; deterministic steps keep torch's kernels (the same bits with AVX2 off)."""
    from superslm.models.loader import materialize, open_source
    from superslm.models.transformer import Transformer
    from superslm.quant import quantize_linears
    from tests.test_cpu_decode import _prefilled
    from tests.tiny_models import build_hf_model

    avx2_ext = avx2_only
    build_hf_model("llama", tmp_path)
    src = open_source(tmp_path)
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    quantize_linears(net, body=body, head=None, group=32)

    kv, meta, toks = _prefilled(net, [37, 12, 25])  # once: the prompts' rows take the row kernels where AVX2 is on

    def run(deterministic: bool) -> torch.Tensor:
        with torch.no_grad():
            h = net.embed(toks)
            tables = net._rope_tables(meta.positions)
            tabs = [tables.get(k, tables[max(tables)]) for k in range(2)]
            key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
            return cpu_decode.decode_layers(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0,
                                            len(net.layers), deterministic)  # fmt: skip

    fast, fast_det = run(False), run(True)
    avx2_ext.set_avx2(False)
    try:
        slow, slow_det = run(False), run(True)
    finally:
        avx2_ext.set_avx2(True)
    assert fast.shape[0] == 3
    scale = slow.float().abs().max().item()
    assert (fast.float() - slow.float()).abs().max().item() <= 2**-5 * scale
    assert not torch.equal(fast, slow)  # the row kernels ran: their roundings differ from torch's kernels
    assert torch.equal(fast_det, slow_det)
