"""The int8 GEMV/GEMM and block Hadamard kernels equal their torch references, and the references
equal what the int8 format and the `Rotation` module compute: under TRITON_INTERPRET=1 on the CPU,
on the GPU where present.

Small shapes on purpose: the interpreter runs each program in Python.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.hadamard import Rotation, random_signs  # noqa: E402
from superslm.quant.dense import Int8Linear  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: 1e-5 (a sum's order; absolute error relative to the largest output, where sums of
    large terms cancel); bf16/fp16: one rounding of the result apart, at most."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = max(ref.float().abs().amax().item(), 1.0)
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5 * scale, rtol=1e-5)
    else:
        eps = torch.finfo(ref.dtype).eps  # 2^-7 bf16, 2^-10 fp16: one ulp at most, relative
        torch.testing.assert_close(out.float(), ref.float(), atol=eps * scale * 0.05, rtol=eps)


# --- int8 -----------------------------------------------------------------------------------------


def random_int8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    return codes.to(DEV), scale.to(DEV)


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 576, 1000), (3, 640, 64), (17, 576, 200), (64, 640, 96), (2, 100, 70)],
)  # N off the tiles (16, 32), K not a power of two (100: not even a multiple of the K tile)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_matmul(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    codes, scale = random_int8(n, k, seed=m + k)
    x = torch.randn(m, k, generator=gen(m)).to(DEV, dtype)
    check(tk.int8_matmul(x, codes, scale), dispatch.int8_matmul_reference(x, codes, scale))


def test_int8_matmul_shapes() -> None:
    codes, scale = random_int8(40, 64, seed=1)
    # leading dims kept; a row-strided x (a slice of a wider activation)
    x = torch.randn(2, 3, 96, generator=gen(2)).to(DEV)[..., 16:80]
    out = tk.int8_matmul(x, codes, scale)
    assert out.shape == (2, 3, 40)
    check(out, dispatch.int8_matmul_reference(x, codes, scale))
    assert tk.int8_matmul(x[:0], codes, scale).shape == (0, 3, 40)
    with pytest.raises(InvalidArgument):
        tk.int8_matmul(x[..., :32], codes, scale)
    with pytest.raises(InvalidArgument):
        tk.int8_matmul(x, codes.to(torch.int16), scale)


def test_int8_reference_is_the_int8_format() -> None:
    w = torch.randn(72, 640, generator=gen(3))
    lin = Int8Linear.from_dense(w)
    x = torch.randn(5, 640, generator=gen(4)).to(torch.bfloat16)
    ref = dispatch.int8_matmul_reference(x, lin.codes, lin.scale)
    check(ref, lin(x))


def test_rotated_int8_is_the_two_kernels() -> None:
    """A rotated int8 linear = the Hadamard kernel, then the int8 kernel (the GPU forward's order)."""
    w = torch.randn(48, 576, generator=gen(5))
    lin = Int8Linear.from_dense(w, rotate=7)
    rot = lin.rotation
    assert rot is not None and rot.block == 64
    x = torch.randn(3, 576, generator=gen(6)).to(torch.bfloat16)
    h = dispatch.hadamard_rotate_reference(x, rot.signs, rot.block)
    ref = dispatch.int8_matmul_reference(h, lin.codes, lin.scale)
    check(ref, lin(x))
    out = tk.int8_matmul(tk.hadamard_rotate(x.to(DEV), rot.signs.to(DEV), rot.block), lin.codes.to(DEV),
                         lin.scale.to(DEV))  # fmt: skip
    check(out.cpu(), ref)


# --- hadamard -------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,block", [(1, 576, 64), (3, 640, 128), (17, 896, 128), (64, 256, 16), (3, 40, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_rotate(m: int, k: int, block: int, dtype: torch.dtype) -> None:
    signs = random_signs(k, seed=m).to(DEV)
    x = (torch.randn(m, k, generator=gen(m + 1)) * 3).to(DEV, dtype)
    check(tk.hadamard_rotate(x, signs, block), dispatch.hadamard_rotate_reference(x, signs, block))


def test_hadamard_rotate_shapes() -> None:
    signs = random_signs(64, seed=0).to(DEV)
    x = torch.randn(2, 3, 96, generator=gen(7)).to(DEV)[..., 16:80]  # row-strided, leading dims kept
    out = tk.hadamard_rotate(x, signs, 32)
    assert out.shape == (2, 3, 64)
    check(out, dispatch.hadamard_rotate_reference(x, signs, 32))
    # block 1: only the sign flip (H_1 = [1])
    assert torch.equal(tk.hadamard_rotate(x, signs, 1), x * signs)
    for bad in (48, 256):
        with pytest.raises(InvalidArgument):
            tk.hadamard_rotate(x, signs, bad)
    with pytest.raises(InvalidArgument):
        dispatch.hadamard_rotate_reference(x, signs, 48)


@pytest.mark.parametrize("k,block", [(576, None), (640, 128), (640, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hadamard_reference_is_rotation(k: int, block: int | None, dtype: torch.dtype) -> None:
    rot = Rotation(k, seed=11, block=block)
    x = torch.randn(4, k, generator=gen(8)).to(dtype)
    assert torch.equal(dispatch.hadamard_rotate_reference(x, rot.signs, rot.block), rot(x))


# --- dispatcher -----------------------------------------------------------------------------------


def _spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, calls: list[str]) -> None:
    fn: Callable[..., torch.Tensor] = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(name) or fn(*a))


def test_dispatch_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    codes, scale = random_int8(24, 64, seed=9)
    x = torch.randn(2, 64, generator=gen(10)).to(DEV)
    signs = random_signs(64, seed=1).to(DEV)
    calls: list[str] = []
    for owner, name in ((tk, "int8_matmul"), (tk, "hadamard_rotate"), (dispatch, "int8_matmul_reference"),
                        (dispatch, "hadamard_rotate_reference")):  # fmt: skip
        _spy(monkeypatch, owner, name, calls)
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.backend(DEV) == "triton"
    kernel_out = dispatch.int8_matmul(x, codes, scale), dispatch.hadamard_rotate(x, signs, 64)
    assert calls == ["int8_matmul", "hadamard_rotate"]
    calls.clear()
    monkeypatch.setenv(dispatch.ENV, "torch")
    ref_out = dispatch.int8_matmul(x, codes, scale), dispatch.hadamard_rotate(x, signs, 64)
    assert calls == ["int8_matmul_reference", "hadamard_rotate_reference"]
    for a, b in zip(kernel_out, ref_out):
        check(a, b)
