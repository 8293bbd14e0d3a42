"""KV store by slot mapping: each row's key and value heads go to one flat slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels.triton._util import next_pow2, round_to


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    k_row, k_head, v_row, v_head, kc_slot, kc_head, vc_slot, vc_head,
    heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
        tl.store(kc_ptr + slot * kc_slot + h * kc_head + d, round_to(k, kt).to(kt), mask=m)
        tl.store(vc_ptr + slot * vc_slot + h * vc_head + d, round_to(v, vt).to(vt), mask=m)


def _last_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [N, kv_heads, head_dim] into the caches [slots, kv_heads, head_dim] at slot_mapping [N].

    Same meaning as kernels.attention.store_kv; k and v may be strided views (of a fused qkv), and
    a negative slot skips its row (padding).
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
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim), enable_fp_fusion=False,
    )  # fmt: skip
