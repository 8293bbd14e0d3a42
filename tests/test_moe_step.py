"""A mixture-of-experts block's decode rows in one C++ call (kernels/cpu/moe_step.cpp) against its torch twin
(kernels/moe_step.py moe_decode_reference), the twin against models/layers.py MoE.forward, the engine on tiny
MoE models built by transformers, and the cases that take the torch path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import superslm
from superslm import Request, Sampling, cext
from superslm.kernels import moe_step
from superslm.kernels.moe_step import MoEParts
from superslm.models.layers import MoE
from superslm.models.transformer import DenseLinear
from superslm.quant.dense import Bf16Linear, Int8Linear
from superslm.quant.gguf_map import ConcatLinear
from superslm.quant.int4 import Int4Linear
from tests.tiny_models import build_hf_model, hf_greedy

EXT = cext.extension()
needs_ext = pytest.mark.skipif(EXT is None or not hasattr(EXT, "MoEStep"), reason="the C++ extension is not built here")

DIM, INTER, SHARED, EXPERTS = 256, 128, 192, 8


def _linear(fmt: str, w: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """w [out, in] in format `fmt` (the formats' own constructors, as quant.swap builds them)."""
    if fmt == "int4":
        return Int4Linear.from_dense(w, group=32)
    if fmt == "int4_rot":
        return Int4Linear.from_dense(w, group=64, rotate=3)
    if fmt == "int8":
        return Int8Linear.from_dense(w)
    if fmt == "int8_rot":
        return Int8Linear.from_dense(w, rotate=5)
    if fmt == "bf16":
        return Bf16Linear.from_dense(w)
    if fmt == "concat":  # a GGUF file's gate and up of two block types: int4 rows, then int8 rows
        half = w.shape[0] // 2
        return ConcatLinear([Int4Linear.from_dense(w[:half], group=32), Int8Linear.from_dense(w[half:])])
    return DenseLinear(w.to(dtype))


def _parts(fmt: str, dtype: torch.dtype, top_k: int, norm: bool, shared: bool, seed: int) -> MoEParts:
    """Random experts in `fmt`, a dense router and shared gate in `dtype`."""
    g = torch.Generator().manual_seed(seed)

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) * i**-0.5

    experts = [(_linear(fmt, w(2 * INTER, DIM), dtype), _linear(fmt, w(DIM, INTER), dtype)) for _ in range(EXPERTS)]
    pair = (_linear(fmt, w(2 * SHARED, DIM), dtype), _linear(fmt, w(DIM, SHARED), dtype)) if shared else None
    gate = DenseLinear(w(1, DIM).to(dtype)) if shared else None
    mods = [m for pair_ in experts for m in pair_] + (list(pair) if pair else [])
    return MoEParts(DenseLinear(w(EXPERTS, DIM).to(dtype)), experts, top_k, norm, "silu", pair, gate,
                    watch=tuple(mods))


def _rows(n: int, dtype: torch.dtype, seed: int, dim: int = DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=g) * (0.5 + torch.rand(n, dim, generator=g))).to(dtype)


def _kernel(x: torch.Tensor, parts: MoEParts) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(EXPERTS, dtype=torch.long)
    y = moe_step.run(x, parts, counts)
    assert y is not None, "the C++ step did not take these experts"
    return y, counts


def _twin(x: torch.Tensor, parts: MoEParts) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(EXPERTS, dtype=torch.long)
    return moe_step.moe_decode_reference(x, parts, counts), counts


