"""GGUF Q6_K weights as they are (quant/q6k.py, kernels/cpu/q6k.cpp): the file's values bit for bit (random
blocks and llama.cpp's own), the kernels against their torch twin and a float64 reference, the module's fallbacks,
the mapping, and a llama.cpp-quantized model against llama.cpp."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from benchmarks.q6k_decode import quantize_q6k
from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import Q4_K, Q6_K
from superslm.quant import load_linear
from superslm.quant.dense import Int8Linear
from superslm.quant.gguf_map import NEAREST, linear_from_gguf, nearest_format, q6k_runs
from superslm.quant.q6k import GEMV_ROWS, GGUFQ6KLinear, q6k_dequantize, q6k_gemv, q6k_matmul, quantize_blocks
from tests.test_gguf import _quantize_with_llama_cpp, last_logits_beside_llama_cpp, tiny_llama_f32  # noqa: F401

U = 2.0**-8


def q6k_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a weight [n, k]: every code and scale bit pattern, finite f16 d of many sizes."""
    rng = np.random.default_rng(seed)
    m = n * k // 256
    raw = rng.integers(0, 256, (m, 210), dtype=np.uint8)
    d = (rng.standard_normal((m, 1)) * 10.0 ** rng.integers(-6, -1, (m, 1))).astype(np.float16)
    raw[:, 208:210] = d.view(np.uint8)
    return raw.reshape(-1)


