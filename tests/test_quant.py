"""Runtime linear formats and the Hadamard rotation, on synthetic weights.

Tolerance of a packed-kernel forward against dequantize()-then-matmul in float32: the kernels take bf16
activations and bf16 scales, accumulate in float32 and round each output once to bf16, so
|y - ref| <= u * (|x| @ |W|^T) with u = 2^-8 (bf16's unit roundoff). A rotated module rounds its rotated
activation to bf16 too: one more u, measured against the rotated operands.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file

from superslm.errors import FormatError, InvalidArgument, UnsupportedModel
from superslm.formats.blocks import (
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q6_K,
    Q8_0,
)
from superslm.quant import (
    FORMATS,
    ConcatLinear,
    GGUFInt4Linear,
    Int4Linear,
    Int8Linear,
    Rotation,
    format_class,
    fwht,
    linear_from_gguf,
    load_linear,
    random_signs,
    rotate_activation,
    rotate_weight,
    unrotate_weight,
)
from superslm.quant.gguf_map import int5_runs, iq4_runs, q6k_runs
from superslm.quant.int4 import cpu_block, pack_int4, to_cpu_layout, to_stored_layout, unpack_int4
from superslm.quant.int5 import GGUFInt5Linear, pack_bits, unpack_bits

U = 2.0**-8


def sylvester(b: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix by Sylvester's construction (independent of fwht)."""
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(b)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.abs().double() @ w.abs().double().t()


def build(name: str, w: torch.Tensor, rotate: int | None, **kw: object):
    opts = dict(kw)
    if rotate is not None:
        opts["rotate"] = rotate
    return format_class(name).from_dense(w, **opts)


# --- the rotation --------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [2, 16, 64, 128])
def test_fwht_is_the_hadamard_matrix(block: int) -> None:
    x = torch.randn(5, 3 * block, dtype=torch.float64)
    want = (x.view(5, 3, block).numpy() @ sylvester(block)).reshape(5, -1)
    np.testing.assert_allclose(fwht(x, block).numpy(), want, atol=1e-12)
    # orthonormal and its own inverse
    torch.testing.assert_close(fwht(fwht(x, block), block), x, atol=1e-12, rtol=0)
    # the rotation (a matmul per block, for speed) is the butterflies after the sign flip
    torch.testing.assert_close(rotate_activation(x, 9, block), fwht(x * random_signs(3 * block, 9), block))


def test_rotation_preserves_products() -> None:
    w, x = torch.randn(48, 256, dtype=torch.float64), torch.randn(7, 256, dtype=torch.float64)
    wr, xr = rotate_weight(w, seed=3), rotate_activation(x, seed=3)
    torch.testing.assert_close(xr @ wr.t(), x @ w.t(), atol=1e-10, rtol=0)
    torch.testing.assert_close(xr.norm(dim=-1), x.norm(dim=-1), atol=1e-10, rtol=0)
    torch.testing.assert_close(unrotate_weight(wr, seed=3), w, atol=1e-12, rtol=0)
    # another seed is another rotation; the same seed is the same everywhere
    assert not torch.allclose(rotate_activation(x, seed=4), xr)
    assert torch.equal(rotate_activation(x, seed=3), xr)
    # the run-time module computes the same R x
    torch.testing.assert_close(Rotation(256, 3)(x.float()), xr.float(), atol=1e-5, rtol=0)


def test_rotation_refuses_bad_blocks() -> None:
    with pytest.raises(InvalidArgument):
        rotate_activation(torch.randn(2, 96), seed=0, block=64)
    with pytest.raises(InvalidArgument):
        fwht(torch.randn(2, 96), 48)


def test_rotation_lowers_int4_error_with_outlier_channels() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 1024, generator=g)
    w[:, torch.randperm(1024, generator=g)[:8]] *= 20  # a few input channels 20x larger, as in LLMs
    x = torch.randn(64, 1024, generator=g)
    ref = x @ w.t()

    def err(rotate: int | None) -> float:
        m = Int4Linear.from_dense(w, group=128, rotate=rotate)
        return float((x @ m.dequantize().t() - ref).norm() / ref.norm())

    plain, rotated = err(None), err(0)
    assert rotated < 0.6 * plain, (plain, rotated)


