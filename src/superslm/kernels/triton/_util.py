"""Helpers shared by the Triton kernels: rounding that the interpreter gets right, launch sizes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.cache.kv import SCALE_BYTES

#: the activation dtypes the kernels compute from (float32 inside)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def gemv_block_n(n_out: int) -> int:
    """Outputs a GEMV program takes on a GPU so that one row fills ~256 programs (an H100/H200 has 132 SMs), 2 to 16."""
    return max(2, min(16, 1 << max(0, (n_out // 256).bit_length() - 1)))


def page_head_dim(cache: torch.Tensor) -> int:
    """head_dim of a KV cache [slots, kv_heads, width]: width for float pages, width - 4 for int8 rows (their
    codes, then the float32 scale: cache/kv.py), 2 (width - 4) for 4-bit rows (two codes a byte, then the scale)."""
    if cache.dtype == torch.int8:
        return cache.shape[-1] - SCALE_BYTES
    if cache.dtype == torch.uint8:
        return 2 * (cache.shape[-1] - SCALE_BYTES)
    return cache.shape[-1]


def page_bits(cache: torch.Tensor) -> int:
    """The `bits` the KV kernels take for a cache: 8 for int8 rows, 4 for 4-bit rows, 0 for float values."""
    return {torch.int8: 8, torch.uint8: 4}.get(cache.dtype, 0)


def interpreted(t: torch.Tensor) -> bool:
    """True when a kernel on `t` runs under the Triton interpreter (a CPU tensor: no other way to run it).

    The interpreter's bf16 `tl.dot` is wrong, so kernels then feed `tl.dot` float32 operands.
    """
    return not t.is_cuda


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE (round to nearest even) and returned as float32.

    Storing the result as DTYPE is then exact. Done by hand for bf16 because the interpreter's
    float32 -> bf16 cast truncates, while the GPU's rounds to nearest even.
    """
    if DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
        return b.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
