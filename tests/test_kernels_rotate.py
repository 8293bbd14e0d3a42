"""The Hadamard rotation of a rotated linear's input fused into the norm or the activation that makes it
(kernels/triton/norm_rotate.py) equals its torch reference (kernels/fused.py: the layer's unfused steps),
under TRITON_INTERPRET=1 on the CPU and on the GPU where present; a rotated int4 model on the Triton path
runs one rotation kernel a layer instead of four and computes what the unfused path computes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch, fused  # noqa: E402
from superslm.kernels.hadamard import random_signs  # noqa: E402

nr = sys.modules["superslm.kernels.triton.norm_rotate"]  # the package's attribute of that name is the function

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for the float32 sums' order: one rounding of the result apart at most."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        eps = torch.finfo(ref.dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), atol=eps * 0.05, rtol=eps)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("weight_in_float", [False, True])
@pytest.mark.parametrize("float_weight", [False, True])  # a float32 norm weight: Llama's product promotes
# k > dim: the linear's padded inputs (SmolLM2's 576 with groups of 128); block 8: the smallest tile
@pytest.mark.parametrize("dim,k,block,n", [(896, 896, 128, 1), (576, 640, 128, 3), (576, 576, 64, 2), (40, 48, 8, 2)])
def test_norm_rotate(dtype, add, weight_in_float, float_weight, dim, k, block, n) -> None:
    g = gen(dim + n)
    x = (torch.randn(n, dim, generator=g) * 2).to(DEV, dtype)
    res = (torch.randn(n, dim, generator=g) * 4).to(DEV, dtype) if add else None
    w = (1 + torch.randn(dim, generator=g) * 0.3).to(DEV, torch.float32 if float_weight else dtype)
    signs = random_signs(k, 7).to(DEV)
    # the linear computes in bf16 whatever the model's dtype (the packed kernels' activations)
    out, h = tk.norm_rotate(x, res, w, 1e-6, weight_in_float, signs, block, torch.bfloat16)
    want, want_h = fused.norm_rotate(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-6, weight_in_float,
                                     signs.cpu(), block, torch.bfloat16)  # fmt: skip
    close(out.cpu(), want)
    if add:
        assert h is not None and want_h is not None
        assert torch.equal(h.cpu(), want_h)
    else:
        assert h is None and want_h is None
    if dtype != torch.bfloat16:  # rotated in the model's own dtype
        out, _ = tk.norm_rotate(x, res, w, 1e-6, weight_in_float, signs, block, dtype)
        close(out.cpu(), fused.norm_rotate(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-6,
                                           weight_in_float, signs.cpu(), block, dtype)[0])  # fmt: skip


@pytest.mark.parametrize("act", fused.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,k,block,n", [(384, 384, 128, 1), (192, 256, 64, 3), (24, 24, 8, 2), (96, 128, 128, 1)])
def test_gated_act_rotate(act, dtype, inter, k, block, n) -> None:
    gu = (torch.randn(n, 2 * inter, generator=gen(inter + n)) * 3).to(DEV, dtype)
    signs = random_signs(k, 3).to(DEV)
    for out_dtype in {torch.bfloat16, dtype}:
        out = tk.gated_act_rotate(gu, act, signs, block, out_dtype)
        close(out.cpu(), fused.gated_act_rotate(gu.cpu(), act, signs.cpu(), block, out_dtype))


def test_references_are_the_unfused_steps() -> None:
    """norm_rotate and gated_act_rotate are the norm (add + norm), the cast and quant's Rotation, bit for bit."""
    from superslm.kernels.hadamard import Rotation
    from superslm.kernels.norm import rms_norm

    g = gen(1)
    x, res = torch.randn(3, 256, generator=g).bfloat16(), torch.randn(3, 256, generator=g).bfloat16()
    w = torch.randn(256, generator=g)
    rot = Rotation(256, seed=5)
    out, h = fused.norm_rotate(x, res, w, 1e-5, False, rot.signs, rot.block, torch.bfloat16)
    assert torch.equal(h, res + x)
    assert torch.equal(out, rot(rms_norm(res + x, w, 1e-5).bfloat16()))
    gu = torch.randn(3, 512, generator=g).bfloat16()
    assert torch.equal(fused.gated_act_rotate(gu, "silu", rot.signs, rot.block, torch.bfloat16),
                       rot(fused.gated_act(gu, "silu")))  # fmt: skip


def test_shapes_the_fused_kernels_do_not_take_run_the_steps_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of more blocks than one program holds, a strided row: the norm and the Hadamard kernel apart, with
    the reference's result; a block that does not divide the input, a rotation narrower than it: an error."""
    monkeypatch.setattr(nr, "MAX_ROW_BLOCKS", 2)
    apart: list[int] = []
    real = nr.hadamard_rotate
    monkeypatch.setattr(nr, "hadamard_rotate", lambda *a: apart.append(1) or real(*a))
    g = gen(2)
    x = torch.randn(2, 96, generator=g).to(DEV)
    w, signs = torch.ones(96, device=DEV), random_signs(96, 1).to(DEV)
    out, _ = tk.norm_rotate(x, None, w, 1e-6, False, signs, 32, torch.float32)  # 3 blocks > 2
    close(out.cpu(), fused.norm_rotate(x.cpu(), None, w.cpu(), 1e-6, False, signs.cpu(), 32, torch.float32)[0])
    wide = torch.randn(2, 192, generator=g).to(DEV)[:, ::2]  # stride 2
    res = torch.randn(2, 96, generator=g).to(DEV)
    out, h = tk.norm_rotate(wide, res, w, 1e-6, False, signs, 16, torch.float32)
    want, want_h = fused.norm_rotate(wide.cpu(), res.cpu(), w.cpu(), 1e-6, False, signs.cpu(), 16, torch.float32)
    close(out.cpu(), want)
    assert h is not None and want_h is not None and torch.equal(h.cpu(), want_h)
    gu = torch.randn(2, 4 * 96, generator=g).to(DEV)[:, ::2]  # stride 2
    out = tk.gated_act_rotate(gu, "silu", signs, 32, torch.float32)
    close(out.cpu(), fused.gated_act_rotate(gu.cpu(), "silu", signs.cpu(), 32, torch.float32))
    assert len(apart) == 3
    with pytest.raises(InvalidArgument):  # 64 does not divide 96
        tk.gated_act_rotate(torch.randn(2, 2 * 96, device=DEV), "silu", signs, 64, torch.float32)
    with pytest.raises(InvalidArgument):  # a rotation narrower than the input
        tk.norm_rotate(torch.randn(2, 128, device=DEV), None, torch.ones(128, device=DEV), 1e-6, False, signs, 32,
                       torch.float32)  # fmt: skip


