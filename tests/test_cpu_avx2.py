"""The AVX2 GEMVs (kernels/cpu/avx2.cpp) for CPUs without AVX-512 VNNI: against torch's kernels, on both of
torch's int4 layouts, on the inputs they must refuse, and inside the decode plan (one row, default mode only)."""

from __future__ import annotations

import os

import pytest
import torch

from superslm.kernels import cpu_decode
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from superslm.quant import quantize_linears
from superslm.quant.dense import Int8Linear
from superslm.quant.int4 import Int4Linear, cpu_block, pack_int4, unpack_int4
from tests.tiny_models import build_hf_model

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")


def _within_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    # two int8 parts carry x to ~1/32,000 of each group's largest element: within bf16 rounding of torch's
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all())


def _wide_row(k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(1, k, generator=g) * torch.rand(1, k, generator=g) ** 4).to(torch.bfloat16)


@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (960, 576, 32), (192, 512, 64), (128, 256, 128), (64, 512, 256),
                                       (3072, 576, 32), (128, 96, 32)])  # fmt: skip
def test_int4_gemv_equals_torch_kernel(avx2_ext, n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(n + k + group)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g), group=group)
    x = _wide_row(m.k_pad, g)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, group, m.scales_zeros)
    got = avx2_ext.int4_gemv_avx2(x, m.qweight, m.scales_zeros, group, 0)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert _within_bf16(got, want)
    # float32 rows are rounded to bf16 first, as torch's kernel sees them
    assert torch.equal(avx2_ext.int4_gemv_avx2(x.float(), m.qweight, m.scales_zeros, group, 0), got)
    assert torch.equal(avx2_ext.int4_gemv_avx2(torch.zeros_like(x), m.qweight, m.scales_zeros, group, 0).float(),
                       torch.zeros(1, n))  # fmt: skip


@pytest.mark.parametrize("block", [32, 64])
def test_int4_gemv_reads_both_torch_layouts(avx2_ext, block: int) -> None:
    """torch packs blocks of 64 rows on AVX-512 CPUs and 32 on AVX2 ones: the same codes in either layout
    give the same bits (the rows land in their places, the arithmetic is the same)."""
    g = torch.Generator().manual_seed(block)
    m = Int4Linear.from_dense(torch.randn(256, 192, generator=g), group=32)
    codes = unpack_int4(m.qweight, cpu_block())
    x = _wide_row(192, g)
    here = avx2_ext.int4_gemv_avx2(x, m.qweight, m.scales_zeros, 32, 0)
    other = avx2_ext.int4_gemv_avx2(x, pack_int4(codes, block), m.scales_zeros, 32, block)
    assert torch.equal(other.view(torch.int16), here.view(torch.int16))
    with pytest.raises(RuntimeError, match="blocks of 32 or 64"):
        avx2_ext.int4_gemv_avx2(x, m.qweight, m.scales_zeros, 32, 16)


def test_int4_gemv_refuses_what_it_cannot_split(avx2_ext) -> None:
    g = torch.Generator().manual_seed(1)
    m = Int4Linear.from_dense(torch.randn(128, 256, generator=g), group=32)
    x = _wide_row(256, g)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[0, 3] = bad
        assert avx2_ext.int4_gemv_avx2(y, m.qweight, m.scales_zeros, 32, 0) is None  # torch's kernel takes the row
    y = (x * 0 + 0.01).to(torch.bfloat16)
    y[0, 40] = 1000.0  # one outlier over 64x its group's rms: small elements would lose their bits
    assert avx2_ext.int4_gemv_avx2(y, m.qweight, m.scales_zeros, 32, 0) is None
    with pytest.raises(RuntimeError, match="one row"):
        avx2_ext.int4_gemv_avx2(x.repeat(2, 1), m.qweight, m.scales_zeros, 32, 0)
    with pytest.raises(RuntimeError, match="group"):
        avx2_ext.int4_gemv_avx2(x, m.qweight, m.scales_zeros, 0, 0)


