"""GGUF Q5_0 (quant/int5.py "gguf5") on CPUs without VNNI: the AVX2 GEMV (kernels/cpu/avx2.cpp int5_gemv_avx2) and row
kernel (avx2_rows.cpp int5_gemm_avx2) against their torch twin (quant/int5.py int5_rows_reference), every row of the
row kernel bit for bit the GEMV's, the rows they decline on the float32 reference alone; the prompt path's decoded
blocks (prompt.cpp int5_dequant_rows) against theirs and gguf-py's values; and the Python paths that take them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from superslm.formats.blocks import Q5_0
from superslm.kernels import cpu_decode, cpu_prompt
from superslm.models.layers import _linear
from superslm.quant.gguf_map import int5_runs, linear_from_gguf
from superslm.quant.int5 import GGUFInt5Linear, int5_dequant_rows_reference, int5_rows_reference

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")

gguf_quants = pytest.importorskip("gguf.quants")


def _q5(n: int, k: int, seed: int) -> tuple[GGUFInt5Linear, np.ndarray]:
    """A Q5_0 linear of a Gaussian [n, k] weight (gguf-py's quantizer) and the file's bytes."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf_quants.quantize(w, gguf_quants.GGMLQuantizationType.Q5_0).reshape(-1)
    return GGUFInt5Linear.from_gguf(raw, Q5_0, (n, k)), raw


def _ops(m: GGUFInt5Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return m.qweight, m.scales_zeros, m.bits


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _wide_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) ** 4).to(torch.bfloat16)