# --- the formats on dense weights ----------------------------------------------------------------

CASES = [("bf16", {}), ("int8", {}), ("int4", {"group": 32}), ("int4", {"group": 128})]


@pytest.mark.parametrize("name,kw", CASES)
@pytest.mark.parametrize("rotate", [None, 5])
@pytest.mark.parametrize("shape", [(96, 256), (100, 200)])  # (100, 200): rows and inputs need padding
def test_forward_matches_dequantize(name: str, kw: dict, rotate: int | None, shape: tuple[int, int]) -> None:
    w = torch.randn(*shape) * 0.05
    bias = torch.randn(shape[0])
    m = build(name, w, rotate, bias=bias, **kw)
    assert m.out_features == shape[0] and m.in_features == shape[1]
    x = torch.randn(5, shape[1]).bfloat16()
    deq = m.dequantize()
    assert deq.shape == shape and deq.dtype == torch.float32
    y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, shape[0])
    ref = F.linear(x.double(), deq.double(), bias.double())
    if m.rotation is None:
        tol = U * bound(x, deq)
    else:
        # in the stored basis: the rotated activation (rounded to bf16) times the stored weight
        xp = F.pad(x.double(), (0, m.k_pad - shape[1]))
        tol = 2 * U * bound(rotate_activation(xp, m.rotation.seed, m.rotation.block), m.dequantize_stored())
    tol = tol + U * bias.abs().double()  # the bias is added to the bf16 output and rounded again
    assert ((y.double() - ref).abs() <= tol + 1e-6).all()
    # an fp32 model gets fp32 back
    assert m(x.float()).dtype == torch.float32


def test_int8_and_int4_quantization_error_bounds() -> None:
    w = torch.randn(64, 256)
    m8 = Int8Linear.from_dense(w)
    step8 = m8.scale.float()[:, None]
    assert ((m8.dequantize() - w).abs() <= step8 / 2 * (1 + 4 * U)).all()
    m4 = Int4Linear.from_dense(w, group=32)
    _, scale, zero = m4._params()
    step4 = scale.float().repeat_interleave(32, dim=1)
    # half a step from the rounding, plus the bf16 rounding of zero and scale at the group's ends
    slack = U * (zero.float().abs() + 8 * scale.float()).repeat_interleave(32, dim=1)
    assert ((m4.dequantize() - w).abs() <= step4 / 2 + 2 * slack).all()


def test_int4_packing_matches_torch_and_round_trips() -> None:
    """pack_int4 in this CPU's blocks (64 rows with AVX-512, 32 with AVX2) is torch's layout; every block size
    round-trips, and the stored layout (blocks of 64) converts to this CPU's and back."""
    codes = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    block = cpu_block()
    assert block in (64, 32)
    packed = pack_int4(codes.to(torch.uint8), block)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    for b in (64, 32, 16):
        assert torch.equal(unpack_int4(pack_int4(codes.to(torch.uint8), b), b), codes.to(torch.uint8))
    stored = pack_int4(codes.to(torch.uint8))
    assert torch.equal(to_cpu_layout(stored), packed) and torch.equal(to_stored_layout(packed), stored)
    # the two layouts differ: blocks of 32 rows pair row j with j + 16, blocks of 64 with j + 32
    assert not torch.equal(pack_int4(codes.to(torch.uint8), 32), stored)


