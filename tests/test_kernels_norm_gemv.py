"""A norm and the dense linear after it as one GEMV launch (kernels/triton/norm_gemv.py) equals its torch
reference (kernels.fused.norm_linear: the layer's unfused steps), under TRITON_INTERPRET=1 on the CPU and on
the GPU where present; a dense model on the Triton path takes it for qkv, gate_up (with the activation) and
the head at a few rows, and computes what the unfused path computes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch, fused  # noqa: E402

ng = sys.modules["superslm.kernels.triton.norm_gemv"]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(out: torch.Tensor, ref: torch.Tensor, act: str | None) -> None:
    """Equal but for the float32 sums' order: the linear's output one rounding apart (and what the activation
    makes of that)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        eps = torch.finfo(ref.dtype).eps
        scale = 4 if act else 1  # act(g) * u: an ulp of g and one of u, each rounded again
        torch.testing.assert_close(out.float(), ref.float(), atol=eps * scale * 0.05, rtol=eps * scale)


def operands(dtype: torch.dtype, dim: int, out: int, rows: int, add: bool, seed: int):
    g = gen(seed)
    x = (torch.randn(rows, dim, generator=g) * 2).to(DEV, dtype)
    res = (torch.randn(rows, dim, generator=g) * 4).to(DEV, dtype) if add else None
    nw = (1 + torch.randn(dim, generator=g) * 0.3).to(DEV, dtype)
    w = (torch.randn(out, dim, generator=g) / dim**0.5).to(DEV, dtype)
    return x, res, nw, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("weight_in_float", [False, True])
@pytest.mark.parametrize("act", [None, *fused.ACTIVATIONS])
# Qwen2.5-0.5B's qkv; sizes no tile divides; the 4 rows of the largest bucket that takes it
# fewer outputs than one program's: the residual's writer is the only program of its row
@pytest.mark.parametrize("dim,out,rows", [(896, 1152, 1), (200, 70, 3), (96, 2 * 48, 4), (40, 10, 2)])
def test_norm_linear(dtype, add, weight_in_float, act, dim, out, rows) -> None:
    if act is not None and out % 2:
        out += 1
    x, res, nw, w = operands(dtype, dim, out, rows, add, dim + rows)
    got, h = tk.norm_linear(x, res, nw, 1e-6, weight_in_float, w, act)
    want, want_h = fused.norm_linear(x.cpu(), None if res is None else res.cpu(), nw.cpu(), 1e-6, weight_in_float,
                                     w.cpu(), act)  # fmt: skip
    close(got.cpu(), want, act)
    if add:
        assert h is not None and want_h is not None and torch.equal(h.cpu(), want_h)  # x + r rounded once
    else:
        assert h is None and want_h is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("act", [None, *fused.ACTIVATIONS])
def test_exact_sums_give_the_reference_bit_for_bit(dtype, add, act) -> None:
    """Weights of +-1/16 and normed inputs of one magnitude: every float32 sum is exact in any order, so every
    rounding of the kernel (the norm's, the linear's, the activation's and the product's) must be the
    reference's."""
    g = gen(5)
    rows, dim, out = 3, 64, 2 * 40
    sign = torch.randint(0, 2, (rows, dim), generator=g) * 2 - 1
    x = (sign * (1 + torch.rand(rows, dim, generator=g))).to(DEV, dtype)
    res = (torch.rand(rows, dim, generator=g) * 0.5).to(DEV, dtype) if add else None
    nw = (0.5 + torch.rand(dim, generator=g)).to(DEV, dtype)
    w = ((torch.randint(0, 3, (out, dim), generator=g) - 1) / 16).to(DEV, dtype)
    for weight_in_float in (False, True):
        got, h = tk.norm_linear(x, res, nw, 1e-6, weight_in_float, w, act)
        want, _ = fused.norm_linear(x.cpu(), None if res is None else res.cpu(), nw.cpu(), 1e-6, weight_in_float,
                                    w.cpu(), act)  # fmt: skip
        assert torch.equal(got.cpu(), want)


def test_the_reference_is_the_unfused_steps() -> None:
    x, res, nw, w = operands(torch.bfloat16, 64, 96, 3, True, 1)
    y, h = fused.norm_linear(x, res, nw, 1e-5, False, w, "silu")
    normed, want_h = dispatch.add_rms_norm_reference(x, res, nw, 1e-5, False)
    assert torch.equal(h, want_h)
    assert torch.equal(y, fused.gated_act(torch.nn.functional.linear(normed, w), "silu"))
    y, h = fused.norm_linear(x, None, nw, 1e-5, True, w)
    assert h is None and torch.equal(y, torch.nn.functional.linear(fused.rms_norm(x, nw, 1e-5, True), w))


