"""A rotated int4 linear's input made inside its GEMV (kernels/triton/rotate_gemv.py) equals its torch reference
(kernels.fused.norm_rotate_int4, gated_act_rotate_int4: the layer's unfused steps), under TRITON_INTERPRET=1 on
the CPU and on the GPU where present; a rotated int4 model on the Triton path runs one launch where it ran the
norm or activation kernel and the GEMV, at a few rows, and computes what the unfused path computes.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch, fused  # noqa: E402
from superslm.kernels.hadamard import hadamard_matrix, random_signs  # noqa: E402
from superslm.kernels.triton.hadamard import fwht_rows  # noqa: E402

rg = sys.modules["superslm.kernels.triton.rotate_gemv"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_weight(n: int, k: int, group: int, seed: int) -> fused.Int4Weight:
    g = gen(seed)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=g) * 0.02).to(torch.bfloat16)
    return fused.Int4Weight(qweight.to(DEV), scale.to(DEV), zero.to(DEV), group)


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for the order of float32 sums: one rounding of the output apart, relative to the row's scale (a
    GEMV's output near zero is a difference of large partial sums)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = 1e-6 if ref.dtype == torch.float32 else torch.finfo(ref.dtype).eps
    scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    assert ((out.float() - ref.float()).abs() <= eps * scale).all(), (out.float() - ref.float()).abs().max()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The fused kernel's launches (their `gated` flags)."""
    seen: list[bool] = []
    real = rg._launch
    monkeypatch.setattr(rg, "_launch", lambda *a: seen.append(a[9]) or real(*a))
    return seen


