"""A decode step's attention and the o projection after it, the key splits' merge inside the next kernel.

Reference: kernels.fused.attention_linear (same signature). A decode step's attention runs its keys in splits
(flash-decoding) and a second launch merges them; at a few rows the o projection is a GEMV whose every program
needs the whole attention row anyway, so `_merge_gemv_kernel` merges the splits of a few heads at a time (the
merge's own arithmetic and rounding, kernels/triton/paged_attention.py `_merge_kernel`) and multiplies them by
its outputs' weights: one launch fewer a layer. Each program re-reads the float32 partials from cache; splits
that saw no key are not read (their weight is zero). A Hadamard-rotated (int4/int8) o projection takes its input
from `_merge_rotate_kernel` instead: the merge, the linear's cast and input rotation in one launch, where the
merge and the Hadamard kernel took two (references: kernels.fused.attention_linear, attention_rotate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from superslm.kernels import fused as ref
from superslm.kernels.attention import AttnMetadata, QKVSpec
from superslm.kernels.triton._util import FLOATS, gemv_block_n, interpreted, next_pow2, page_head_dim, round_to
from superslm.kernels.triton.hadamard import h_scale, hadamard_config, hadamard_rotate, rotated_input
from superslm.kernels.triton.norm_rotate import rotation_ok
from superslm.kernels.triton.paged_args import paged_args
from superslm.kernels.triton.paged_attention import attend, prep_for, prepare_attention


@triton.jit
def _merge_gemv_kernel(
    part_ptr, ml_ptr, w_ptr, o_ptr,
    heads, head_dim, num_splits, w_row, o_row, n_out,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    T = o_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    n64 = n.to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    acc = tl.zeros([BLOCK_N], tl.float32)
    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < heads
        idx = (row * heads + h)[:, None] * num_splits + sp[None, :]  # [heads, splits] of [rows, heads, splits]
        sm = h_ok[:, None] & (sp < num_splits)[None, :]
        m = tl.load(ml_ptr + 2 * idx, mask=sm, other=float("-inf"))
        l_s = tl.load(ml_ptr + 2 * idx + 1, mask=sm, other=0.0)
        top = tl.max(m, 1)
        w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top)[:, None])  # empty splits weigh 0
        total = tl.sum(w * l_s, 1)
        pm = (sm & (l_s > 0))[:, :, None] & d_ok[None, None, :]
        a = tl.load(part_ptr + idx[:, :, None] * head_dim + d[None, None, :], mask=pm, other=0.0)
        x = tl.sum(a * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]  # [heads, D]
        x = round_to(x, T)  # the attention's output, as the merge kernel rounds it
        k = h[:, None] * head_dim + d[None, :]  # the o projection's inputs
        km = h_ok[:, None] & d_ok[None, :]
        wt = tl.load(w_ptr + n64[:, None, None] * w_row + k[None, :, :], mask=n_ok[:, None, None] & km[None, :, :],
                     other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.sum(tl.sum(wt * x[None, :, :], 2), 1)
    tl.store(o_ptr + row * o_row + n, round_to(acc, T).to(T), mask=n_ok)


def merge_gemv_config(n_out: int, head_dim: int, interp: bool) -> dict[str, int]:
    """BLOCK_N outputs a program (~256 programs a row for an H100/H200's 132 SMs), heads a step so that a step
    covers ~256 inputs."""
    block_d = next_pow2(head_dim)
    # the interpreter pays per program, not per element: few, wide programs
    block_n = min(128, next_pow2(n_out)) if interp else gemv_block_n(n_out)
    return {"block_n": block_n, "block_h": max(1, 256 // block_d), "block_d": block_d, "num_warps": 4}


def attention_linear(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    w: torch.Tensor,
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.attention_linear. A decode step whose attention splits its keys:
    the attention kernel (preparing q, k, v itself) and `_merge_gemv_kernel`; otherwise prepare_attention and
    torch's matmul."""
    n, heads = qkv.shape[0], spec.heads
    head_dim = page_head_dim(k_cache)
    args = paged_args(meta, qkv.device)
    prep = prep_for(qkv, spec, cos, sin, k_cache, v_cache, meta, args)
    dense_w = w.dim() == 2 and w.shape[1] == heads * head_dim and w.dtype == qkv.dtype and w.stride(-1) == 1
    if prep is None or not dense_w or args.num_rows != n:
        o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
        return F.linear(o.reshape(n, heads * o.shape[-1]), w)
    out, partials = attend(qkv, k_cache, v_cache, args, spec.window, spec.scale, prep=prep)
    if partials is None:  # one split: the attention wrote its output
        return F.linear(out.reshape(n, heads * head_dim), w)
    part, ml = partials
    n_out = w.shape[0]
    y = torch.empty(n, n_out, dtype=qkv.dtype, device=qkv.device)
    cfg = merge_gemv_config(n_out, head_dim, interpreted(qkv))
    splits = part.shape[2]
    _merge_gemv_kernel[(triton.cdiv(n_out, cfg["block_n"]), n)](
        part, ml, w, y, heads, head_dim, splits, w.stride(0), y.stride(0), n_out,
        BLOCK_N=cfg["block_n"], BLOCK_H=cfg["block_h"], BLOCK_S=next_pow2(splits), BLOCK_D=cfg["block_d"],
        num_warps=cfg["num_warps"], enable_fp_fusion=True,
    )  # fmt: skip
    return y


@triton.jit
def _merge_rotate_kernel(
    part_ptr, ml_ptr, s_ptr, o_ptr, t_ptr,
    R, NB, heads, head_dim, num_splits, width, k, hs,
    BLOCK_R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (row, block) pairs: row r // NB, block r % NB
    r_ok = (r < R)[:, None]
    row = (r // NB).to(tl.int64)[:, None]
    c = ((r % NB) * B)[:, None] + tl.arange(0, B)[None, :]  # [pairs, b]: the o projection's input index
    m_ok = r_ok & (c < width)  # inputs past heads x head_dim up to k: the linear's zero padding
    base = (row * heads + c // head_dim) * num_splits  # [pairs, b]: split 0 of each input's head
    top = tl.full([BLOCK_R, B], float("-inf"), tl.float32)
    for sp in range(num_splits):
        top = tl.maximum(top, tl.load(ml_ptr + 2 * (base + sp), mask=m_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)  # no key seen: every weight 0
    num = tl.zeros([BLOCK_R, B], tl.float32)
    den = tl.zeros([BLOCK_R, B], tl.float32)
    for sp in range(num_splits):
        idx = base + sp
        m = tl.load(ml_ptr + 2 * idx, mask=m_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + 2 * idx + 1, mask=m_ok, other=0.0)
        w = tl.exp2(m - top)
        num += w * tl.load(part_ptr + idx * head_dim + c % head_dim, mask=m_ok & (l_s > 0), other=0.0)
        den += w * l_s
    ot = o_ptr.dtype.element_ty
    x = round_to(num / tl.where(den > 0, den, 1.0), t_ptr.dtype.element_ty)  # the attention's output
    h = rotated_input(x, tl.load(s_ptr + c, mask=r_ok, other=0.0).to(tl.float32), hs, ot, BLOCK_R, B, LOG_B)
    tl.store(o_ptr + row * k + c, h.to(ot), mask=r_ok)


def merge_rotate_config(rows: int, block: int, interp: bool) -> dict[str, int]:
    """`hadamard_config`'s tiles with half the (row, block) pairs a program on the GPU: the merge holds three
    more [pairs, b] float32 tiles (max, numerator, denominator), which spilled registers at the Hadamard's size."""
    cfg = hadamard_config(rows, block, interp)
    return cfg if interp else dict(cfg, block_r=max(1, min(cfg["block_r"], 2048 // block)))


def attention_rotate(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.attention_rotate. A decode step whose attention splits its keys:
    the attention kernel and `_merge_rotate_kernel`; otherwise the attention, then the Hadamard kernel."""
    n, heads = qkv.shape[0], spec.heads
    head_dim = page_head_dim(k_cache)
    width, k = heads * head_dim, signs.shape[0]
    args = paged_args(meta, qkv.device)
    prep = prep_for(qkv, spec, cos, sin, k_cache, v_cache, meta, args)
    if prep is None or not rotation_ok(width, signs, block) or dtype not in FLOATS:
        o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
        return ref.linear_input(o.reshape(n, width), signs, block, dtype, hadamard_rotate)
    out, partials = attend(qkv, k_cache, v_cache, args, spec.window, spec.scale, prep=prep)
    if partials is None:  # one split: the attention wrote its output
        return ref.linear_input(out.reshape(n, width), signs, block, dtype, hadamard_rotate)
    part, ml = partials
    y = torch.empty(n, k, dtype=dtype, device=qkv.device)
    rows = n * (k // block)  # (row, block) pairs
    interp = interpreted(qkv)
    cfg = merge_rotate_config(rows, block, interp)
    _merge_rotate_kernel[(triton.cdiv(rows, cfg["block_r"]),)](
        part, ml, signs.to(qkv.device).contiguous(), y, qkv,
        rows, k // block, heads, head_dim, part.shape[2], width, k, h_scale(block, dtype),
        BLOCK_R=cfg["block_r"], B=block, LOG_B=block.bit_length() - 1, num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )  # fmt: skip
    return y

