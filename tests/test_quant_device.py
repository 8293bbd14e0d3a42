"""The int4/int8 formats and the rotation off the CPU's packed kernels: on a GPU they run the dispatcher's
kernels (Triton, or the torch references), int4 in the stored nibble order. Under TRITON_INTERPRET=1 on the
CPU the same kernels run on CPU tensors (SUPERSLM_KERNELS=triton); the nibble layout is built and checked
on the CPU and on the meta device."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

import superslm  # noqa: E402
from superslm import Request, Sampling  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.hadamard import Rotation  # noqa: E402
from superslm.quant.dense import Int8Linear  # noqa: E402
from superslm.quant.int4 import Int4Linear  # noqa: E402
from superslm.quant.stored import linear_from_state, linear_state  # noqa: E402
from tests.tiny_models import SingleSequence, build_hf_model  # noqa: E402


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 outputs of the same products summed in another order: one bf16 rounding apart, relative to the
    largest output."""
    scale = b.float().abs().amax().item()
    torch.testing.assert_close(a.float(), b.float(), atol=2 ** -7 * scale, rtol=2 ** -7)


@pytest.mark.parametrize("rotate", [None, 3])
def test_int4_nibble_layout_round_trip(rotate: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(100, 200, generator=gen(1))  # out off the packed kernel's 64 rows, in off the group
    lin = Int4Linear.from_dense(w, group=32, rotate=rotate)
    x = torch.randn(5, 200, generator=gen(2)).to(torch.bfloat16)
    packed = lin(x)
    state = {k: v.clone() for k, v in lin.to_tensors()[0].items()}
    stored = lin.dequantize_stored()
    lin._relayout("nibbles")
    assert lin.layout == "nibbles" and lin.qweight.shape == (100, 224 // 2) and lin.scale.shape == (100, 7)
    assert not hasattr(lin, "scales_zeros")
    assert all(torch.equal(state[k], v) for k, v in lin.to_tensors()[0].items())
    assert torch.equal(lin.dequantize_stored(), stored)
    saved = linear_from_state(*linear_state(lin))  # a GPU model saved: stored order, loaded packed
    assert saved.layout == "cpu" and torch.equal(saved(x), packed)
    monkeypatch.setenv(dispatch.ENV, "torch")
    close(lin(x), packed)  # the reference on the nibbles
    if not ON_GPU:  # (CPU tensors reach the kernels under the interpreter only)
        monkeypatch.setenv(dispatch.ENV, "triton")
        close(lin(x), packed)  # the Triton kernel on the nibbles
    else:
        monkeypatch.setenv(dispatch.ENV, "auto")
        close(lin.to(DEV)(x.to(DEV)).cpu(), packed)  # on the GPU, the module moved there
        lin.cpu()
    lin._relayout("cpu")
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert lin.layout == "cpu" and torch.equal(lin(x), packed)


def test_moving_the_module_changes_the_layout() -> None:
    lin = Int4Linear.from_dense(torch.randn(64, 128, generator=gen(3)), group=128)
    lin.float()  # a dtype change keeps the device and the layout
    assert lin.layout == "cpu"
    assert lin.scales_zeros.dtype == torch.bfloat16  # the kernels read bf16 scales whatever the model's dtype
    moved = lin.to("meta")
    assert moved.layout == "nibbles" and moved.qweight.device.type == "meta" and moved.qweight.shape == (64, 64)
    moved.bfloat16().float()  # dtype changes off the CPU keep the layout
    assert moved.layout == "nibbles" and moved.scale.dtype == torch.bfloat16 and moved.scale.shape == (64, 1)
    empty = moved.to_empty(device="cpu")  # from the meta device: the CPU layout's shapes, no values read
    assert empty.layout == "cpu" and empty.qweight.shape == (64, 64) and empty.scales_zeros.shape == (1, 64, 2)
    if ON_GPU:
        back = Int4Linear.from_dense(torch.randn(64, 128, generator=gen(3)), group=128).to("cuda").cpu()
        assert back.layout == "cpu" and back.qweight.device.type == "cpu"


@pytest.mark.skipif(ON_GPU, reason="CPU tensors reach the Triton kernels under the interpreter only")
def test_cpu_modules_run_the_kernels_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 256, generator=gen(4)).to(torch.bfloat16)
    int4 = Int4Linear.from_dense(torch.randn(80, 256, generator=gen(5)), group=128, rotate=1)
    int8 = Int8Linear.from_dense(torch.randn(80, 256, generator=gen(6)), rotate=2)
    rot = Rotation(256, seed=4)
    monkeypatch.setenv(dispatch.ENV, "torch")
    want = [int4(x), int8(x), rot(x)]
    calls: list[str] = []
    for name in ("int4_matmul", "int8_matmul", "hadamard_rotate"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setenv(dispatch.ENV, "triton")
    for got, ref in zip([int4(x), int8(x), rot(x)], want, strict=True):
        close(got, ref)
    assert calls == ["hadamard_rotate", "int4_matmul", "hadamard_rotate", "int8_matmul", "hadamard_rotate"]


@pytest.mark.slow
def test_int4_model_on_the_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model re-quantized to int4 (int8 head) on the dispatcher's kernels: logits within bf16 of the CPU's
    packed kernels, and the same greedy tokens with decode graphs as without."""
    build_hf_model("qwen3", tmp_path)
    model = superslm.load(tmp_path, device=DEV, quant="int4")
    int4 = [m for m in model.net.modules() if isinstance(m, Int4Linear)]
    assert {m.layout for m in int4} == {"nibbles" if ON_GPU else "cpu"}
    if not ON_GPU:
        want_cpu = SingleSequence(model.net).step([5, 17, 42])
        for m in int4:
            m._relayout("nibbles")  # what a GPU holds: the kernels on the stored nibbles
    prompt = [5, 17, 42, 99, 3, 250, 7]
    monkeypatch.setenv(dispatch.ENV, "triton")
    engine = model.engine(slots=2, context=32, page_size=4, graphs=True)
    with_graphs = engine.generate([Request(prompt, 6, Sampling(ignore_eos=True))])[0].tokens
    assert engine.graphs is not None and engine.graphs._made
    plain = model.engine(slots=2, context=32, page_size=4, graphs=False)
    assert plain.generate([Request(prompt, 6, Sampling(ignore_eos=True))])[0].tokens == with_graphs
    if not ON_GPU:  # the dispatcher's kernels (stored nibbles) against the CPU's packed kernels' logits above
        got = SingleSequence(model.net).step([5, 17, 42])
        assert got.shape == (3, 300) and (got - want_cpu).norm() / want_cpu.norm() < 2e-2


def test_converted_folder_keeps_its_formats_off_the_cpu(tmp_path) -> None:
    """A converted int4 folder loaded on another device (meta here: no values) keeps int4 in the kernels'
    layout and its int8 head, instead of dequantizing them into dense weights."""
    from superslm.convert import convert
    from superslm.converted import converted_net
    from superslm.models.loader import open_source
    from superslm.models.transformer import DenseLinear

    build_hf_model("qwen3", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "int4", format="int4")
    net = converted_net(open_source(tmp_path / "int4"), torch.device("meta"))
    assert not any(isinstance(m, DenseLinear) for m in net.modules())
    int4 = [m for m in net.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * len(net.layers) and {m.layout for m in int4} == {"nibbles"}
    assert isinstance(net.head, Int8Linear) and net.head.codes.device.type == "meta"
    dense = converted_net(open_source(tmp_path / "int4"), torch.device("meta"), quant=None)
    assert isinstance(dense.head, DenseLinear)
