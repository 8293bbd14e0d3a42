"""KV store by slot mapping: each row's key and value heads go to one flat slot of the paged cache, in the cache's
page format (cache/kv.py): float values, or int8 rows (head_dim codes, then the float32 scale's 4 bytes)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels.triton._util import next_pow2, round_to

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
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    k_row, k_head, v_row, v_head, kc_slot, kc_head, vc_slot, vc_head,
    heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding row: nothing to write
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (h < heads) & (d < head_dim)
        r = row.to(tl.int64)
        k = tl.load(k_ptr + r * k_row + h * k_head + d, mask=m).to(tl.float32)
        v = tl.load(v_ptr + r * v_row + h * v_head + d, mask=m).to(tl.float32)
        kt = kc_ptr.dtype.element_ty
        vt = vc_ptr.dtype.element_ty
        kc = kc_ptr + slot * kc_slot + h * kc_head
        vc = vc_ptr + slot * vc_slot + h * vc_head
        if K_INT8:
            quantize_row(k, m, kc + d, (kc + head_dim).to(tl.pointer_type(tl.float32)))
        else:
            tl.store(kc + d, round_to(k, kt).to(kt), mask=m)
        if V_INT8:
            quantize_row(v, m, vc + d, (vc + head_dim).to(tl.pointer_type(tl.float32)))
        else:
            tl.store(vc + d, round_to(v, vt).to(vt), mask=m)


def _last_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [N, kv_heads, head_dim] into the caches [slots, kv_heads, head_dim] at slot_mapping [N].

    Same meaning as kernels.attention.store_kv; k and v may be strided views (of a fused qkv), and
    a negative slot skips its row (padding). An int8 cache [slots, kv_heads, head_dim + 4] gets int8 rows.
    """
    n, heads, head_dim = k.shape
    if n == 0:
        return
    k, v = _last_dense(k), _last_dense(v)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be dense in head_dim"
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        heads, head_dim,
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim), K_INT8=k_cache.dtype == torch.int8,
        V_INT8=v_cache.dtype == torch.int8, enable_fp_fusion=False,
    )  # fmt: skip
