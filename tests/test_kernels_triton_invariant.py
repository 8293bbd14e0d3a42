"""Deterministic mode on the Triton path: the batch-invariant attention kernel, row-invariant linears, and a
whole engine whose tokens and logprobs do not depend on the batch (under TRITON_INTERPRET=1 on the CPU, on the
GPU where present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, fixed_order_product, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

import superslm  # noqa: E402
from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.attention import AttnMetadata, paged_attention  # noqa: E402
from superslm.kernels.attention_invariant import paged_attention_invariant as invariant_ref  # noqa: E402
from superslm.kernels.row_blocks import by_row_blocks, pad_rows  # noqa: E402
from superslm.models import transformer  # noqa: E402
from superslm.models.transformer import _linear  # noqa: E402
from superslm.quant import Int4Linear, Int8Linear, quantize_linears  # noqa: E402
from tests.test_deterministic import _paged, run  # noqa: E402
from tests.test_engine import prompts  # noqa: E402
from tests.tiny_models import CONFIGS, build_hf_model  # noqa: E402


@pytest.mark.parametrize("dtype,groups", [(torch.float32, 3), (torch.bfloat16, 3), (torch.float32, 1)])
def test_invariant_kernel_ignores_the_rest_of_the_step(dtype: torch.dtype, groups: int) -> None:
    """A row gets the same bits in a mixed step (decodes, long and short chunks, windows that start mid-block),
    with its sequence alone, one token per step, and with padding rows; and stays close to the references."""
    kv, d, ps = 2, 32, 4
    heads = kv * groups
    lens, rows = [37, 5, 130, 70, 16, 90, 200], [1, 5, 40, 1, 9, 1, 1]
    tables, pos, slots, starts, nslots = _paged(lens, rows, ps, seed=7)
    g = torch.Generator().manual_seed(8)
    kc, vc = (torch.randn(nslots, kv, d, generator=g).to(DEV, dtype) for _ in range(2))
    q = torch.randn(len(pos), heads, d, generator=g).to(DEV, dtype)

    def meta(p, sl, st, ln, tb):
        return AttnMetadata(torch.tensor(p, device=DEV), torch.tensor(sl, device=DEV), tuple(st), tuple(ln),
                            tuple(tb), ps, deterministic=True)  # fmt: skip

    for window in (None, 6, 50):
        step = meta(pos, slots, starts, lens, tables)
        full = tk.paged_attention_invariant(q, kc, vc, step, window, d**-0.5)
        want = paged_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), step, window, d**-0.5)
        ref = invariant_ref(q.cpu(), kc.cpu(), vc.cpu(), step, window, d**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (full.cpu().float() - want.to(DEV).cpu()).abs().max() <= tol
        assert (full.cpu().float() - ref.float()).abs().max() <= tol
        padded = tk.paged_attention_invariant(torch.cat([q, q[:3]]), kc, vc, step, window, d**-0.5)
        assert torch.equal(padded[: len(pos)], full) and not padded[len(pos) :].any()
        for s, (a, b) in enumerate(zip(starts, starts[1:])):
            alone = meta(pos[a:b], slots[a:b], (0, b - a), (lens[s],), (tables[s],))
            assert torch.equal(tk.paged_attention_invariant(q[a:b], kc, vc, alone, window, d**-0.5), full[a:b])
            for r in range(a, b, 7):  # as if the prompt had been fed one token per step
                one = meta(pos[r : r + 1], slots[r : r + 1], (0, 1), (pos[r] + 1,), (tables[s],))
                got = tk.paged_attention_invariant(q[r : r + 1], kc, vc, one, window, d**-0.5)
                assert torch.equal(got, full[r : r + 1]), (window, s, r)


def test_deterministic_steps_dispatch_to_the_invariant_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, heads, d, ps = 2, 4, 16, 4
    tables, pos, slots, starts, nslots = _paged([20, 9], [6, 1], ps, seed=3)
    g = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(nslots, kv, d, generator=g).to(DEV) for _ in range(2))
    q = torch.randn(len(pos), heads, d, generator=g).to(DEV)
    step = AttnMetadata(torch.tensor(pos, device=DEV), torch.tensor(slots, device=DEV), tuple(starts), (20, 9),
                        tuple(tables), ps, deterministic=True)  # fmt: skip
    want = tk.paged_attention_invariant(q, kc, vc, step, None, 0.25)
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert torch.equal(dispatch.paged_attention(q, kc, vc, step, None, 0.25), want)
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert torch.equal(dispatch.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), step, None, 0.25),
                       invariant_ref(q.cpu(), kc.cpu(), vc.cpu(), step, None, 0.25))  # fmt: skip


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rotate", [None, 3])
def test_triton_linears_take_16_rows_a_program(fmt: str, rotate: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton int4/int8 kernels pick their tiles by the row count (a GEMV up to 4 rows, then 16- or
    64-row tiles), so they are not row-invariant. Deterministic mode runs them with 16 rows per program in
    one launch: a row's bits are those of its 16-row block alone (`by_row_blocks`, a launch per block),
    whatever the row count. torch's packed CPU kernels are row-invariant. (Under the interpreter a GEMV and
    a GEMM seldom round a bf16 output differently: the kernel's calls show the rule.)"""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 256, generator=g)
    opts = {"rotate": rotate} if rotate is not None else {}
    lin = Int4Linear.from_dense(w, group=32, **opts) if fmt == "int4" else Int8Linear.from_dense(w, **opts)
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert lin.row_invariant == (rotate is None)
    monkeypatch.setenv(dispatch.ENV, "triton")
    lin = lin.to(DEV)
    assert not lin.row_invariant
    name = f"{fmt}_matmul"
    kernel, calls = getattr(dispatch, name), []

    def counted(x: torch.Tensor, *args) -> torch.Tensor:
        weight = 4 if fmt == "int4" else 2  # (qweight, scale, zero, group) or (codes, scale), then tile_rows
        calls.append((x.shape[0], args[weight] if len(args) > weight else None))
        return kernel(x, *args)

    monkeypatch.setattr(dispatch, name, counted)
    x = torch.randn(40, 256, generator=g).to(DEV, torch.bfloat16)
    alone = torch.cat([_linear(lin, x[i : i + 1], True) for i in range(len(x))])
    for n in (2, 5, 17, 40):
        calls.clear()
        got = _linear(lin, x[:n], True)
        assert calls == [(-(-n // 16) * 16, 16)]
        assert torch.equal(got, alone[:n]), n
        assert torch.equal(got, by_row_blocks(lin, x[:n])), n  # the same bits as a call per 16-row block
    if rotate is not None:  # an input rotated by the caller's kernel (`forward_rotated`)
        h = lin.prepare_input(x)
        want = by_row_blocks(lambda r: lin.forward_rotated(r, torch.float32), h)
        assert torch.equal(_linear(lin, h, True, torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_kernel_rows_do_not_depend_on_the_call(dtype: torch.dtype) -> None:
    """The fixed-tile dense GEMM: a row's bits are the same alone, at any place in a call of any size, with or
    without a bias, and close to F.linear (shapes no tile divides: 100 outputs, 70 inputs)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(100, 70, generator=g).to(DEV, dtype)
    b = torch.randn(100, generator=g).to(DEV)
    x = torch.randn(37, 70, generator=g).to(DEV, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for bias in (None, b):
        full = tk.dense_matmul(x, w, bias)
        want = torch.nn.functional.linear(x.float(), w.float(), bias)
        assert (full.float() - want).abs().max() <= tol * want.abs().max()
        assert torch.equal(_rows_alone(lambda r, bias=bias: tk.dense_matmul(r, w, bias), x), full)
        assert torch.equal(tk.dense_matmul(x[5:22], w, bias), full[5:22])
        assert torch.equal(tk.dense_matmul(x.view(1, 37, 70), w, bias), full.view(1, 37, 100))
    assert tk.dense_matmul(x[:0], w).shape == (0, 100)
    assert torch.equal(tk.dense_matmul(x[:, :0], w[:, :0], b).float(), b.to(dtype).float().expand(37, 100))
    with pytest.raises(InvalidArgument):
        tk.dense_matmul(x, w.float() if dtype != torch.float32 else w.double())
    with pytest.raises(InvalidArgument):
        tk.dense_matmul(x, w, b, tile_rows=8)
    # the reference: F.linear 16 rows a call
    wc, bc = w.cpu(), b.cpu().to(dtype)
    want = torch.cat([torch.nn.functional.linear(r, wc, bc) for r in pad_rows(x.cpu(), 16).split(16)])
    assert torch.equal(dispatch.dense_matmul_reference(x.cpu(), wc, bc), want[:37])


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    """fn of each row of x in a call of its own, stacked: the rows a batch-invariant fn gives in one call."""
    return torch.cat([fn(x[i : i + 1]) for i in range(len(x))])


def _dense_split_by_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dense kernel with its K step chosen by the row count (long steps for a GEMV, short for a GEMM), as
    a kernel tuned per shape would: a row's sums then run in another order alone than in a larger call."""
    from superslm.kernels.triton.dense_gemm import BLOCK_N, _dense_kernel

    m, n, k = x.shape[0], w.shape[0], x.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _dense_kernel[(-(-n // BLOCK_N), -(-m // 16))](
        x, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=False, BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=64 if m <= 4 else 16, F32_DOT=True,
    )  # fmt: skip
    return out


def test_the_invariance_check_catches_a_kernel_that_tiles_by_the_row_count() -> None:
    """The check of test_dense_kernel_rows_do_not_depend_on_the_call fails on a kernel whose reduction order
    depends on the row count; under the interpreter tl.dot is the fixed-order product, so that failure (and
    the real kernels' pass) comes from the kernel's own order, not from the BLAS numpy runs on."""
    if not ON_GPU:
        from triton.runtime.interpreter import InterpreterBuilder

        assert getattr(InterpreterBuilder.create_dot, "fixed_order", False)
    g = torch.Generator().manual_seed(12)
    w = torch.randn(100, 70, generator=g).to(DEV)
    x = torch.randn(37, 70, generator=g).to(DEV)
    full = _dense_split_by_rows(x, w)
    assert (full - torch.nn.functional.linear(x, w)).abs().max() <= 1e-4
    assert not torch.equal(_rows_alone(lambda r: _dense_split_by_rows(r, w), x), full)
    assert torch.equal(_rows_alone(lambda r: tk.dense_matmul(r, w), x), tk.dense_matmul(x, w))


def test_the_fixed_order_product_gives_a_row_the_same_bits_anywhere() -> None:
    """The interpreter's tl.dot stand-in: a row's result is the same alone, at any place in any row count and
    under a batch axis, and within float32 rounding of numpy's matmul."""
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((37, 70), np.float32), rng.standard_normal((70, 20), np.float32)
    full = fixed_order_product(a, b, np.float32)
    assert full.dtype == np.float32
    assert np.abs(full - (a.astype(np.float64) @ b.astype(np.float64))).max() <= 1e-5
    for i in range(len(a)):
        assert np.array_equal(fixed_order_product(a[i : i + 1], b, np.float32), full[i : i + 1])
    padded = np.concatenate([np.zeros((5, 70), np.float32), a, a[:3]])
    assert np.array_equal(fixed_order_product(padded, b, np.float32)[5:42], full)
    batched = fixed_order_product(np.stack([a, a[::-1]]), np.stack([b, b]), np.float32)
    assert np.array_equal(batched[0], full) and np.array_equal(batched[1], full[::-1])


def test_deterministic_dense_linears_take_one_launch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic mode's dense linears on the Triton path (Qwen2's qkv with its bias included) are one launch
    of 16-row tiles, not a cuBLAS call per 16 rows; the default mode adds the qkv bias in prepare_qkv after one
    matmul over every row."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    build_hf_model("qwen2", tmp_path)
    model = superslm.load(tmp_path, device=DEV, dtype="fp32", quant=None)
    assert model.net.layers[0].qkv.bias is not None
    rows: list[tuple[str, int]] = []
    linear, dense = torch.nn.functional.linear, dispatch.dense_matmul

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(("linear", x.shape[0]))
        return linear(x, w, b)

    def counted_dense(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, t: int = 16) -> torch.Tensor:
        rows.append(("dense", x.shape[0], b is not None))
        return dense(x, w, b, t)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    monkeypatch.setattr(dispatch, "dense_matmul", counted_dense)
    monkeypatch.setattr(transformer, "dense_matmul", counted_dense)
    want = {True: [("dense", 32, True), ("dense", 32, False), ("dense", 32, False)],  # rows padded to 16s
            False: [("linear", 27)] * 3}  # fmt: skip
    for deterministic in (True, False):
        rows.clear()
        engine = model.engine(slots=2, context=64, deterministic=deterministic, graphs=False)
        engine.add(superslm.Request(list(range(5, 25)), 1, superslm.Sampling(ignore_eos=True)))
        engine.add(superslm.Request(list(range(7, 14)), 1, superslm.Sampling(ignore_eos=True)))
        engine.advance()
        assert rows[:3] == want[deterministic], rows  # the first layer's qkv, o, gate_up


@pytest.mark.slow
def test_engine_tokens_and_logprobs_are_bit_identical(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_deterministic's contract on the Triton path: Gemma 3 (sliding windows) with an int4 body and an int8
    head, unrotated as a GGUF file's blocks load, so every linear is a Triton GEMV at few rows and a GEMM at
    more; few short prompts: the interpreter runs every program in Python."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    # two layers, one of each kind (a sliding window, then full attention): every layer runs the same kernels
    cls, kw = CONFIGS["gemma3"]
    build_hf_model("gemma3", tmp_path, spec=(cls, dict(kw, num_hidden_layers=2,
                                                        layer_types=["sliding_attention", "full_attention"])))
    model = superslm.load(tmp_path, device=DEV, dtype="bf16", quant=None)
    assert [layer.window for layer in model.net.layers] == [6, None]
    quantize_linears(model.net, "int4", "int8", group=32, rotate=False)
    assert model.net.has_head and isinstance(model.net.head, Int8Linear)
    ps = prompts(3, seed=23, lo=4, hi=12)
    alone = [run(model, [p], slots=1, tokens=4)[0] for p in ps]
    assert run(model, ps, tokens=4) == alone
    assert run(model, ps, chunk=5, tokens=4) == alone