def test_int4_kernel_semantics() -> None:
    # the kernel's zero is the value of code 8: W = (q - 8) * scale + zero, checked by a direct loop
    n, k, group = 64, 64, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    s = torch.rand(k // group, n).bfloat16()
    z = torch.randn(k // group, n).bfloat16()
    x = torch.randn(1, k).bfloat16()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), group, torch.stack([s, z], -1)
    )
    for row in range(0, n, 7):
        want = sum(
            float(x[0, c]) * ((int(q[row, c]) - 8) * float(s[c // group, row]) + float(z[c // group, row]))
            for c in range(k)
        )
        scale = sum(abs(float(x[0, c])) * (8 * float(s[c // group, row]) + abs(float(z[c // group, row])))
                    for c in range(k))  # fmt: skip
        assert abs(float(y[0, row]) - want) <= U * scale + 1e-6


@pytest.mark.parametrize("name,kw", CASES)
def test_fused_parts_equal_separate_modules(name: str, kw: dict) -> None:
    parts = [torch.randn(64, 128), torch.randn(32, 128), torch.randn(32, 128)]
    fused = format_class(name).from_dense(parts, **kw)
    alone = torch.cat([format_class(name).from_dense(p, **kw).dequantize() for p in parts])
    assert torch.equal(fused.dequantize(), alone)  # quantization is per row / per row-group


def test_bad_options_are_refused() -> None:
    with pytest.raises(UnsupportedModel):
        format_class("int3")
    with pytest.raises(InvalidArgument):
        Int4Linear.from_dense(torch.randn(64, 128), group=48)
    with pytest.raises(InvalidArgument):
        Int8Linear.from_dense([torch.randn(4, 8), torch.randn(4, 9)])
    with pytest.raises(InvalidArgument):
        GGUFInt4Linear.from_dense(torch.randn(64, 128))


# --- GGUF blocks -----------------------------------------------------------------------------------


def gguf_bytes(block: type, w: np.ndarray) -> np.ndarray:
    """GGUF bytes for w [out, in]: gguf-py's quantizer where it has one, else random valid blocks."""
    qtype = GGMLQuantizationType[block.name]
    try:
        return quants.quantize(w, qtype).reshape(-1)
    except NotImplementedError:
        rng = np.random.default_rng(0)
        n_blocks = w.size // block.block_size
        raw = rng.integers(0, 256, (n_blocks, block.type_size), dtype=np.uint8)
        # the f16 fields (d, dmin) set to sane magnitudes; every other bit pattern is a valid block (each IQ grid
        # index field is as wide as its grid is long)
        fields = {"Q4_K": (0, 2), "Q6_K": (208,)}.get(block.name, (0,) if block.name.startswith("IQ") else None)
        assert fields is not None, block.name
        for at in fields:
            raw[:, at : at + 2] = (rng.random((n_blocks, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        return raw.reshape(-1)


@pytest.mark.parametrize("block", [Q4_0, Q4_1, Q4_K])
def test_gguf_native_equals_dequantize_then_matmul(block: type) -> None:
    shape = (96, 512)
    raw = gguf_bytes(block, np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 0.02)
    # the reference: gguf-py's own dequantization of the same bytes
    w = torch.from_numpy(quants.dequantize(raw.reshape(shape[0], -1), GGMLQuantizationType[block.name])).float()
    perm = torch.randperm(shape[0])
    m = GGUFInt4Linear.from_gguf(raw, block, shape, row_perm=perm)
    assert m.describe().startswith("gguf int4 g32") and block.name in m.describe()
    x = torch.randn(4, shape[1]).bfloat16()
    y = m(x).double()
    ref = x.double() @ w[perm].double().t()
    # param rounding: scale and zero become bf16, so |dW| <= u * (8 |scale| + |zero|) per group
    codes, scale, minimum = block.unpack_int4(raw)
    s = torch.from_numpy(np.abs(scale)).double().view(shape[0], -1)[perm]
    z = torch.from_numpy(np.abs(minimum + 8 * scale)).double().view(shape[0], -1)[perm]
    per_weight = (8 * s + z).repeat_interleave(32, dim=1)
    tol = U * (x.abs().double() @ per_weight.t()) + U * bound(x, w[perm])
    assert ((y - ref).abs() <= tol + 1e-6).all()
    # the codes are the file's: dequantize() differs from gguf-py's values only by that rounding
    assert ((m.dequantize().double() - w[perm].double()).abs() <= U * per_weight + 1e-7).all()


def test_gguf_fused_parts_and_nearest_formats() -> None:
    rng = np.random.default_rng(2)
    q = gguf_bytes(Q4_K, rng.standard_normal((64, 256)).astype(np.float32))
    k = gguf_bytes(Q4_K, rng.standard_normal((32, 256)).astype(np.float32))
    v6 = gguf_bytes(Q6_K, rng.standard_normal((32, 256)).astype(np.float32))
    native = linear_from_gguf([(q, Q4_K, (64, 256), None), (k, Q4_K, (32, 256), None)])
    assert isinstance(native, GGUFInt4Linear) and native.out_features == 96
    alone = torch.cat([GGUFInt4Linear.from_gguf(q, Q4_K, (64, 256)).dequantize(),
                       GGUFInt4Linear.from_gguf(k, Q4_K, (32, 256)).dequantize()])  # fmt: skip
    assert torch.equal(native.dequantize(), alone)
    # the IQ types (and Q5_0, Q6_K, Q8_0, IQ4_NL, IQ4_XS without the C++ kernels): re-quantized to int8 per
    # channel, and said so
    iq = (IQ3_S, IQ3_XXS, IQ2_S, IQ2_XXS, IQ2_XS) + (() if iq4_runs() else (IQ4_NL, IQ4_XS))
    iq += (() if q6k_runs() else (Q6_K,)) + (Q8_0,)  # Q8_0: int8 unless mapped to gq80
    for block in iq if int5_runs() else (Q5_0, *iq):
        raw = gguf_bytes(block, rng.standard_normal((32, 256)).astype(np.float32))
        m = linear_from_gguf([(raw, block, (32, 256), None)])
        assert isinstance(m, Int8Linear) and f"from {block.name}" in m.describe()
        w = torch.from_numpy(block.dequantize(raw)).view(32, 256)
        assert ((m.dequantize() - w).abs() <= m.scale.float()[:, None] * (0.5 + U)).all()
    # a fused qkv whose v is another block type: one module per part, outputs concatenated (Q6_K as int8 here, for
    # this bound: as it is, its GEMV rounds x to int8, tests/test_q6k.py)
    parts = [(q, Q4_K, (64, 256), None), (v6, Q6_K, (32, 256), None)]
    kept = linear_from_gguf(parts)
    assert isinstance(kept, ConcatLinear) and ("Q6_K (6-bit" if q6k_runs() else "int8") in kept.describe()
    mixed = linear_from_gguf(parts, bias=torch.randn(96), mapping={"Q6_K": ("int8", {})})
    assert isinstance(mixed, ConcatLinear) and "gguf" in mixed.describe() and "int8" in mixed.describe()
    x = torch.randn(3, 256).bfloat16()
    y = mixed(x).double()
    ref = F.linear(x.double(), mixed.dequantize().double(), torch.cat([p.bias for p in mixed.parts]).double())
    assert ((y - ref).abs() <= U * (bound(x, mixed.dequantize()) + ref.abs()) + 1e-6).all()
    # neighbouring parts of one format stay one module (a Q5_0 q and k beside a Q8_0 v: two kernel calls, not three)
    runs = linear_from_gguf([*parts[:1], *parts], mapping={"Q6_K": ("int8", {})})
    assert isinstance(runs, ConcatLinear) and [p.out_features for p in runs.parts] == [128, 32]
    assert torch.equal(runs.dequantize(), torch.cat([mixed.parts[0].dequantize(), mixed.dequantize()]))


# --- save / load -----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(3)
    q = gguf_bytes(Q4_1, rng.standard_normal((64, 256)).astype(np.float32))
    v6 = gguf_bytes(Q6_K, rng.standard_normal((32, 256)).astype(np.float32))
    w = torch.randn(100, 200)
    modules = [format_class(n).from_dense(w, bias=torch.randn(100), rotate=7, **kw) for n, kw in CASES]
    modules += [
        GGUFInt4Linear.from_gguf(q, Q4_1, (64, 256), row_perm=torch.randperm(64)),
        linear_from_gguf([(q, Q4_1, (64, 256), None), (v6, Q6_K, (32, 256), None)]),
    ]
    for i, m in enumerate(modules):
        tensors, meta = m.to_tensors()
        path = tmp_path / f"{i}.safetensors"
        save_file(tensors, str(path))  # flat, contiguous, safetensors-able
        back = load_linear(load_file(str(path)), json.loads(json.dumps(meta)))
        assert type(back) is type(m) and back.describe() == m.describe()
        x = torch.randn(3, m.in_features).bfloat16()
        assert torch.equal(back(x), m(x))
        assert torch.equal(back.dequantize(), m.dequantize())
    tensors, meta = modules[2].to_tensors()
    with pytest.raises(FormatError):
        load_linear(tensors, dict(meta, layout=99))
    with pytest.raises(FormatError):
        load_linear({k: v[:50] for k, v in tensors.items()}, meta)


def test_registry_has_the_formats() -> None:
    assert {"bf16", "int8", "int4", "gguf"} <= set(FORMATS)
    for name in ("bf16", "int8", "int4"):
        m = format_class(name).from_dense(torch.randn(64, 64))
        assert m.describe().startswith(name) and m.nbytes() > 0


# --- Q5_0 as it is (quant/int5.py) ---------------------------------------------------------------


def test_q5_0_fifth_bits_round_trip() -> None:
    h = np.random.default_rng(7).integers(0, 2, (128, 96), dtype=np.uint8)
    assert np.array_equal(unpack_bits(pack_bits(h), 128, 96), h)


@pytest.mark.parametrize("shape", [(64, 64), (100, 640), (384, 512)])
def test_q5_0_runs_as_it_is(shape) -> None:
    """Q5_0 blocks keep their codes: the module's weight is the file's up to d's bf16 rounding, its
    output within bf16 rounding of that weight's matmul, each row's bits the same alone or in a batch,
    rows the int8 parts cannot carry (NaN, an outlier) computed apart, and the state round-trips."""
    if not int5_runs():
        pytest.skip("no C++ VNNI kernels here: Q5_0 becomes int8")
    n, k = shape
    rng = np.random.default_rng(n)
    raw = gguf_bytes(Q5_0, rng.standard_normal((n, k)).astype(np.float32))
    perm = torch.randperm(n)
    m = linear_from_gguf([(raw, Q5_0, shape, perm)], bias=torch.randn(n))
    assert isinstance(m, GGUFInt5Linear) and "Q5_0" in m.describe()
    w = torch.from_numpy(Q5_0.dequantize(raw)).view(n, k)[perm]
    d = torch.from_numpy(quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q5_0)).view(n, k)[perm]
    assert torch.equal(w, d)  # our block reader is gguf-py's
    wq = m.dequantize()
    assert ((wq - w).abs() <= U * w.abs() + 1e-7).all()  # |code - 16| * d, d rounded to bf16 once
    for rows in (1, 3, 40):
        x = torch.randn(rows, k).bfloat16()
        y = m(x).double()
        ref = x.double() @ wq.double().t() + m.bias.double()
        assert ((y - ref).abs() <= U * (bound(x, wq) + ref.abs()) + 1e-6).all()
        for r in range(rows):
            assert torch.equal(m(x[r : r + 1]).view(torch.int16), m(x)[r : r + 1].view(torch.int16))
    odd = torch.randn(3, k).bfloat16()
    odd[0, 1] = float("nan")
    odd[2, 5] = 3e4  # an outlier the two int8 parts cannot carry: the float32 reference takes the row
    y = m(odd).double()
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1:]).any()
    ref = odd[1:].double() @ wq.double().t() + m.bias.double()
    assert ((y[1:] - ref).abs() <= U * (bound(odd[1:], wq) + ref.abs()) + 1e-3).all()
    tensors, meta = m.to_tensors()
    again = load_linear(tensors, meta)
    assert isinstance(again, GGUFInt5Linear) and torch.equal(again.dequantize(), wq)
    assert torch.equal(again(odd[1:2]), m(odd[1:2]))


def test_q5_0_is_int8_when_torch_kernels_are_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    raw = gguf_bytes(Q5_0, np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32))
    assert isinstance(linear_from_gguf([(raw, Q5_0, (32, 256), None)]), Int8Linear)