def test_operands_the_kernel_does_not_take_run_the_steps_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided row, 3-d rows: the norm kernel, torch's matmul and the activation kernel, with the reference's
    result."""
    launched: list[int] = []
    real = ng._norm_gemv_kernel

    class Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(1)
            return real[grid]

    monkeypatch.setattr(ng, "_norm_gemv_kernel", Spy())
    x, res, nw, w = operands(torch.bfloat16, 64, 96, 2, True, 2)
    wide = torch.cat([x, x], 1)[:, ::2]  # stride 2
    cases = [(wide, res, nw, w, "silu"), (x.view(1, 2, 64), res.view(1, 2, 64), nw, w, None)]
    for xi, ri, nwi, wi, act in cases:
        got, h = tk.norm_linear(xi, ri, nwi, 1e-6, False, wi, act)
        want, want_h = fused.norm_linear(xi.cpu(), None if ri is None else ri.cpu(), nwi.cpu(), 1e-6, False,
                                         wi.cpu(), act)  # fmt: skip
        close(got.cpu(), want, act)
        assert (h is None) == (want_h is None)
    assert launched == []
    tk.norm_linear(x, res, nw, 1e-6, False, w, "silu")
    assert launched == [1]


def test_rows_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.GEMV_ROWS_ENV, raising=False)
    assert dispatch.norm_gemv_rows() == dispatch.GEMV_ROWS_DEFAULT == 4
    monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, "0")
    assert dispatch.norm_gemv_rows() == 0
    for bad in ("-1", "four"):
        monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, bad)
        with pytest.raises(InvalidArgument, match=dispatch.GEMV_ROWS_ENV):
            dispatch.norm_gemv_rows()


# Llama fp32 (tokens equal); Qwen2 bf16 (qkv bias into prepare_qkv); Gemma-3 bf16 (float norms, post norms, gelu)
@pytest.mark.parametrize("family,dtype,graphs", [("llama", "fp32", False), ("qwen2", "bf16", True),
                                                 ("gemma3", "bf16", False), ("qwen3", "fp32", True)])  # fmt: skip
def test_a_dense_model_runs_its_norms_inside_the_gemvs(family, dtype, graphs, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the Triton path at <= 4 rows, each layer's qkv and gate_up (with the activation) and the head take the
    norm before them into their GEMV: two launches a layer and one a step instead of five and two; the
    logprobs are the unfused path's up to the sums' order, the tokens equal."""
    import superslm
    from superslm import Request, Sampling
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model(family, tmp_path, spec=two_layers(family))
    model = superslm.load(tmp_path, device=DEV, dtype=dtype)
    monkeypatch.setenv(dispatch.ENV, "triton")
    calls: dict[str, int] = {}
    for name in ("norm_linear", "rms_norm", "add_rms_norm", "gated_act"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls.get(_n, 0) + 1)
                            or _f(*a))  # fmt: skip
    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = {}
    for rows in (4, 0):
        monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, str(rows))
        calls.clear()
        engine = model.engine(slots=2, context=64, page_size=4, graphs=graphs)
        (done,) = engine.generate([Request(prompt, 6, Sampling(ignore_eos=True, logprobs=0))])
        out[rows] = (done, dict(calls))
    fused_calls, plain_calls = out[4][1], out[0][1]
    layers = len(model.net.layers)
    # a 7-row prompt step (unfused but its head's one row), five decode steps (a graph's first run twice)
    forwards = plain_calls["gated_act"] // layers
    decode, steps = forwards - 1, forwards
    assert decode == (6 if graphs else 5)
    assert "norm_linear" not in plain_calls
    assert fused_calls["norm_linear"] == 2 * layers * decode + steps  # qkv and gate_up; the head's
    assert plain_calls["gated_act"] - fused_calls.get("gated_act", 0) == layers * decode
    norms = sum(plain_calls.get(n, 0) - fused_calls.get(n, 0) for n in ("rms_norm", "add_rms_norm"))
    assert norms == 2 * layers * decode + steps
    assert out[4][0].tokens == out[0][0].tokens
    lp = [torch.tensor([p.logprob for p in out[r][0].logprobs]) for r in (4, 0)]
    tol = 1e-4 if dtype == "fp32" else 0.05
    torch.testing.assert_close(lp[0], lp[1], atol=tol, rtol=tol)