# Qwen2: qkv bias, bf16; Gemma-3: float32-weight norms, post norms, gelu, int8; Llama in float32: the norm's
# output (float32) is not the linear's compute dtype (bf16)
@pytest.mark.parametrize("family,quant,dtype", [("qwen2", "int4", "bf16"), ("gemma3", "int8", "bf16"),
                                                ("llama", "int4", "fp32")])  # fmt: skip
@pytest.mark.slow
def test_a_rotated_model_rotates_inside_its_norms(family, quant, dtype, tmp_path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A model re-quantized to rotated int4/int8 on the Triton path: each layer's qkv and gate_up inputs are
    rotated by the norm kernels, down's by the activation's, only o's by the Hadamard kernel; the logprobs
    and tokens are the unfused path's (bit for bit under the interpreter)."""
    import superslm
    from superslm import Request, Sampling
    from superslm.models import transformer
    from superslm.quant.base import LinearFormat
    from superslm.quant.int4 import Int4Linear
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model(family, tmp_path, spec=two_layers(family))
    model = superslm.load(tmp_path, device=DEV, dtype=dtype, quant=quant)
    linears = [m for layer in model.net.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, LinearFormat) and m.rotation is not None for m in linears)
    # the tiny models' 64 inputs padded to one int4 group of 128: the kernels pad as the linear does
    assert quant != "int4" or any(m.k_pad > m.in_features for m in linears)
    if not ON_GPU:
        for m in linears:
            if isinstance(m, Int4Linear):
                m._relayout("nibbles")  # what a GPU holds: the kernels on the stored nibbles
    monkeypatch.setenv(dispatch.ENV, "triton")
    # the norm and activation kernels themselves, not inside int4 GEMVs (test_kernels_rotate_gemv.py)
    monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, "0")
    calls: dict[str, int] = {}
    for name in ("hadamard_rotate", "norm_rotate", "gated_act_rotate"):
        real = getattr(tk, name)
        spy = lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls.get(_n, 0) + 1) or _f(*a)  # noqa: E731
        monkeypatch.setattr(tk, name, spy)
        if name == "hadamard_rotate":  # o's input: the attention's (one key split here) rotated by this kernel
            monkeypatch.setattr(sys.modules["superslm.kernels.triton.attention_linear"], name, spy)
    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = {}
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(transformer, "_fused_rotation", lambda *a: None)
        calls.clear()
        engine = model.engine(slots=2, context=64, page_size=4, graphs=False)
        (done,) = engine.generate([Request(prompt, 4, Sampling(ignore_eos=True, logprobs=0))])
        out[fuse] = (done, dict(calls))
    layers, steps = len(model.net.layers), 4  # a prompt step and three decode steps
    fused_calls, plain_calls = out[True][1], out[False][1]
    assert fused_calls.pop("norm_rotate") == 2 * layers * steps
    assert fused_calls.pop("gated_act_rotate") == layers * steps
    assert list(plain_calls) == list(fused_calls) == ["hadamard_rotate"]
    # three of each layer's four Hadamard launches gone (o's stays; the head's, if any, is unchanged)
    assert plain_calls["hadamard_rotate"] - fused_calls["hadamard_rotate"] == 3 * layers * steps
    assert fused_calls["hadamard_rotate"] >= layers * steps
    assert out[True][0].tokens == out[False][0].tokens
    lp = [torch.tensor([p.logprob for p in out[f][0].logprobs]) for f in (True, False)]
    if ON_GPU:  # the same products; a sum's order may differ in the last bit
        torch.testing.assert_close(lp[0], lp[1], atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(lp[0], lp[1])


def test_formats_with_their_own_forward_are_not_fused() -> None:
    """Only the base LinearFormat.forward (pad, rotate, matmul) may be replaced by a fused rotation: a format
    that overrides forward, or a hook on the module or its rotation, keeps its own."""
    from superslm.quant.dense import Int8Linear

    lin = Int8Linear.from_dense(torch.randn(32, 64, generator=gen(3)), rotate=1)
    signs, block, dtype = lin.input_rotation()
    assert torch.equal(signs, lin.rotation.signs) and block == lin.rotation.block and dtype == torch.bfloat16

    class Own(Int8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    own = Own(lin.codes, lin.scale, lin.in_features, rotation=(1, lin.rotation.block))
    assert own.input_rotation() is None
    handle = lin.rotation.register_forward_hook(lambda *a: None)
    assert lin.input_rotation() is None
    handle.remove()
    assert lin.input_rotation() is not None
    assert Int8Linear.from_dense(torch.randn(32, 64, generator=gen(3))).input_rotation() is None  # not rotated