def block_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over blocks of 256 of max|x| over the block times sum |w| over it [M, N]: the GEMV's int8 x moves an
    element by at most max|x| / 254 (half its step, at most max|x| / 127), so a product by at most this / 254."""
    m, k = x.shape
    xmax = x.double().abs().view(m, k // 256, 256).amax(-1)  # [M, blocks]
    wsum = w.double().abs().view(w.shape[0], k // 256, 256).sum(-1)  # [N, blocks]
    return xmax @ wsum.t()


def gemv_tol(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """How far the GEMV of rows x [M, K] may be from the float64 product ref [M, N]: x's int8 rounding, float32
    sums of k / 256 + 3 terms after each block's lanes are rounded to float (d * dx rounded once, one fma a block,
    the lanes' reduction), and the output's bf16 rounding of all that."""
    k = x.shape[1]
    act = block_bound(x, w) / 254
    floats = 1.01 * (k // 256 + 5) * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) * (1 + 1 / 127)
    return U * (ref.abs() + act + floats) + act + floats


def needs_kernels() -> None:
    if not q6k_runs():
        pytest.skip("no C++ Q6_K kernels here: Q6_K becomes int8")


def test_the_weight_is_the_files_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 70, 768
    raw = q6k_blocks(n, k, seed=3)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    ref = quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q6_K).reshape(n, k)
    monkeypatch.setattr("superslm.quant.q6k.ROWS", 16)  # rows copied in blocks, the file's pages released between
    released = []
    m = GGUFQ6KLinear.from_gguf_parts([(raw, Q6_K, (n, k), perm)], release=lambda: released.append(1))
    assert len(released) == 5
    assert "Q6_K" in m.describe() and m.nbytes() == n * k // 256 * 210
    got = m.dequantize().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(ref[perm.numpy()]).view(np.uint32))
    # fused parts (a q, k, v of Q6_K): each part's rows in its own place, its own permutation
    m2 = GGUFQ6KLinear.from_gguf_parts([(raw, Q6_K, (n, k), None), (raw, Q6_K, (n, k), perm)])
    both = m2.dequantize().numpy()
    np.testing.assert_array_equal(both[:n].view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(both[n:].view(np.uint32), got.view(np.uint32))
    with pytest.raises(InvalidArgument):
        GGUFQ6KLinear.from_gguf_parts([(raw, Q6_K, (n, k), None), (raw[: n * 3 * 210], Q6_K, (n, 512), None)])
    ext = cext.extension()
    if ext is not None:
        again = ext.q6k_dequantize(m.blocks).numpy()
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))
    with pytest.raises(InvalidArgument):
        GGUFQ6KLinear.from_gguf(raw, Q4_K, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFQ6KLinear.from_gguf(raw[:-1], Q6_K, (n, k))
    with pytest.raises(InvalidArgument):
        GGUFQ6KLinear.from_gguf(raw, Q6_K, (n, k), row_perm=torch.zeros(n, dtype=torch.long))
    # the test's quantizer writes valid blocks: the weight comes back within its steps
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = quants.dequantize(quantize_q6k(w).reshape(8, -1), GGMLQuantizationType.Q6_K).reshape(8, 512)
    assert np.abs(back - w).max() <= np.abs(w).max() / 32


@pytest.mark.parametrize("shape", [(64, 256), (100, 768), (37, 1280)])  # 1, 3 and 5 blocks a row
def test_kernels_against_their_twin_and_the_weight(shape) -> None:
    needs_kernels()
    ext = cext.extension()
    n, k = shape
    blocks = GGUFQ6KLinear.from_gguf(q6k_blocks(n, k, seed=n), Q6_K, shape).blocks
    w = q6k_dequantize(blocks)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 3, 4, 5, 9, GEMV_ROWS, GEMV_ROWS + 3):
        x = torch.randn(rows, k, generator=g).bfloat16()
        x[:, :32] *= 50  # a block with a far larger value than the others: each block gets its own int8 step
        ref = x.double() @ w.double().t()
        # float32 sums of k terms (k 2^-24 of sum |w x| at most), then the bf16 rounding of the output
        float_tol = U * ref.abs() + 1.01 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        twin = q6k_matmul(x, blocks).double()
        assert ((twin - ref).abs() <= float_tol).all()
        gemm = ext.q6k_gemm(x, blocks, False)
        assert gemm.dtype == torch.bfloat16 and gemm.shape == (rows, n)
        assert ((gemm.double() - ref).abs() <= float_tol).all()
        det = ext.q6k_gemm(x, blocks, True)  # deterministic mode: each row the bits of 16-row products
        for r in (0, rows - 1):
            alone = ext.q6k_gemm(x[r : r + 1], blocks, True)
            assert torch.equal(alone.view(torch.int16), det[r : r + 1].view(torch.int16))
        if rows > GEMV_ROWS:
            continue
        y = ext.q6k_gemv(x, blocks)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        assert torch.equal(y.view(torch.int16), q6k_gemv(x, blocks).view(torch.int16))
        assert ((y.double() - ref).abs() <= gemv_tol(x, w, ref)).all()
        for r in range(rows):  # a row's bits are those it gets alone, whatever rows come with it
            assert torch.equal(ext.q6k_gemv(x[r : r + 1], blocks).view(torch.int16), y[r : r + 1].view(torch.int16))
    odd = torch.randn(4, k, generator=g).bfloat16()
    odd[0, 1] = float("nan")
    odd[1, 5] = float("inf")  # no int8 step for it: that row takes the float32 product
    odd[2, 5] = 3e4  # an outlier: its own block's step is coarse, the other blocks keep theirs
    odd[3, :256] = 0  # an all-zero block
    y = ext.q6k_gemv(odd, blocks)
    assert torch.isnan(y[0]).all()
    # the rows with a NaN or an inf go through one float32 product together (inf times a zero weight: NaN)
    assert torch.equal(y[:2].view(torch.int16), ext.q6k_gemm(odd[:2], blocks, False).view(torch.int16))
    assert torch.equal(y.view(torch.int16)[1:], q6k_gemv(odd, blocks).view(torch.int16)[1:])
    assert torch.isnan(q6k_gemv(odd, blocks)[0]).all()
    ref = odd[2:].double() @ w.double().t()
    assert ((y[2:].double() - ref).abs() <= gemv_tol(odd[2:], w, ref)).all()
    with pytest.raises(RuntimeError, match="blocks uint8"):
        ext.q6k_gemv(odd, blocks[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.q6k_gemv(odd[:, :128], blocks)
    with pytest.raises(InvalidArgument):
        q6k_gemv(odd[:, :128], blocks)


def test_activation_rounding() -> None:
    """The twin's int8 x: per 256 values dx = max|x| / 127, per 32 a step dx * m / 16 (m = ceil(16 max|x_g| /
    max|x|)), q = x / step rounded half to even, |q| <= 127, and the sums per 16 times m."""
    x = torch.zeros(1, 512)
    x[0, :5] = torch.tensor([127.0, -63.5, 0.5, 1.5, -2.5])
    x[0, 20] = 3.0
    x[0, 32:34] = torch.tensor([7.5, -1.0])  # group 1: max 7.5 of 127 -> m = ceil(0.945) = 1, step 1/16
    x[0, 64] = 100.0  # group 2: m = ceil(12.6) = 13, step 13/16
    q, m, bsm, dxs = quantize_blocks(x)
    assert dxs.tolist() == [[1 / 16, 0.0]] and m[0, :3].tolist() == [16, 1, 13] and (m[0, 8:] == 16).all()
    assert q[0, :5].tolist() == [127, -64, 0, 2, -2] and not q[0, 256:].any()
    assert q[0, 32:34].tolist() == [120, -16] and q[0, 64].item() == round(100 * 16 / 13)
    assert bsm[0, :5].tolist() == [(127 - 64 + 2 - 2) * 16, 3 * 16, 120 - 16, 0, 123 * 13] and bsm.shape == (1, 32)


def test_deterministic_concat_gives_its_q6k_part_the_plans_tiles() -> None:
    """A fused linear of Q4_K and Q6_K parts (Qwen3.5's qkv) in deterministic mode: each part by its own rule, the
    Q6_K part's rows those of the C++ plan's deterministic q6k_gemm (16-row tiles), not its GEMV's, whatever the
    row count."""
    if not q6k_runs():
        pytest.skip("no Q6_K kernels: Q6_K runs as int8")
    from superslm.quant.gguf_map import ConcatLinear
    from tests.test_quant import gguf_bytes

    k = 512
    q4 = gguf_bytes(Q4_K, np.zeros((64, k), np.float32))  # random valid Q4_K blocks (gguf-py cannot quantize it)
    m = linear_from_gguf([(q4, Q4_K, (64, k), None), (q6k_blocks(32, k, seed=4), Q6_K, (32, k), None)])
    assert isinstance(m, ConcatLinear) and isinstance(m.parts[1], GGUFQ6KLinear)
    x = torch.randn(37, k).bfloat16()
    det = m.forward_row_blocks(x)
    want6 = cext.extension().q6k_gemm(x, m.parts[1].blocks, True)
    assert torch.equal(det[:, 64:].view(torch.int16), want6.view(torch.int16))
    assert not torch.equal(det[:, 64:], m.parts[1](x))  # the GEMV's bits differ: the rule matters
    assert torch.equal(det[:, :64], m.parts[0].forward_row_blocks(x) if not m.parts[0].row_invariant
                       else m.parts[0](x))
    for rows in (1, 3, 16, 20):
        assert torch.equal(m.forward_row_blocks(x[:rows]), det[:rows]), rows


def test_module_maps_runs_saves_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 96, 512
    raw_q = q6k_blocks(n, k, seed=1)
    raw_k = q6k_blocks(32, k, seed=2)
    bias = torch.randn(n + 32)
    if not q6k_runs():
        assert isinstance(linear_from_gguf([(raw_q, Q6_K, (n, k), None)]), Int8Linear)
        return
    assert nearest_format(Q6_K) == ("gq6k", {})
    with pytest.raises(InvalidArgument):
        nearest_format(Q4_K, {"Q4_K": ("gq6k", {})})
    m = linear_from_gguf([(raw_q, Q6_K, (n, k), None), (raw_k, Q6_K, (32, k), None)], bias)
    assert isinstance(m, GGUFQ6KLinear) and m.out_features == n + 32
    w = m.dequantize()
    x = torch.randn(GEMV_ROWS + 4, k).bfloat16()
    xw = x.double() @ w.double().t()
    ref = xw + bias.double()
    for rows in (1, 4, GEMV_ROWS, GEMV_ROWS + 4):  # the GEMV up to GEMV_ROWS rows, the float32 GEMM past them
        y = m(x[:rows])
        assert y.dtype == torch.bfloat16
        r, p = ref[:rows], xw[:rows]
        floats = 1.01 * k * 2.0**-24 * (x[:rows].double().abs() @ w.double().abs().t())
        slack = gemv_tol(x[:rows], w, p) if rows <= GEMV_ROWS else floats
        assert ((y.double() - r).abs() <= U * (p.abs() + r.abs()) + (1 + U) * slack).all()
    # deterministic mode: 16-row float32 products at every row count, the C++ plan's bits (q6k_gemm rows16)
    det = m.forward_row_blocks(x)
    assert torch.equal(det[:3], m.forward_row_blocks(x[:3]))
    want = (cext.extension().q6k_gemm(x, m.blocks, True).float() + m.bias).bfloat16()
    assert torch.equal(det.view(torch.int16), want.view(torch.int16))
    m.to(torch.bfloat16)  # .to(bf16) on a model leaves the bytes alone
    assert torch.equal(m.dequantize(), w)
    tensors, meta = m.to_tensors()
    again = load_linear(tensors, meta)
    assert isinstance(again, GGUFQ6KLinear) and torch.equal(again.dequantize(), w)
    assert torch.equal(again(x), m(x))
    # no kernels (a folder read on another machine): a bf16 dense copy, each weight rounded once
    monkeypatch.setattr("superslm.quant.q6k.q6k_kernels", lambda: None)
    assert again.plan_args() is None
    y = again(x).double()
    assert ((y - ref).abs() <= U * (x.double().abs() @ w.double().abs().t() + xw.abs() + ref.abs())).all()
    monkeypatch.undo()
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    assert isinstance(linear_from_gguf([(raw_q, Q6_K, (n, k), None)]), Int8Linear)


@pytest.mark.slow  # fetches llama-cpp-python's source distribution from PyPI once
@pytest.mark.parametrize("ftype", ["Q6_K", "Q4_K_M"])
def test_llama_cpp_files_load_and_answer_as_llama_cpp(ftype: str, tiny_llama_f32: Path,  # noqa: F811
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp writes a Q6_K (or a Q4_K_M, whose head and some attn_v / ffn_down are Q6_K) file: its Q6_K
    tensors read back bit for bit, its linears run as gq6k, its logits follow llama.cpp's own on the same file,
    and greedy decoding picks the tokens the int8 re-quantization picked before."""
    pytest.importorskip("llama_cpp")
    needs_kernels()
    import superslm
    from tests.tiny_models import SingleSequence

    out = tmp_path / f"{ftype}.gguf"
    _quantize_with_llama_cpp(tiny_llama_f32, out, ftype)
    reader = gguf.GGUFReader(out)
    q6 = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q6_K and t.data.ndim == 2]
    assert q6, {t.tensor_type.name for t in reader.tensors}
    for t in q6:
        n, k = (int(d) for d in t.shape[::-1])
        ref = quants.dequantize(np.asarray(t.data), GGMLQuantizationType.Q6_K).reshape(n, k)
        got = GGUFQ6KLinear.from_gguf(np.asarray(t.data).reshape(-1), Q6_K, (n, k)).dequantize().numpy()
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    model = superslm.load(out)
    linears = model.info()["linears"]
    assert any("Q6_K (6-bit g16)" in key for key in linears), linears
    tokens = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, dense, theirs = last_logits_beside_llama_cpp(out, model, tokens)
    assert int(dense.argmax()) == int(theirs.argmax())
    # ours: Q6_K with llama.cpp's 8-bit activations per 256, the other types as before (bf16 activations): a near
    # tie may swap, so llama.cpp must rank our choice within a quarter of its logits' deviation of its own top
    assert theirs[int(ours.argmax())] >= theirs.max() - 0.25 * theirs.std()
    for got in (dense, ours):
        assert torch.corrcoef(torch.stack([got, theirs]))[0, 1] > 0.995

    def greedy(net: torch.nn.Module, n: int = 12) -> list[int]:
        seq = SingleSequence(net)
        with torch.no_grad():
            logits = seq.step(tokens)
            got: list[int] = []
            for _ in range(n):  # decode rows: the C++ plan's Q6_K GEMV
                got.append(int(logits[-1].argmax()))
                logits = seq.step(got[-1:])
        return got

    # greedy decoding as before: a tiny random model's top two logits often tie within a bf16 step, so each token
    # (gq6k's, and the int8 path's as it was) must be near the top of the file's float32 logits at its prefix
    monkeypatch.setitem(NEAREST, "Q6_K", ("int8", {}))
    before = superslm.load(out)
    assert not any("Q6_K (6-bit g16)" in key for key in before.info()["linears"])
    exact = superslm.load(out, dtype=torch.float32).net
    for net in (model.net, before.net):
        picked = greedy(net)
        with torch.no_grad():
            ref = SingleSequence(exact).step(tokens + picked[:-1])[len(tokens) - 1 :].double()  # [12, vocab]
        top = ref.max(-1).values
        chosen = ref.gather(1, torch.tensor(picked)[:, None])[:, 0]
        assert (chosen >= top - 0.25 * ref.std(-1)).all(), (picked, (top - chosen).tolist())