@pytest.mark.parametrize("n,k", [(300, 64), (4099, 576), (1001, 640), (7, 128)])
def test_int8_gemv_equals_torch_kernel(avx2_ext, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    m = Int8Linear.from_dense(torch.randn(n, k, generator=g))
    codes = m.codes.clone()
    codes[0, :8] = torch.tensor([-128, 127, -128, -127, 0, 1, -1, 127], dtype=torch.int8)  # the extremes
    x = _wide_row(k, g)
    want = torch.ops.aten._weight_int8pack_mm(x, codes, m.scale)
    got = avx2_ext.int8_gemv_avx2(x, codes, m.scale)
    assert got.dtype == torch.bfloat16 and _within_bf16(got, want)
    nan = x.clone()
    nan[0, 5] = float("nan")
    for bad in (torch.zeros_like(x), nan):  # no split: torch's kernel takes the row
        assert avx2_ext.int8_gemv_avx2(bad, codes, m.scale) is None
    with pytest.raises(RuntimeError, match="multiple of 64"):
        avx2_ext.int8_gemv_avx2(x[:, :32], codes[:, :32].contiguous(), m.scale)


def test_same_bits_as_the_vnni_kernels(avx2_ext) -> None:
    """Where the CPU has AVX-512 VNNI both kernels run: they give every row the same bits."""
    if not avx2_ext.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    g = torch.Generator().manual_seed(5)
    m4 = Int4Linear.from_dense(torch.randn(960, 576, generator=g), group=32)
    m8 = Int8Linear.from_dense(torch.randn(1001, 576, generator=g))
    x = _wide_row(576, g)
    four = avx2_ext.int4_gemv(x, m4.qweight, m4.scales_zeros, 32)
    got = avx2_ext.int4_gemv_avx2(x, m4.qweight, m4.scales_zeros, 32, 0)
    assert torch.equal(got.view(torch.int16), four.view(torch.int16))
    rowsum = avx2_ext.int8_rowsum(m8.codes)
    eight = avx2_ext.int8_gemv(x, m8.codes, m8.scale, rowsum)
    assert torch.equal(avx2_ext.int8_gemv_avx2(x, m8.codes, m8.scale).view(torch.int16), eight.view(torch.int16))


def test_head_takes_the_gemv_for_one_row_outside_deterministic_mode(avx2_only) -> None:
    avx2_ext = avx2_only
    g = torch.Generator().manual_seed(2)
    m = Int8Linear.from_dense(torch.randn(512, 256, generator=g))
    x = _wide_row(256, g)
    got = cpu_decode.vnni_linear(m, x)
    assert got is not None and torch.equal(got, avx2_ext.int8_gemv_avx2(x, m.codes, m.scale))
    assert _within_bf16(got, m(x))
    assert cpu_decode.vnni_linear(m, x, deterministic=True) is None  # torch's kernel at every row count
    three = x.repeat(3, 1)  # a few rows: the row kernel (tests/test_cpu_avx2_rows.py), each row the GEMV's bits
    assert torch.equal(cpu_decode.vnni_linear(m, three), avx2_ext.int8_gemm_avx2(three, m.codes, m.scale))
    assert torch.equal(cpu_decode.vnni_linear(m, three)[2:], got)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", path)
    return path


@pytest.mark.parametrize("body", ["int4", "int8"])
def test_one_row_decode_in_the_plan(avx2_only, llama_folder, body: str) -> None:
    """One decoding sequence (one row): the plan's linears take the AVX2 GEMVs, within bf16 rounding of the
    same plan on torch's kernels; deterministic steps keep torch's kernels (the same bits as with AVX2 off)."""
    from tests.test_cpu_decode import _prefilled

    avx2_ext = avx2_only
    src = open_source(llama_folder)
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    quantize_linears(net, body=body, head=None, group=32)
    assert net.layers[0].gate_up.out_features % 64 == 0

    kv, meta, toks = _prefilled(net, [37])  # once: the prompt's rows take the row kernels where AVX2 is on

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
    scale = slow.float().abs().max().item()
    assert (fast.float() - slow.float()).abs().max().item() <= 2**-5 * scale
    assert not torch.equal(fast, slow)  # the GEMVs ran: their roundings differ from torch's kernels
    assert torch.equal(fast_det, slow_det)
