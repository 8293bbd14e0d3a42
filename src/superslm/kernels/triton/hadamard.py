"""Block Hadamard rotation of activations: x -> per block of b inputs, (x * signs) · H_b.

The map of kernels/hadamard.py's `Rotation` (see kernels.dispatch.hadamard_rotate_reference). Each
program takes BLOCK_R (row, block) pairs as a [BLOCK_R, b] tile and multiplies it with the ±1
Sylvester matrix (H[i, j] = (-1)^popcount(i & j)) by butterflies (`fwht_rows`), then scales by
1/sqrt(b) rounded to x's dtype, as `Rotation` rounds its matrix. x * signs is exact in bf16/fp16, so
the rotation has no rounding but float32 addition's (in another order than the reference's matmul).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import interpreted, next_pow2, round_to


@triton.jit
def fwht_rows(v, R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
    """v [R, B] float32 -> v · H_b with H_b's ±1 entries (unscaled, H[i, j] = (-1)^popcount(i & j)), by LOG_B
    butterfly stages of a fast Walsh-Hadamard transform (pairs i, i + s -> sum, difference): ~B log B adds a row
    and no [B, B] matrix, which a tl.dot would need built in registers (sm_90, a [16, 128] tile: ~914 PTX
    instructions a thread, 92 registers, 36 KiB of shared memory by the dot; ~321, 32, 4 KiB by butterflies)."""
    for t in tl.static_range(LOG_B):
        v = tl.reshape(v, [R, B // (2 << t), 2, 1 << t])  # [R, pairs of runs, the pair, s = 2^t]
        a, b = tl.split(tl.permute(v, (0, 1, 3, 2)))
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, B])
    return v


@triton.jit
def rotated_input(y, signs, hs, OT: tl.constexpr, R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr):
    """A rotated linear's input from y [R, B] float32, as `Rotation` makes it: cast to OT, times the signs, · H_b
    (`fwht_rows`), times hs (1/sqrt(b) in OT: `h_scale`), rounded to OT; float32 values, exact in OT."""
    return round_to(fwht_rows(round_to(y, OT) * signs, R, B, LOG_B) * hs, OT)


@triton.jit
def _hadamard_kernel(
    x_ptr, s_ptr, o_ptr,
    R, NB, x_row, o_row, h_scale,
    BLOCK_R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # (row, block) pairs: row r // NB, block r % NB
    r_ok = r < R
    row = (r // NB).to(tl.int64)
    col = (r % NB) * B  # the block's first input
    i = tl.arange(0, B)
    x = tl.load(x_ptr + row[:, None] * x_row + col[:, None] + i[None, :], mask=r_ok[:, None], other=0.0)
    s = tl.load(s_ptr + col[:, None] + i[None, :], mask=r_ok[:, None], other=0.0)
    ot = o_ptr.dtype.element_ty  # x's dtype: its cast is exact
    y = rotated_input(x.to(tl.float32), s.to(tl.float32), h_scale, ot, BLOCK_R, B, LOG_B)
    o = o_ptr + row[:, None] * o_row + col[:, None] + i[None, :]
    tl.store(o, y.to(ot), mask=r_ok[:, None])


@functools.lru_cache(maxsize=32)
def h_scale(block: int, dtype: torch.dtype) -> float:
    """1/sqrt(block) as `Rotation` multiplies by it: H_b's float32 entry rounded to `dtype`."""
    # imported here: kernels.hadamard imports kernels.dispatch, which imports the Triton kernels
    from superslm.kernels.hadamard import hadamard_matrix

    return float(hadamard_matrix(block)[0, 0].to(dtype))


def hadamard_config(rows: int, block: int, interp: bool) -> dict[str, int]:
    """Tiles of `_hadamard_kernel` for `rows` (row, block) pairs of `block` inputs each: up to 4K float32 values
    a program on the GPU (fewer for fewer pairs: a decode row's 7 blocks take one program of 8), bigger tiles
    (fewer Python-run programs) under the interpreter."""
    if interp:
        return {"block_r": min(128, next_pow2(rows)), "num_warps": 4}
    return {"block_r": min(64, 4096 // block, next_pow2(rows)), "num_warps": 8 if block >= 128 else 4}


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] -> per block of `block` inputs (x * signs) · H_b, in x's dtype (float32 inside).

    signs [K] (±1), block a power of two <= 128 dividing K; H_b the orthonormal Walsh-Hadamard matrix.
    Same signature and meaning as kernels.dispatch.hadamard_rotate_reference.
    """
    k = x.shape[-1]
    if block < 1 or block > 128 or block & (block - 1) or k % block or signs.shape != (k,):
        raise InvalidArgument(f"hadamard: x {tuple(x.shape)}, signs {tuple(signs.shape)}, block {block}")
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    rows = m * (k // block)  # (row, block) pairs
    if rows == 0:
        return out.view(x.shape)
    signs = signs.to(x.device).contiguous()
    interp = interpreted(x)
    cfg = hadamard_config(rows, block, interp)
    grid = (triton.cdiv(rows, cfg["block_r"]),)
    _hadamard_kernel[grid](
        x2, signs, out, rows, k // block, x2.stride(0), out.stride(0), h_scale(block, x.dtype),
        BLOCK_R=cfg["block_r"], B=block, LOG_B=block.bit_length() - 1, num_warps=cfg["num_warps"],
        enable_fp_fusion=True,
    )  # fmt: skip
    return out.view(x.shape)