FORMATS = ["int4", "int4_rot", "int8", "int8_rot", "bf16", "concat", "dense"]


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("top_k", "norm", "shared"), [(2, True, True), (3, False, True), (2, False, False)])
def test_one_row_has_the_twins_bits(fmt: str, dtype: torch.dtype, top_k: int, norm: bool, shared: bool) -> None:
    """A decode row alone: the same GEMVs, routing ops and roundings as the twin, bit for bit."""
    parts = _parts(fmt, dtype, top_k, norm, shared, seed=1)
    for seed in range(4):
        x = _rows(1, dtype, seed)
        got, got_counts = _kernel(x, parts)
        want, want_counts = _twin(x, parts)
        assert got.dtype == dtype and got.shape == (1, DIM)
        assert torch.equal(got, want), f"row {seed}: {(got.float() - want.float()).abs().max()}"
        assert torch.equal(got_counts, want_counts) and int(got_counts.sum()) == top_k


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_several_rows_equal_the_twin(fmt: str, dtype: torch.dtype) -> None:
    """Several decode rows: an expert's rows are read together. Where an expert has one row the kernel gives the
    twin's bits; several rows go through the plan's kernels for that count (its GEMM from gemm_rows, an input
    rotation in float) where the twin calls the module (torch's kernel, a bf16 rotation): within a few bf16
    roundings of the twin, and bit for bit for unrotated formats on torch's kernel at that count."""
    parts = _parts(fmt, dtype, 2, True, True, seed=2)
    x = _rows(6, dtype, 7)
    got, got_counts = _kernel(x, parts)
    want, want_counts = _twin(x, parts)
    assert torch.equal(got_counts, want_counts) and int(got_counts.sum()) == 12
    assert got_counts.max() > 1  # some expert took several rows
    scale = want.float().abs().amax(dim=1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 2**-6 * scale).all()
    rotated = fmt.endswith("_rot")
    if fmt == "dense" or (not rotated and fmt != "concat" and EXT.gemm_rows(fmt == "int8") > 6):
        assert torch.equal(got, want)
    # each row alone: its own bits, whatever the batch did
    for r in range(6):
        assert torch.equal(_kernel(x[r : r + 1], parts)[0], _twin(x[r : r + 1], parts)[0])


@needs_ext
@pytest.mark.parametrize("fmt", ["int4", "int8", "concat", "dense"])
def test_units_side_by_side_give_the_serial_bits(fmt: str) -> None:
    """Decode rows run the chosen experts and the shared expert side by side, one thread each: every row gets the
    bits of the same block run on one thread (each unit's kernels then split their own work), and one row the
    twin's, at 1 to 32 rows (up to kUnitRows; more rows run the units in order)."""
    parts = _parts(fmt, torch.bfloat16, 2, True, True, seed=3)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 5, 32, 33):
            x = _rows(n, torch.bfloat16, 11 + n)
            torch.set_num_threads(1)
            alone, alone_counts = _kernel(x, parts)
            torch.set_num_threads(2)
            split, split_counts = _kernel(x, parts)
            assert torch.equal(split, alone) and torch.equal(split_counts, alone_counts), f"{n} rows"
            if n == 1:
                assert torch.equal(split, _twin(x, parts)[0])
    finally:
        torch.set_num_threads(threads)


@needs_ext
def test_the_twin_is_moe_forward(tmp_path) -> None:
    """moe_decode_reference is MoE.forward's default mode, bit for bit, on a tiny Qwen3.5-MoE block with int4 and
    with int8 experts (the twin's routing, grouping and sums are the module's), and the kernel is the twin's bits
    on each row alone; tokens_per_expert counts the same either way. The int8 experts' down projections here
    take 32 inputs, rotated, which no GEMV takes (K % 64): the step leaves that block to the twin."""
    folder = tmp_path / "hf"
    build_hf_model("qwen3_5_moe", folder)
    for quant in ("int4", "int8"):
        net = superslm.load(folder, quant=quant).net
        moe = next(layer.mlp for layer in net.layers if isinstance(layer.mlp, MoE))
        parts = moe.moe_parts()
        assert moe.moe_parts() is parts  # built once
        x = _rows(1, net.dtype, 3, moe.router.weight.shape[1])
        taken = moe_step.run(x, parts, torch.zeros_like(moe.tokens_per_expert)) is not None
        assert taken == (quant == "int4")
        for n in (1, 3):
            x = _rows(n, net.dtype, 30 + n, moe.router.weight.shape[1])
            before = moe.tokens_per_expert.clone()
            want = moe(x, False)
            counts = torch.zeros_like(before)
            assert torch.equal(moe_step.moe_decode_reference(x, parts, counts), want)
            assert torch.equal(moe.tokens_per_expert - before, counts)
            got = moe(x, False, decode=True)
            assert torch.equal(moe.tokens_per_expert - before, 2 * counts)
            if n == 1:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.abs().max().item())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, tuple[object, object]]:
    out = {}
    for family in ("qwen3_5_moe", "qwen3_moe"):
        folder = tmp_path_factory.mktemp(family)
        out[family] = (build_hf_model(family, folder), folder)
    return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _spy(monkeypatch) -> list[int]:
    """Counts of moe_step.run's calls that ran the C++ step ([0]) and that declined ([1])."""
    calls = [0, 0]
    real = moe_step.run

    def spy(*args):
        y = real(*args)
        calls[0 if y is not None else 1] += 1
        return y

    monkeypatch.setattr(moe_step, "run", spy)
    return calls


