"""Prompt chunks' int linears through decoded weight blocks and float32 GEMMs (kernels/cpu_prompt.py): the C++
decoding against its torch twin and the format's own dequantization, the products against float64 and torch's
packed kernels, the rows and modes it takes, and a hybrid model's prompt through it."""

from __future__ import annotations

import os

import pytest
import torch

from superslm.kernels import cpu_prompt
from superslm.models import layers
from superslm.quant import quantize_linears
from superslm.quant.dense import Int8Linear
from superslm.quant.gguf_map import ConcatLinear
from superslm.quant.int4 import Int4Linear
from superslm.quant.split_rows import int8_prompt_reference
from tests.test_iq4 import hostile_rows

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")


@pytest.fixture
def ext(vnni_off):
    """The extension with VNNI switched off for one test (conftest.py; on VNNI CPUs the path stands aside)."""
    if vnni_off.torch_int4_block() <= 0:
        pytest.skip("torch's packed int4 layout is unknown here")
    return vnni_off


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (960, 576, 32), (192, 512, 64), (96, 256, 128)])
def test_int4_decoding_equals_its_twin_and_the_formats_dequantization(ext, n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    lin = Int4Linear.from_dense(torch.randn(n, k, generator=g) * 0.05, None, group=group)
    block, rows = ext.torch_int4_block(), lin.qweight.shape[0]
    out = torch.full((rows * k,), float("nan"))
    for n0, n1 in ((0, rows), (block, rows), (0, block)):
        want = cpu_prompt.int4_dequant_rows_reference(lin.qweight, lin.scales_zeros, group, n0, n1, block)
        ext.int4_dequant_rows(lin.qweight, lin.scales_zeros, group, n0, n1, out)
        assert torch.equal(out[: (n1 - n0) * k].view(k, n1 - n0), want)
    full = cpu_prompt.int4_dequant_rows_reference(lin.qweight, lin.scales_zeros, group, 0, rows, block)
    assert torch.equal(full.t()[:n], lin.dequantize_stored()[:n].float())  # the format's own reading of its codes


def test_int4_decoding_refuses_bad_arguments(ext) -> None:
    lin = Int4Linear.from_dense(torch.randn(64, 128), None, group=32)
    out = torch.empty(64 * 128)
    with pytest.raises(RuntimeError, match="block boundaries"):
        ext.int4_dequant_rows(lin.qweight, lin.scales_zeros, 32, 1, 64, out)
    with pytest.raises(RuntimeError, match="out float32"):
        ext.int4_dequant_rows(lin.qweight, lin.scales_zeros, 32, 0, 64, torch.empty(10))
    with pytest.raises(RuntimeError, match="sz bf16"):
        ext.int4_dequant_rows(lin.qweight, lin.scales_zeros, 64, 0, 64, out)


def _modules(n: int, k: int) -> dict[str, torch.nn.Module]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    return {
        "int4": Int4Linear.from_dense(w, None, group=32),
        "int4-bias": Int4Linear.from_dense(w, bias, group=32),
        "int4-rotated": Int4Linear.from_dense(w, None, group=32, rotate=0),
        "int8": Int8Linear.from_dense(w, None),
        "int8-bias": Int8Linear.from_dense(w, bias),
        "concat": ConcatLinear([Int8Linear.from_dense(w[: n // 2], None),
                                Int4Linear.from_dense(w[n // 2 :], None, group=32)]),
    }


@pytest.mark.parametrize("int_rows", [True, False])
@pytest.mark.parametrize("name", ["int4", "int4-bias", "int4-rotated", "int8", "int8-bias", "concat"])
def test_prompt_rows_as_accurate_as_torchs_kernels(ext, monkeypatch, name: str, int_rows: bool) -> None:
    # the AVX2 integer row kernels (int4: the GEMV's bits; int8: the two-part kernel), or decoded blocks
    monkeypatch.setattr(cpu_prompt, "INT4_ROWS", int_rows)
    monkeypatch.setattr(cpu_prompt, "INT8_ROWS", int_rows)
    n, k, m = 320, 512, cpu_prompt.PROMPT_ROWS + 3
    lin = _modules(n, k)[name]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = cpu_prompt.prompt_linear(lin, x)
    assert got is not None and got.shape == (m, n) and got.dtype == torch.bfloat16
    exact = x.double() @ lin.dequantize().double().t()
    if getattr(lin, "bias", None) is not None:
        exact = exact + lin.bias.double()
    torchs = lin(x)
    # float32 sums of the exact weights: no worse than torch's kernels (bf16 output rounding either way)
    assert _rel(got, exact) <= max(_rel(torchs, exact) * 1.25, 2e-3)
    assert _rel(got, torchs) < 4e-3


@pytest.mark.parametrize("name", ["int4", "int4-bias", "int4-rotated"])
def test_int4_prompt_rows_equal_decode_rows(ext, name: str) -> None:
    """int4 prompt rows through the AVX2 row kernel: each row the bits decode gives it alone (the one-row GEMV),
    whatever the chunk; deterministic mode keeps the module's own kernel."""
    from superslm.kernels import cpu_decode

    lin = _modules(320, 512)[name]
    x = torch.randn(cpu_prompt.PROMPT_ROWS * 2 + 1, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = cpu_prompt.prompt_linear(lin, x)
    assert got is not None
    for r in (0, 1, cpu_prompt.PROMPT_ROWS, x.shape[0] - 1):
        one = cpu_decode.rows_linear(lin, x[r : r + 1])
        assert one is not None and torch.equal(got[r : r + 1].view(torch.int16), one.view(torch.int16)), r
    assert torch.equal(layers._linear(lin, x, False).view(torch.int16), got.view(torch.int16))
    assert torch.equal(layers._linear(lin, x, True).view(torch.int16), lin(x).view(torch.int16))


@pytest.mark.parametrize("n,k", [(70, 96), (37, 1056), (320, 512)])
def test_int8_prompt_kernel_equals_its_twin(ext, n: int, k: int) -> None:
    """int8 prompt rows on CPUs without VNNI (kernels/cpu/avx2_rows.cpp int8_prompt_avx2): bit for bit its twin
    (quant/split_rows.py), a row's bits the same whatever the rows beside it and the threads, the rows it cannot
    split (a NaN, an inf, an outlier) through torch's kernel; the module's prompt path takes it past
    `avx2_gemm_rows` rows."""
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
    x = hostile_rows(70, k, g)  # the split declines rows 3, 4 and 7
    got = ext.int8_prompt_avx2(x, codes, scale)
    assert got.shape == (70, n) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), int8_prompt_reference(x, codes, scale).view(torch.int16))
    declined = [3, 4, 7]
    torchs = torch._weight_int8pack_mm(x[declined], codes, scale)
    assert torch.equal(got[declined].view(torch.int16), torchs.view(torch.int16))
    good = [r for r in range(70) if r not in declined]
    exact = x[good].double() @ (codes.double() * scale.double()[:, None]).t()
    assert _rel(got[good], exact) < 3e-3
    threads = torch.get_num_threads()
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            for lo, hi in ((0, 1), (2, 9), (8, 70)):
                again = ext.int8_prompt_avx2(x[lo:hi], codes, scale)
                assert torch.equal(again.view(torch.int16), got[lo:hi].view(torch.int16)), (nt, lo, hi)
    finally:
        torch.set_num_threads(threads)
    assert ext.int8_prompt_avx2(x[:, :80], codes[:, :80].contiguous(), scale) is None  # K % 32 != 0
    with pytest.raises(RuntimeError, match="bf16 scale"):
        ext.int8_prompt_avx2(x, codes, scale.float())
    if k % 64 == 0:
        lin = Int8Linear.from_dense(codes.float() * scale.float()[:, None], None)
        y = cpu_prompt.prompt_linear(lin, x)
        want = ext.int8_prompt_avx2(x, lin.codes, lin.scale)
        assert y is not None and torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_int4_prompt_rows_a_row_kernel_declines(ext) -> None:
    """Prompt chunks past `avx2_gemm_rows` (int4_prompt_avx2): the rows the row kernel splits get decode's bits
    (int4_gemm_avx2's), the rows it declines (an outlier, a NaN) go together through one call of torch's kernel
    (within rounding of the float64 product), not one a row; the same bits on 1 and 2 threads; the module's
    prompt path takes it."""
    lin = _modules(320, 512)["int4"]
    x = torch.randn(ext.avx2_gemm_rows() + 9, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[2, 3] = 3e4
    x[5, 1] = float("nan")
    ops = (lin.qweight, lin.scales_zeros, 32)
    got = ext.int4_prompt_avx2(x, *ops)
    declined = [2, 5]
    keep = [r for r in range(x.shape[0]) if r not in declined]
    assert torch.equal(got[keep].view(torch.int16), ext.int4_gemm_avx2(x, *ops, 0)[keep].view(torch.int16))
    torchs = torch._weight_int4pack_mm_for_cpu(x[declined], lin.qweight, 32, lin.scales_zeros)
    assert torch.equal(got[declined].view(torch.int16), torchs.view(torch.int16))
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            assert torch.equal(ext.int4_prompt_avx2(x, *ops).view(torch.int16), got.view(torch.int16)), nt
    finally:
        torch.set_num_threads(threads)
    w = lin.dequantize_stored().double()
    exact = x[2:3].double() @ w.t()
    assert _rel(got[2:3, : w.shape[0]], exact) < 4e-3
    assert torch.isnan(got[5]).all()
    y = cpu_prompt.prompt_linear(lin, x)
    assert y is not None and torch.equal(y.view(torch.int16), got[:, :320].view(torch.int16))


def test_a_concatenation_whose_part_the_path_does_not_take(ext) -> None:
    """A ConcatLinear with a part the path does not take (here: hooked) runs that part as it is and the others
    through the path, not all of them on torch's kernels."""
    a = Int4Linear.from_dense(torch.randn(128, 256, generator=torch.Generator().manual_seed(5)) * 0.05, None, group=32)
    b = Int8Linear.from_dense(torch.randn(64, 256, generator=torch.Generator().manual_seed(6)) * 0.05, None)
    cat = ConcatLinear([a, b])
    x = torch.randn(cpu_prompt.PROMPT_ROWS, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    seen = []
    handle = b.register_forward_hook(lambda *args: seen.append(1))
    got = cpu_prompt.prompt_linear(cat, x)
    assert got is not None and seen == [1]
    want = torch.cat([cpu_prompt.prompt_linear(a, x), b(x)], dim=1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    a_hook = a.register_forward_hook(lambda *args: None)
    assert cpu_prompt.prompt_linear(cat, x) is None  # no part takes the path: the caller runs the module
    a_hook.remove()
    handle.remove()


def test_which_rows_and_modes_take_the_path(ext, monkeypatch) -> None:
    lin = _modules(320, 512)["int4"]
    few = torch.randn(cpu_prompt.PROMPT_ROWS - 1, 512, dtype=torch.bfloat16)
    assert cpu_prompt.prompt_linear(lin, few) is None  # decode steps keep the GEMVs and torch's kernel
    many = torch.randn(cpu_prompt.PROMPT_ROWS, 512, dtype=torch.bfloat16)
    assert cpu_prompt.prompt_linear(lin, many) is not None
    calls = []
    monkeypatch.setattr(cpu_prompt, "prompt_linear", lambda *a: calls.append(a) or None)
    # deterministic mode keeps the row-invariant kernel: the same bits as the module alone
    assert torch.equal(layers._linear(lin, many, True), lin(many)) and not calls
    layers._linear(lin, many, False)
    assert len(calls) == 1
    monkeypatch.undo()
    ext.set_vnni(True)
    if ext.vnni_available():  # a VNNI CPU: its own kernels, not this path
        assert cpu_prompt.prompt_linear(lin, many) is None
    ext.set_vnni(False)
    handle = lin.register_forward_hook(lambda *a: None)
    assert cpu_prompt.prompt_linear(lin, many) is None  # hooks see the module run
    handle.remove()


def test_a_hybrid_models_prompt_through_the_path(ext, tmp_path) -> None:
    """A tiny Qwen3.5 (delta-rule and gated attention layers) as int4: a prompt chunk's logits through decoded
    blocks equal torch's kernels' within bf16 rounding, and greedy continuations agree."""
    from superslm.engine import Request
    from superslm.model import load
    from superslm.sampling import Sampling
    from tests.tiny_models import build_hf_model

    build_hf_model("qwen3_5", tmp_path)
    model = load(str(tmp_path), device="cpu", dtype=torch.bfloat16)
    quantize_linears(model.net, "int4", group=32)
    prompt = torch.randint(0, model.net.arch.vocab, (cpu_prompt.PROMPT_ROWS * 2 + 5,),
                           generator=torch.Generator().manual_seed(3)).tolist()

    def run(path_on: bool) -> tuple[list[int], torch.Tensor]:
        rows = cpu_prompt.PROMPT_ROWS
        cpu_prompt.PROMPT_ROWS = rows if path_on else 1 << 30
        try:
            engine = model.engine(slots=1, context=512, prefix_caching=False)
            out = engine.generate([Request(prompt, 8, Sampling(logprobs=5))])[0]
        finally:
            cpu_prompt.PROMPT_ROWS = rows
        return out.tokens, torch.tensor([lp.logprob for lp in out.logprobs])

    on, off = run(True), run(False)
    assert on[0][0] == off[0][0]
    assert torch.allclose(on[1][:1], off[1][:1], atol=0.05)