def _near_twin(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernels and the twin: the same split and integer sums; their float steps are the same operations, but
    the twin's FMAs round through float64 (twice) and the C++ compiler may or may not contract x - qh sh into one
    FMA in the split: at most one bf16 ulp apart, and equal almost everywhere."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    diff = (_bits(got).int() - _bits(want).int()).abs()
    assert diff.max().item() <= 1
    assert (diff == 0).float().mean().item() >= 0.99


SHAPES = [(64, 128), (960, 576), (2048, 640), (1001, 640), (100, 1024), (1280, 640), (160, 96), (64, 32)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_int5_gemv_equals_its_twin(avx2_ext, n: int, k: int) -> None:
    m, _ = _q5(n, k, n + k)
    g = torch.Generator().manual_seed(n)
    x = _wide_rows(1, k, g)
    x[0, :32] = 0  # an all-zero group: zero parts and sums
    got = avx2_ext.int5_gemv_avx2(x, *_ops(m))
    assert got is not None and got.shape == (1, m.qweight.shape[0])
    _near_twin(got, int5_rows_reference(x, *_ops(m)))
    # within bf16 rounding of the float32 product of the decoded weights
    want = (x.double() @ m.dequantize_stored().double().t()).float()
    assert ((got[:, :n].float() - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all()
    # float32 rows are rounded to bf16 first; a zero row gives zeros
    assert torch.equal(_bits(avx2_ext.int5_gemv_avx2(x.float(), *_ops(m))), _bits(got))
    assert torch.equal(avx2_ext.int5_gemv_avx2(torch.zeros_like(x), *_ops(m)).float(), torch.zeros_like(got).float())


def test_int5_gemv_refuses_what_it_cannot_split(avx2_ext) -> None:
    m, _ = _q5(128, 256, 1)
    x = _wide_rows(1, 256, torch.Generator().manual_seed(1))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[0, 3] = bad
        assert avx2_ext.int5_gemv_avx2(y, *_ops(m)) is None  # the caller takes the float32 reference
    y = (x * 0 + 0.01).to(torch.bfloat16)
    y[0, 40] = 1000.0  # one outlier over 64x its group's rms
    assert avx2_ext.int5_gemv_avx2(y, *_ops(m)) is None
    with pytest.raises(RuntimeError, match="one row"):
        avx2_ext.int5_gemv_avx2(x.repeat(2, 1), *_ops(m))
    with pytest.raises(RuntimeError, match="fifth-bit masks"):
        avx2_ext.int5_gemv_avx2(x, m.qweight, m.scales_zeros, m.bits[:, :-1].contiguous())


@pytest.mark.parametrize("n,k", [(64, 128), (960, 576), (1001, 640), (256, 1024), (130, 96)])
def test_int5_rows_equal_the_gemv(avx2_ext, n: int, k: int) -> None:
    m, _ = _q5(n, k, n * 3 + k)
    g = torch.Generator().manual_seed(k)
    for rows in (2, 3, 5, 16, 37, 70):
        x = _wide_rows(rows, k, g)
        x[1, :32] = 0  # an all-zero group
        bad = (2, rows - 1) if rows >= 4 else ()
        if bad:  # rows the GEMV declines (a NaN, an outlier): the float32 reference on that row alone
            x[2, 5] = float("nan")
            x[rows - 1] = 0.01
            x[rows - 1, 40] = 1000.0
        got = avx2_ext.int5_gemm_avx2(x, *_ops(m))
        assert got.dtype == torch.bfloat16 and got.shape == (rows, m.qweight.shape[0])
        for r in range(rows):
            one = avx2_ext.int5_gemv_avx2(x[r : r + 1], *_ops(m))
            if r in bad:
                assert one is None
                one = avx2_ext.int5_reference(x[r : r + 1], *_ops(m))
            assert torch.equal(_bits(got[r : r + 1]), _bits(one)), (rows, r)
        ok = torch.ones(rows, dtype=torch.bool)
        if bad:
            ok[2] = False  # NaN: NaN everywhere in both
        _near_twin(got[ok], int5_rows_reference(x[ok], *_ops(m)))
        # the public entries: int5_gemv / int5_gemm take these kernels where VNNI does not run
        if not avx2_ext.vnni_available():
            assert torch.equal(_bits(avx2_ext.int5_gemm(x, *_ops(m))), _bits(got))
            assert torch.equal(_bits(avx2_ext.int5_gemv(x[:1], *_ops(m))), _bits(got[:1]))


def test_same_bits_as_the_vnni_kernels(avx2_ext) -> None:
    """Where the CPU has AVX-512 VNNI both kernels run: they give every row the same bits."""
    if not avx2_ext.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    m, _ = _q5(960, 640, 5)
    x = _wide_rows(5, 640, torch.Generator().manual_seed(5))
    assert torch.equal(_bits(avx2_ext.int5_gemv_avx2(x[:1], *_ops(m))), _bits(avx2_ext.int5_gemv(x[:1], *_ops(m))))
    assert torch.equal(_bits(avx2_ext.int5_gemm_avx2(x, *_ops(m))), _bits(avx2_ext.int5_gemm(x, *_ops(m))))


@pytest.mark.parametrize("n,k", [(64, 32), (1001, 640), (2048, 640), (128, 1024)])
def test_int5_dequant_rows_equal_the_twin_and_gguf(avx2_ext, n: int, k: int) -> None:
    m, raw = _q5(n, k, 7 * n + k)
    qweight, sz, bits = _ops(m)
    n_pad = qweight.shape[0]
    out = torch.empty(n_pad * k)
    for n0, n1 in ((0, n_pad), (0, 64), (n_pad - 64, n_pad)):
        avx2_ext.int5_dequant_rows(qweight, sz, bits, n0, n1, out)
        got = out[: (n1 - n0) * k].view(k, n1 - n0)
        assert torch.equal(got, int5_dequant_rows_reference(qweight, sz, bits, n0, n1))
    avx2_ext.int5_dequant_rows(qweight, sz, bits, 0, n_pad, out)
    w = out[: n_pad * k].view(k, n_pad).t()[:n]
    assert torch.equal(w, m.dequantize_stored())
    # gguf-py's values, up to d's rounding to bf16 (2^-9 of each weight)
    ref = torch.from_numpy(gguf_quants.dequantize(raw.reshape(n, -1), gguf_quants.GGMLQuantizationType.Q5_0))
    assert ((w - ref.view(n, k)).abs() <= 2**-8 * ref.view(n, k).abs()).all()
    with pytest.raises(RuntimeError, match="block boundaries"):
        avx2_ext.int5_dequant_rows(qweight, sz, bits, 0, 32, out)


def test_q5_0_runs_as_int5_here(avx2_ext) -> None:
    """With AVX2 (or VNNI) built, gguf_map keeps Q5_0 as it is; the module runs on the kernels."""
    assert int5_runs()
    w = np.random.default_rng(3).standard_normal((96, 256)).astype(np.float32)
    raw = gguf_quants.quantize(w, gguf_quants.GGMLQuantizationType.Q5_0).reshape(-1)
    m = linear_from_gguf([(raw, Q5_0, (96, 256), None)])
    assert isinstance(m, GGUFInt5Linear) and m.plan_args() is not None and m.row_invariant


def test_python_paths_take_the_avx2_kernels(avx2_only) -> None:
    """Without VNNI: decode rows (rows_linear) take the GEMV and the row kernel, the module's own forward the same
    bits at any row count (deterministic mode too), a prompt chunk too (the module as it is)."""
    avx2_ext = avx2_only
    m, _ = _q5(1001, 640, 11)
    m.bias = torch.randn(1001)
    g = torch.Generator().manual_seed(11)
    for rows in (1, 2, 16, avx2_ext.avx2_gemm_rows()):
        x = _wide_rows(rows, 640, g)
        got = cpu_decode.rows_linear(m, x)
        kernel = avx2_ext.int5_gemv_avx2 if rows == 1 else avx2_ext.int5_gemm_avx2
        want = (kernel(x, *_ops(m))[:, :1001].float() + m.bias).to(x.dtype)
        assert got is not None and torch.equal(_bits(got), _bits(want)), rows
        assert torch.equal(_bits(m(x)), _bits(got))
        assert torch.equal(_bits(_linear(m, x, True)), _bits(got))  # deterministic: the same row-invariant kernels
    x = _wide_rows(cpu_prompt.PROMPT_ROWS + 9, 640, g)
    got = _linear(m, x, False)
    want = (avx2_ext.int5_gemm_avx2(x, *_ops(m))[:, :1001].float() + m.bias).to(x.dtype)
    assert torch.equal(_bits(got), _bits(want))
    exact = (x.double() @ m.dequantize_stored().double().t() + m.bias.double()).float()
    assert ((got.float() - exact).abs() <= 2**-7 * exact.abs() + 1e-3 * exact.abs().max()).all()


def test_q5_0_plan_without_vnni(avx2_only, tmp_path) -> None:
    """The decode plan on Q5_0 linears with VNNI off: the AVX2 kernels (as on an AVX2-only CPU), equal to the
    reference, near the int8 re-quantization, and a decode row outside the plan through the same GEMV."""
    from gguf import GGMLQuantizationType, quants

    from superslm.models.loader import open_source
    from tests.test_cpu_decode import _stored_blocks_in_the_plan
    from tests.tiny_models import build_hf_model

    build_hf_model("llama", tmp_path)
    _stored_blocks_in_the_plan(open_source(tmp_path), ("qkv", "gate_up", "down"),
                               lambda w: quants.quantize(w, GGMLQuantizationType.Q5_0).reshape(-1), Q5_0, "gguf5",
                               GGUFInt5Linear)


def test_gemma_q5_0_as_int5_beside_int8(avx2_ext, gemma3_gguf, monkeypatch) -> None:
    """Gemma-3-270M's Q5_0 tensors as they are (int5) where they ran as int8 before: the last prompt row's logits
    nearer the file's float32 values than int8's, and each greedy token of both near the top of the file's float32
    logits at its prefix (a quarter of their deviation, as the other stored block types are held)."""
    import superslm
    from superslm.quant import gguf_map
    from tests.tiny_models import SingleSequence

    model = superslm.load(gemma3_gguf, device="cpu")
    assert any("Q5_0 (5-bit g32)" in key for key in model.info()["linears"]), model.info()["linears"]
    monkeypatch.setattr(gguf_map, "int5_runs", lambda: False)
    before = superslm.load(gemma3_gguf, device="cpu")
    monkeypatch.undo()
    assert not any("Q5_0 (5-bit g32)" in key for key in before.info()["linears"])
    exact = superslm.load(gemma3_gguf, device="cpu", dtype=torch.float32).net
    tokens = model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is",
                                    add_special_tokens=False)

    def greedy(net: torch.nn.Module, n: int = 12) -> tuple[torch.Tensor, list[int]]:
        seq = SingleSequence(net)
        with torch.no_grad():
            logits = seq.step(tokens)
            first = logits[-1].double()
            got: list[int] = []
            for _ in range(n):  # decode rows: the C++ plan's 5-bit GEMV
                got.append(int(logits[-1].argmax()))
                logits = seq.step(got[-1:])
        return first, got

    with torch.no_grad():
        want = SingleSequence(exact).step(tokens)[-1].double()
    errors = []
    for net in (model.net, before.net):
        first, picked = greedy(net)
        errors.append(((first - want).norm() / want.norm()).item())
        with torch.no_grad():
            ref = SingleSequence(exact).step(tokens + picked[:-1])[len(tokens) - 1 :].double()  # [12, vocab]
        top = ref.max(-1).values
        chosen = ref.gather(1, torch.tensor(picked)[:, None])[:, 0]
        assert (chosen >= top - 0.25 * ref.std(-1)).all(), (picked, (top - chosen).tolist())
    assert errors[0] < errors[1], errors


def test_prompt_rows_take_the_row_kernel(avx2_only, monkeypatch) -> None:
    """Prompt chunks of the default mode without VNNI run Q5_0 through the module's own AVX2 row kernel (each row it
    splits the bits decode gives it alone; the rows it declines, an outlier, a NaN, through the float32 reference,
    all in one call), the same bits on 1 and 2 threads; with `INT5_ROWS` off the Python prompt path decodes blocks
    for float32 GEMMs, within bf16 rounding of the float32 product."""
    m, _ = _q5(4096, 640, 13)  # [4096, 640]
    x = _wide_rows(cpu_prompt.PROMPT_ROWS + 37, 640, torch.Generator().manual_seed(13))
    x[3, 5] = 3e4  # an outlier: the split declines the row
    x[9, 7] = float("nan")
    assert cpu_prompt.prompt_linear(m, x) is None  # the caller runs the module as it is
    got = _linear(m, x, False)
    rows = avx2_only.int5_gemm_avx2(x, *_ops(m))
    assert torch.equal(_bits(got), _bits(rows[:, : m.out_features]))
    assert avx2_only.int5_gemv_avx2(x[3:4], *_ops(m)) is None  # the GEMV declines it: the reference, as here
    for r in (0, x.shape[0] - 1):  # each row as decode computes it alone
        assert torch.equal(_bits(got[r : r + 1]), _bits(avx2_only.int5_gemv_avx2(x[r : r + 1], *_ops(m)))), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_bits(avx2_only.int5_gemm_avx2(x, *_ops(m))), _bits(rows))
    finally:
        torch.set_num_threads(threads)
    keep = [r for r in range(x.shape[0]) if r not in (3, 9)]
    want = (x[keep].double() @ m.dequantize_stored().double().t()).float()
    assert ((got[keep].float() - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all()
    monkeypatch.setattr(cpu_prompt, "INT5_ROWS", False)
    decoded = cpu_prompt.prompt_linear(m, x)
    assert decoded is not None and decoded.shape == got.shape
    assert ((decoded[keep].float() - want).abs() <= 2**-7 * want.abs() + 1e-4 * want.abs().max()).all()