@needs_ext
@pytest.mark.float_kv
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_engine_greedy_equals_transformers_on_the_one_call_path(family: str, tiny, monkeypatch) -> None:
    """fp32 models (dense experts): two sequences decoding side by side through the C++ step give transformers'
    greedy tokens, called by the layers (MoE.forward) or by the decode plan (kernels/cpu_hybrid.py)."""
    hf, folder = tiny[family]
    calls = _spy(monkeypatch)
    model = superslm.load(folder, dtype="float32")
    ps = [_prompt(n, 3 + n) for n in (9, 40)]
    want = [hf_greedy(hf, p, 24) for p in ps]
    for fast in (True, False):
        model.net.fast_decode = fast
        engine = model.engine(slots=2, context=160, chunk=48)
        got = [c.tokens for c in engine.generate([Request(p, 24, Sampling(ignore_eos=True)) for p in ps])]
        assert got == want
    assert calls[0] > 0 and calls[1] == 0  # the layers' run called the step


@needs_ext
@pytest.mark.parametrize(("family", "quant"), [("qwen3_5_moe", "int4"), ("qwen3_moe", "int4"), ("qwen3_moe", "bf16")])
def test_quantized_decode_is_bit_identical_on_and_off(family: str, quant: str, tiny, monkeypatch) -> None:
    """One sequence's int4 / bf16 decode: the same tokens and logprobs, bit for bit, with the C++ step and without
    it (its rows alone in each expert: the twin's bits), and the same expert counts. The layers' path: the decode
    plan, which calls the step from C++, is off."""
    folder = tiny[family][1]
    model = superslm.load(folder, quant=quant)
    model.net.fast_decode = False
    p = _prompt(30, 5)

    def answer() -> tuple[list, dict]:
        engine = model.engine(slots=1, context=160)
        before = engine.expert_counts()  # the model's counters, kept across engines
        s = Sampling(temperature=0.8, seed=4, logprobs=2, ignore_eos=True)
        c = engine.generate([Request(p, 16, s)])[0]
        counts = {k: [b - a for a, b in zip(before[k], v)] for k, v in engine.expert_counts().items()}
        return [(lp.token, lp.logprob, lp.top) for lp in c.logprobs], counts

    calls = _spy(monkeypatch)
    on = answer()
    assert calls[0] > 0
    monkeypatch.setattr(moe_step, "run", lambda *a: None)
    assert answer() == on