@functools.cache
def _butterflies():  # type: ignore[no-untyped-def]
    """A kernel rotating one tile by `fwht_rows`; decorated while the fixture has TRITON_INTERPRET set."""

    @triton.jit
    def kernel(x_ptr, f_ptr, R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
        c = tl.arange(0, R)[:, None] * B + tl.arange(0, B)[None, :]
        tl.store(f_ptr + c, fwht_rows(tl.load(x_ptr + c), R, B, LOG_B))

    return kernel


def test_butterflies_are_the_hadamard_matrix() -> None:
    """`fwht_rows` computes v · H_b with the Sylvester matrix H_b's ±1 entries, for every block size."""
    for rows, block in ((16, 128), (4, 64), (1, 16), (8, 8), (2, 2), (1, 1)):
        # small integers: every sum is exact in any order
        x = torch.randint(-8, 9, (rows, block), generator=gen(block)).float().to(DEV)
        f = torch.empty_like(x)
        _butterflies()[(1,)](x, f, rows, block, block.bit_length() - 1)
        h = (hadamard_matrix(block).double() * block**0.5).round()
        assert torch.equal(f.cpu().double(), x.cpu().double() @ h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float16: as bf16 (test_kernels_rotate.py)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("weight_in_float", [False, True])
@pytest.mark.parametrize("float_weight", [False, True])  # a float32 norm weight: Llama's product promotes
# Qwen2.5-0.5B's qkv; SmolLM2's 576 padded to 640 (groups of 32); blocks of 8 and fewer outputs than one
# program's (the residual's writer is the only program of its row); a row of two prologue steps (2176 inputs);
# the 4 rows of the largest bucket that fuses
@pytest.mark.parametrize("dim,k,block,group,n,rows",
                         [(896, 896, 128, 128, 36, 1), (576, 640, 128, 32, 24, 3), (40, 48, 8, 16, 6, 2),
                          (2100, 2176, 128, 128, 70, 1), (128, 128, 64, 64, 9, 4)])  # fmt: skip
def test_norm_rotate_int4(dtype, add, weight_in_float, float_weight, dim, k, block, group, n, rows,
                          launches) -> None:  # fmt: skip
    g = gen(dim + rows)
    x = (torch.randn(rows, dim, generator=g) * 2).to(DEV, dtype)
    res = (torch.randn(rows, dim, generator=g) * 4).to(DEV, dtype) if add else None
    nw = (1 + torch.randn(dim, generator=g) * 0.3).to(DEV, torch.float32 if float_weight else dtype)
    signs = random_signs(k, seed=dim).to(DEV)
    w4 = int4_weight(n, k, group, seed=n)
    lin_dtype = torch.float32 if dtype == torch.float32 and float_weight else torch.bfloat16
    out, h = tk.norm_rotate_int4(x, res, nw, 1e-6, weight_in_float, signs, block, lin_dtype, w4)
    assert launches == [False]
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (x, res, nw, signs)]
    w4_cpu = fused.Int4Weight(*(t.cpu() for t in w4[:3]), group)
    want, want_h = fused.norm_rotate_int4(*cpu[:3], 1e-6, weight_in_float, cpu[3], block, lin_dtype, w4_cpu)
    close(out.cpu(), want)
    assert (h is None) == (not add) and (h is None or torch.equal(h.cpu(), want_h))
    # the unfused kernels' result: the same steps, the same roundings
    xr, _ = tk.norm_rotate(x, res, nw, 1e-6, weight_in_float, signs, block, lin_dtype)
    close(out, tk.int4_matmul(xr, *w4))


@pytest.mark.parametrize("act", fused.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Qwen2.5-0.5B-like down (4864 -> three prologue steps); 600 inputs padded to 640; blocks of 8
@pytest.mark.parametrize("inter,k,block,group,n,rows",
                         [(4864, 4864, 128, 128, 12, 1), (600, 640, 128, 64, 30, 2),
                          (40, 48, 8, 16, 6, 4)])  # fmt: skip
def test_gated_act_rotate_int4(act, dtype, inter, k, block, group, n, rows, launches) -> None:
    gate_up = (torch.randn(rows, 2 * inter, generator=gen(inter)) * 2).to(DEV, dtype)
    signs = random_signs(k, seed=inter).to(DEV)
    w4 = int4_weight(n, k, group, seed=n)
    out = tk.gated_act_rotate_int4(gate_up, act, signs, block, torch.bfloat16, w4)
    assert launches == [True]
    w4_cpu = fused.Int4Weight(*(t.cpu() for t in w4[:3]), group)
    close(out.cpu(), fused.gated_act_rotate_int4(gate_up.cpu(), act, signs.cpu(), block, torch.bfloat16, w4_cpu))
    close(out, tk.int4_matmul(tk.gated_act_rotate(gate_up, act, signs, block, torch.bfloat16), *w4))


def test_operands_the_fused_kernel_does_not_take_run_the_two_kernels(launches) -> None:
    """More rows than the GEMV's, a strided row, groups whose bytes are not a power of two: the norm or
    activation kernel, then the int4 kernel, with the same result as the reference. Bad shapes raise."""
    g = gen(5)
    signs = random_signs(96, seed=1).to(DEV)
    nw = torch.ones(96, device=DEV)
    w4 = int4_weight(10, 96, 32, seed=2)
    for x in (torch.randn(5, 96, generator=g).to(DEV), torch.randn(2, 192, generator=g).to(DEV)[:, ::2]):
        out, _ = tk.norm_rotate_int4(x, None, nw, 1e-6, False, signs, 32, torch.float32, w4)
        want, _ = fused.norm_rotate_int4(x.cpu(), None, nw.cpu(), 1e-6, False, signs.cpu(), 32, torch.float32,
                                         fused.Int4Weight(*(t.cpu() for t in w4[:3]), 32))  # fmt: skip
        close(out.cpu(), want)
    w4_odd = int4_weight(10, 96, 48, seed=3)  # 24 bytes a group
    gu = torch.randn(1, 192, generator=g).to(DEV)
    out = tk.gated_act_rotate_int4(gu, "silu", signs, 32, torch.float32, w4_odd)
    cpu_w4 = fused.Int4Weight(*(t.cpu() for t in w4_odd[:3]), 48)
    close(out.cpu(), fused.gated_act_rotate_int4(gu.cpu(), "silu", signs.cpu(), 32, torch.float32, cpu_w4))
    assert launches == []
    with pytest.raises(InvalidArgument):  # the weight's inputs are not the rotation's
        tk.gated_act_rotate_int4(gu, "silu", signs, 32, torch.float32, int4_weight(10, 64, 32, seed=4))
    with pytest.raises(InvalidArgument):  # 64 does not divide 96
        tk.norm_rotate_int4(torch.randn(1, 96, device=DEV), None, nw, 1e-6, False, signs, 64, torch.float32, w4)
    assert launches == []


# Qwen2: qkv bias, bf16, SiLU; Llama in float32: the norm's output (float32) is not the linear's dtype (bf16)
@pytest.mark.slow
@pytest.mark.parametrize("family,dtype", [("qwen2", "bf16"), ("llama", "fp32")])
def test_a_rotated_int4_model_runs_its_inputs_inside_the_gemvs(family, dtype, tmp_path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Re-quantized to rotated int4 on the Triton path: each decode step's qkv and gate_up take their norm,
    and down its activation, inside their GEMV (the prompt step, 7 rows, runs them apart); tokens and logprobs
    are those of SUPERSLM_NORM_GEMV_ROWS=0 (bit for bit under the interpreter)."""
    import superslm
    from superslm import Request, Sampling
    from superslm.quant.int4 import Int4Linear
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model(family, tmp_path, spec=two_layers(family))
    model = superslm.load(tmp_path, device=DEV, dtype=dtype, quant="int4")
    if not ON_GPU:
        for layer in model.net.layers:
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
                assert isinstance(m, Int4Linear) and m.rotation is not None
                m._relayout("nibbles")  # what a GPU holds
    monkeypatch.setenv(dispatch.ENV, "triton")
    calls: dict[str, int] = {}
    for name in ("norm_rotate", "gated_act_rotate", "norm_rotate_int4", "gated_act_rotate_int4"):
        real = getattr(tk, name)
        spy = lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls.get(_n, 0) + 1) or _f(*a)  # noqa: E731
        monkeypatch.setattr(tk, name, spy)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = {}
    for rows in ("4", "0"):
        monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, rows)
        calls.clear()
        engine = model.engine(slots=2, context=64, page_size=4, graphs=False)
        (done,) = engine.generate([Request(prompt, 4, Sampling(ignore_eos=True, logprobs=0))])
        out[rows] = (done, dict(calls))
    layers, decode = len(model.net.layers), 3  # a prompt step and three decode steps
    assert out["4"][1] == {"norm_rotate": 2 * layers, "gated_act_rotate": layers,
                           "norm_rotate_int4": 2 * layers * decode, "gated_act_rotate_int4": layers * decode}
    assert out["0"][1] == {"norm_rotate": 2 * layers * (1 + decode), "gated_act_rotate": layers * (1 + decode)}
    assert out["4"][0].tokens == out["0"][0].tokens
    lp = [torch.tensor([p.logprob for p in out[r][0].logprobs]) for r in ("4", "0")]
    if ON_GPU:  # the same products; a sum's order may differ in the last bit
        torch.testing.assert_close(lp[0], lp[1], atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(lp[0], lp[1])
