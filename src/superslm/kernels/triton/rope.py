"""Rotary position embedding (NeoX halves) on the first rotary_dim dims of every head, one program per row.

Each product and the sum are rounded to x's dtype as the torch reference (kernels.rope.apply_rope)
rounds them, so results equal the reference bit for bit in float32 and bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import next_pow2, round_to


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, o_ptr,
    x_row, x_head, cs_row, heads, head_dim, rot,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < heads) & (d < head_dim)
    half = rot // 2
    is_rot = d < rot
    ot = o_ptr.dtype.element_ty  # torch's promotion of x and cos
    base = x_ptr + row * x_row + h * x_head
    x = tl.load(base + d, mask=m, other=0.0).to(tl.float32)
    # partner of dim i in rotate_half: -x[i + half] for the first half, x[i - half] for the second
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(base + partner, mask=m & is_rot, other=0.0).to(tl.float32)
    xp = tl.where(d < half, -xp, xp)
    c = tl.load(cos_ptr + row * cs_row + d, mask=is_rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + row * cs_row + d, mask=is_rot, other=0.0).to(tl.float32)
    y = round_to(round_to(x * c, ot) + round_to(xp * s, ot), ot)
    y = tl.where(is_rot, y, x)  # dims past rotary_dim pass through
    tl.store(o_ptr + row * heads * head_dim + h * head_dim + d, y.to(ot), mask=m)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same signature and meaning as kernels.rope.apply_rope: x [N, heads, head_dim] rotated on its
    first cos.shape[-1] dims by cos, sin [N, rotary_dim]; returns a new contiguous tensor."""
    n, heads, head_dim = x.shape
    rot = cos.shape[-1]
    if rot % 2 or rot > head_dim or cos.shape != sin.shape or cos.shape[0] != n:
        raise InvalidArgument(f"rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if n == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_kernel[(n,)](
        x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), heads, head_dim, rot,
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim),
        enable_fp_fusion=False,  # round each product as the reference does: no fused multiply-add
    )  # fmt: skip
    return out
