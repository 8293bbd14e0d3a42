"""KV store by slot mapping: each row's key and value heads go to one flat slot of the paged cache, in the cache's
page format (cache/kv.py): float values, int8 rows (head_dim codes, then the float32 scale's 4 bytes), or 4-bit
rows (each head rotated by the fixed-sign block Hadamard transform, head_dim / 2 bytes of two codes each, then the
scale). Keys and values each in their own format (k8v4, k4v8)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from superslm.cache import kv as kvmod
from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import next_pow2, page_bits, page_head_dim, round_to
from superslm.kernels.triton.hadamard import fwht_rows

#: 1.5 * 2**23: (y + _ROUND) - _ROUND rounds a float32 |y| < 2**22 to the nearest integer, ties to even (torch.round)
_ROUND = tl.constexpr(12582912.0)


@triton.jit
def quantize_row(x, m, c_ptrs, s_ptrs):
    """x [BLOCK_H, BLOCK_D] float32 (valid where m) as int8 rows: codes round(x / scale) in -127..127 at c_ptrs and
    scale = max |x| / 127 as float32 at s_ptrs [BLOCK_H, 1]; the bits of cache.kv.quantize_rows (a row with a NaN
    gets scale NaN and codes 0, a zero row codes 0)."""
    a = tl.where(m, tl.abs(x), 0.0)
    nan = tl.sum(tl.where(m & (x != x), 1, 0), 1) > 0
    scale = tl.where(nan, float("nan"), tl.max(a, 1) / 127.0)[:, None]
    y = tl.where(scale > 0, x / tl.where(scale > 0, scale, 1.0), 0.0)
    y = tl.where(y != y, 0.0, (y + _ROUND) - _ROUND)  # inf / inf: 0, before min/max (which drop NaNs)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(c_ptrs, y.to(tl.int8), mask=m)
    tl.store(s_ptrs, scale, mask=tl.max(m.to(tl.int32), 1)[:, None] > 0)


@triton.jit
def rotate_rows(x, signs, hs, R: tl.constexpr, D: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
                FORWARD: tl.constexpr):  # fmt: skip
    """x [R, D] float32, each row a head (D a multiple of B, lanes past head_dim zero): R x = H (signs * x) with
    FORWARD, else R^T x = signs * (H x); H the orthonormal Walsh-Hadamard transform of each run of B lanes, hs its
    float32 1/sqrt(B). The butterflies of cache.kv._fwht in its order, so the bits of cache.kv.rotate / unrotate."""
    if FORWARD:
        x = x * signs
    y = tl.reshape(fwht_rows(tl.reshape(x, [R * D // B, B]), R * D // B, B, LOG_B), [R, D]) * hs
    if not FORWARD:
        y = y * signs
    return y


@triton.jit
def quantize_row4(r, m, c_ptrs, cm, s_ptrs, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """r [BLOCK_H, BLOCK_D] rotated float32 (valid where m, zero elsewhere) as 4-bit rows: codes round(r / scale) + 8
    in 1..15, lane 2i in the low nibble of byte i at c_ptrs [BLOCK_H, BLOCK_D / 2] (stored where cm), 2i + 1 in its
    high one, and scale = max |r| / 7 as float32 at s_ptrs [BLOCK_H, 1]; the bits of cache.kv.quantize_rows4 (a row
    with a NaN gets scale NaN and codes 8, a zero row codes 8)."""
    a = tl.where(m, tl.abs(r), 0.0)
    nan = tl.sum(tl.where(m & (r != r), 1, 0), 1) > 0
    scale = tl.where(nan, float("nan"), tl.max(a, 1) / 7.0)[:, None]
    y = tl.where(scale > 0, r / tl.where(scale > 0, scale, 1.0), 0.0)
    y = tl.where(y != y, 0.0, (y + _ROUND) - _ROUND)  # inf / inf: 0, before min/max (which drop NaNs)
    q = (tl.minimum(tl.maximum(y, -7.0), 7.0) + 8.0).to(tl.int32)
    lo, hi = tl.split(tl.reshape(q, [BLOCK_H, BLOCK_D // 2, 2]))
    tl.store(c_ptrs, (lo | (hi << 4)).to(tl.uint8), mask=cm)
    tl.store(s_ptrs, scale, mask=tl.max(m.to(tl.int32), 1)[:, None] > 0)


@triton.jit
def _store_rows(
    x, m, c, h, d, heads, head_dim, signs, hs,
    BITS: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, B: tl.constexpr,
    LOG_B: tl.constexpr,
):  # fmt: skip
    """x [BLOCK_H, BLOCK_D] float32 heads (valid where m) into their slot's rows starting at c [BLOCK_H, 1], in the
    page format BITS names (8: int8 rows, 4: 4-bit rows rotated first where ROT, 0: the cache's float dtype)."""
    if BITS == 8:
        quantize_row(x, m, c + d, (c + head_dim).to(tl.pointer_type(tl.float32)))
    elif BITS == 4:
        if ROT:
            x = rotate_rows(x, signs, hs, BLOCK_H, BLOCK_D, B, LOG_B, True)
        j = tl.arange(0, BLOCK_D // 2)[None, :]
        quantize_row4(x, m, c + j, (h < heads) & (2 * j < head_dim),
                      (c + head_dim // 2).to(tl.pointer_type(tl.float32)), BLOCK_H, BLOCK_D)  # fmt: skip
    else:
        ct = c.dtype.element_ty
        tl.store(c + d, round_to(x, ct).to(ct), mask=m)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sg_ptr,
    k_row, k_head, v_row, v_head, kc_slot, kc_head, vc_slot, vc_head,
    heads, head_dim, hs,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    ROT: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding row: nothing to write
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (h < heads) & (d < head_dim)
        r = row.to(tl.int64)
        k = tl.load(k_ptr + r * k_row + h * k_head + d, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * v_row + h * v_head + d, mask=m, other=0.0).to(tl.float32)
        signs = tl.zeros([1, BLOCK_D], tl.float32)
        if (K_BITS == 4) | (V_BITS == 4):
            signs = tl.load(sg_ptr + d, mask=d < head_dim, other=0.0)
        _store_rows(k, m, kc_ptr + slot * kc_slot + h * kc_head, h, d, heads, head_dim, signs, hs,
                    K_BITS, ROT, BLOCK_H, BLOCK_D, B, LOG_B)  # fmt: skip
        _store_rows(v, m, vc_ptr + slot * vc_slot + h * vc_head, h, d, heads, head_dim, signs, hs,
                    V_BITS, ROT, BLOCK_H, BLOCK_D, B, LOG_B)  # fmt: skip


def _last_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=16)
def _signs_on(head_dim: int, device: torch.device) -> torch.Tensor:
    return kvmod.rotation_signs(head_dim).to(device)


def rotation(head_dim: int, device: torch.device) -> tuple[torch.Tensor, float, int]:
    """The 4-bit rows' rotation of heads of `head_dim` as the kernels take it: (float32 signs [head_dim] on
    `device`, 1/sqrt(block) as float32, block); cache.kv's signs and block."""
    block = kvmod.rotation_block(head_dim)
    # cache.kv._fwht multiplies by the float32 of 1/sqrt(block): the same float32 here
    hs = float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))
    return _signs_on(head_dim, torch.device(device)), hs, block


def rotates(*caches: torch.Tensor) -> bool:
    """Whether any of these caches holds rotated 4-bit rows (cache.kv.rotated): the kernels then rotate."""
    return any(kvmod.rotated(c) for c in caches)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [N, kv_heads, head_dim] into the caches [slots, kv_heads, width] at slot_mapping [N].

    Same meaning as kernels.attention.store_kv; k and v may be strided views (of a fused qkv), and a negative slot
    skips its row (padding). Each cache gets rows of its page format (cache/kv.py): float values, int8 rows
    [.., head_dim + 4], 4-bit rows [.., head_dim / 2 + 4] (uint8), with cache.kv.write_rows's bits.
    """
    n, heads, head_dim = k.shape
    for c, x in ((k_cache, k), (v_cache, v)):
        if page_head_dim(c) != head_dim or x.shape[-1] != head_dim:
            raise InvalidArgument(f"store_kv: rows of {head_dim} into a {c.dtype} cache {tuple(c.shape)}")
    if n == 0:
        return
    k, v = _last_dense(k), _last_dense(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be dense in head_dim"
    kb, vb = page_bits(k_cache), page_bits(v_cache)
    signs, hs, block = rotation(head_dim, k.device) if 4 in (kb, vb) else (k, 1.0, 1)
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, signs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        heads, head_dim, hs,
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(max(head_dim, 2)), K_BITS=kb, V_BITS=vb,
        ROT=rotates(k_cache, v_cache), B=block, LOG_B=block.bit_length() - 1, enable_fp_fusion=False,
    )  # fmt: skip