@needs_ext
def test_fallbacks_take_the_torch_path(tiny, monkeypatch) -> None:
    """Deterministic mode, prompt rows, a hook, a linear the plan does not run, SUPERSLM_KERNELS=torch and no
    extension take MoE.forward's torch code: the same tokens as with the step, the step never run. The layers'
    path: the decode plan, which calls the step from C++ and bypasses hooks as it does for every layer, is off."""
    folder = tiny["qwen3_moe"][1]
    model = superslm.load(folder, quant="int4")
    model.net.fast_decode = False
    p = _prompt(20, 6)

    def tokens(**kwargs) -> list[int]:
        engine = model.engine(slots=1, context=96, **kwargs)
        return engine.generate([Request(p, 6, Sampling(ignore_eos=True))])[0].tokens

    calls = _spy(monkeypatch)
    want = tokens()
    assert calls[0] > 0 and calls[1] == 0  # the step runs these experts
    calls[:] = [0, 0]
    tokens(deterministic=True)
    assert calls == [0, 0]  # deterministic steps and prompt rows never ask
    moe = next(layer.mlp for layer in model.net.layers if isinstance(layer.mlp, MoE))
    handle = moe.experts_mlp[0].down.register_forward_hook(lambda *a: None)
    assert tokens() == want and calls[0] == 0 and calls[1] > 0
    handle.remove()
    calls[:] = [0, 0]
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    tokens()
    assert calls[0] == 0 and calls[1] > 0
    monkeypatch.delenv("SUPERSLM_KERNELS")
    calls[:] = [0, 0]
    monkeypatch.setattr(cext, "extension", lambda: None)
    moe.moe_parts().step = None  # built again, without the extension
    tokens()
    assert calls[0] == 0 and calls[1] > 0
    monkeypatch.undo()
    # a linear the plan does not run: a plain torch module swapped in for one expert's down projection
    old = moe.experts_mlp[1].down
    moe.experts_mlp[1].down = nn.Linear(old.in_features, old.out_features, bias=False, dtype=model.net.dtype)
    assert moe.moe_parts().step is None
    x = _rows(1, model.net.dtype, 9, moe.router.weight.shape[1])
    assert moe_step.run(x, moe.moe_parts(), torch.zeros(len(moe.experts_mlp), dtype=torch.long)) is None
    assert moe.moe_parts().step is False
    moe.experts_mlp[1].down = old
    assert moe_step.run(x, moe.moe_parts(), torch.zeros(len(moe.experts_mlp), dtype=torch.long)) is not None


@needs_ext
def test_bad_inputs_raise() -> None:
    parts = _parts("int8", torch.bfloat16, 2, True, True, seed=3)
    step = moe_step.build_step(parts)
    x = _rows(2, torch.bfloat16, 1)
    counts = torch.zeros(EXPERTS, dtype=torch.long)
    step.run(x, counts)
    for bad_x, bad_counts in ((x[:, 1:].contiguous(), counts), (x.t(), counts), (x.double(), counts),
                              (x, counts[1:]), (x, counts.int())):
        with pytest.raises(RuntimeError, match="MoEStep"):
            step.run(bad_x, bad_counts)
    empty = step.run(x[:0], counts)
    assert empty.shape == (0, DIM)
    with pytest.raises(RuntimeError, match="MoEStep"):
        EXT.MoEStep(0, True, 0)
    # the run wrapper declines what the step would refuse instead of failing
    assert moe_step.run(x.t(), parts, counts) is None and moe_step.run(x, parts, counts.int()) is None


def test_moe_decode_without_the_extension_is_the_twin(monkeypatch) -> None:
    parts = _parts("int8", torch.bfloat16, 2, True, True, seed=4)
    x = _rows(3, torch.bfloat16, 2)
    monkeypatch.setattr(cext, "extension", lambda: None)
    a, b = torch.zeros(EXPERTS, dtype=torch.long), torch.zeros(EXPERTS, dtype=torch.long)
    assert torch.equal(moe_step.moe_decode(x, parts, a), moe_step.moe_decode_reference(x, parts, b))
    assert torch.equal(a, b) and parts.step is False


def test_a_moved_block_rebuilds_its_step(tiny) -> None:
    """After net.to(dtype) a MoE block's decode rows use the converted weights, as a block loaded in that dtype
    does (the cached parts and the kernel's step held the tensors they were built from)."""
    _, folder = tiny["qwen3_5_moe"]
    net = superslm.load(folder, dtype="float32").net
    moe = next(layer.mlp for layer in net.layers if isinstance(layer.mlp, MoE))
    moe(_rows(1, torch.float32, 5, moe.router.weight.shape[1]), False, decode=True)  # parts (and step) built
    net.to(torch.bfloat16)
    fresh = superslm.load(folder, dtype="bfloat16").net
    other = next(layer.mlp for layer in fresh.layers if isinstance(layer.mlp, MoE))
    for n in (1, 3):
        x = _rows(n, torch.bfloat16, 40 + n, moe.router.weight.shape[1])
        assert torch.equal(moe(x, False, decode=True), other(x, False, decode=True))
        assert torch.equal(moe(x, False), other(x, False))
