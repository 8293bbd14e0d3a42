"""Paged attention over the KV cache: one kernel for decode and mixed prefill/decode steps.

A program takes one tile of a sequence's query rows (`block_q` tokens x the G query heads that
share one KV head, so each key block is loaded once for the whole group) and one split of the
keys that tile can see; it walks the keys through the block_table with an online softmax.
Decode steps (one row per sequence) use block_q = 1 and split the keys over several programs
(flash-decoding); a second kernel merges the splits. Causal and sliding-window masks come from
each row's position, as in the torch reference (kernels.attention.paged_attention).

Pages are read in their format (cache/kv.py), keys and values each in their own: float values, int8 codes
times their row's scale, or rotated 4-bit codes times their row's scale, never a dense copy. Over rotated keys
q . k = (R q) . (R k): each q head is rotated once in the kernel; over rotated values the output is rotated back
once per head (sum p R v = R sum p v), by the kernel or, with key splits, by the merge.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata, QKVSpec
from superslm.kernels.triton._util import FLOATS, interpreted, next_pow2, page_bits, page_head_dim, round_to
from superslm.kernels.triton.fused import _fits, _heads, prepare_qkv
from superslm.kernels.triton.paged_args import PagedArgs, paged_args
from superslm.kernels.triton.store_kv import rotate_rows, rotates, rotation

_LOG2E = 1.4426950408889634


@triton.jit
def _page_rows(row_ptrs, d, m, row_ok, head_dim, T: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] float32 values of the page rows starting at row_ptrs [BLOCK_N]: float values (BITS 0), or
    int8 codes (8) or 4-bit codes - 8 (4, two a byte, lane 2i low) times their row's float32 scale (after the
    codes), rounded to T as cache.kv.dequantize_rows / dequantize_rows4 do (4-bit rows stay rotated)."""
    # one return: the compiler types every return of a jit function alike, even one a constexpr branch skips
    if BITS == 8:
        codes = tl.load(row_ptrs[:, None] + d[None, :], mask=m, other=0).to(tl.float32)
        scale = tl.load((row_ptrs + head_dim).to(tl.pointer_type(tl.float32)), mask=row_ok, other=0.0)
        rows = round_to(codes * scale[:, None], T)
    elif BITS == 4:
        # the packed bytes as they lie (contiguous loads), each split in its two codes; 0x88 (two zeros) past them
        j = tl.arange(0, BLOCK_D // 2)
        jm = row_ok[:, None] & (2 * j < head_dim)[None, :]
        b = tl.load(row_ptrs[:, None] + j[None, :], mask=jm, other=136).to(tl.int32)
        codes = tl.reshape(tl.join((b & 15) - 8, (b >> 4) - 8), [BLOCK_N, BLOCK_D]).to(tl.float32)
        scale = tl.load((row_ptrs + head_dim // 2).to(tl.pointer_type(tl.float32)), mask=row_ok, other=0.0)
        rows = round_to(codes * scale[:, None], T)
    else:
        rows = tl.load(row_ptrs[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)  # exact
    return rows


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, ml_ptr,
    bt_ptr, sl_ptr, qs_ptr, pos_ptr, item_ptr,
    q_row, q_head, k_slot, k_head, v_slot, v_head, o_row, o_head,
    bt_stride, page_size, heads, head_dim, window, num_splits, qk_scale,
    qb_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, slot_ptr, cs_row, kv_heads, rot, n_slots, eps, sg_ptr, hs,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
    PREP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_ROT: tl.constexpr, V_ROT: tl.constexpr, B: tl.constexpr,
    LOG_B: tl.constexpr,
):  # fmt: skip
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(item_ptr + 2 * item)
    start = tl.load(item_ptr + 2 * item + 1)
    end = tl.load(qs_ptr + seq + 1)
    seq_len = tl.load(sl_ptr + seq)

    # tile row r is token start + r // G, query head kvh * G + r % G
    r = tl.arange(0, BLOCK_M)
    tok = start + r // G
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < end)
    tok64 = tok.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    qpos = tl.load(pos_ptr + tok64, mask=row_ok, other=0).to(tl.int32)
    qm = row_ok[:, None] & d_ok[None, :]
    T = o_ptr.dtype.element_ty
    if PREP:
        # decode (BLOCK_Q = 1): q_ptr is the row's qkv matmul output; prepare_qkv's q heads kvh*G.. in registers
        src = q_ptr + start.to(tl.int64) * q_row
        cs = start.to(tl.int64) * cs_row
        q = _heads(src + kvh * G * head_dim, qb_ptr + kvh * G * head_dim, qn_ptr, cos_ptr + cs, sin_ptr + cs, G,
                   head_dim, rot, eps, HAS_BIAS, NORM, WEIGHT_IN_FLOAT, T, BLOCK_M, BLOCK_D)  # fmt: skip
    else:
        q = tl.load(q_ptr + tok64[:, None] * q_row + head[:, None] * q_head + d[None, :], mask=qm, other=0.0)
    if K_ROT | V_ROT:
        signs = tl.load(sg_ptr + d, mask=d_ok, other=0.0)[None, :]
    if K_ROT:  # into the keys' basis, rounded to T as the reference's rotate(q).to(q.dtype)
        q = round_to(rotate_rows(q.to(tl.float32), signs, hs, BLOCK_M, BLOCK_D, B, LOG_B, True), T)
    dot_ty = tl.float32 if F32_DOT else T
    q = q.to(dot_ty)

    # keys this tile can see: [lo, hi), then this program's share of them
    hi = tl.minimum(tl.max(tl.where(row_ok, qpos, -1)) + 1, seq_len)
    first = tl.min(tl.where(row_ok, qpos, 2147483647)) - window + 1
    # key blocks start at multiples of BLOCK_N: a row meets the same blocks whatever its tile (batch invariance)
    lo = tl.where(window > 0, tl.maximum(first, 0), 0) // BLOCK_N * BLOCK_N
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    if PREP:
        # the program whose keys hold the row's own position stores its k and v (prepare_qkv's), then reads
        # them back in the loop below: a barrier makes the block's stores visible to the block's loads
        p0 = tl.load(pos_ptr + start).to(tl.int32)
        slot0 = tl.load(slot_ptr + tl.minimum(start, n_slots - 1)).to(tl.int64)
        if (p0 >= lo) & (p0 < hi) & (start < n_slots) & (slot0 >= 0):
            ko = heads * head_dim + kvh * head_dim
            k_new = _heads(src + ko, qb_ptr + ko, kn_ptr, cos_ptr + cs, sin_ptr + cs, 1, head_dim, rot, eps,
                           HAS_BIAS, NORM, WEIGHT_IN_FLOAT, T, 2, BLOCK_D)  # [2, BLOCK_D], row 0  # fmt: skip
            h2 = tl.arange(0, 2)[:, None]
            m2 = (h2 < 1) & d_ok[None, :]
            vo = heads * head_dim + kv_heads * head_dim + kvh * head_dim + h2 * 0 + d[None, :]
            v_new = tl.load(src + vo, mask=m2, other=0.0).to(tl.float32)
            if HAS_BIAS:
                v_new = round_to(v_new + tl.load(qb_ptr + vo, mask=m2, other=0.0).to(tl.float32), T)
            tl.store(k_ptr + slot0 * k_slot + kvh * k_head + h2 * 0 + d[None, :], k_new.to(T), mask=m2)
            tl.store(v_ptr + slot0 * v_slot + kvh * v_head + h2 * 0 + d[None, :], v_new.to(T), mask=m2)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * bt_stride
    for n0 in range(lo, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        k_ok = kp < hi
        page = tl.load(bt_row + kp // page_size, mask=k_ok, other=0).to(tl.int64)
        slot = page * page_size + kp % page_size
        kv_m = k_ok[:, None] & d_ok[None, :]
        # [BLOCK_N, BLOCK_D]: key positions kp of this KV head
        k = _page_rows(k_ptr + slot * k_slot + kvh * k_head, d, kv_m, k_ok, head_dim, T, K_BITS, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k.to(dot_ty)), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        vis = k_ok[None, :] & (kp[None, :] <= qpos[:, None])
        vis = vis & ((window <= 0) | (kp[None, :] > qpos[:, None] - window))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key yet keeps m = -inf: shift by 0 so exp2 gives exact zeros
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _page_rows(v_ptr + slot * v_slot + kvh * v_head, d, kv_m, k_ok, head_dim, T, V_BITS, BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v.to(dot_ty), input_precision="ieee")
        m_i = m_new

    if SPLIT:
        idx = (tok64 * heads + head) * num_splits + split  # [BLOCK_M] rows of [rows, heads, splits]
        tl.store(part_ptr + idx[:, None] * head_dim + d[None, :], acc, mask=qm)
        tl.store(ml_ptr + 2 * idx, m_i, mask=row_ok)
        tl.store(ml_ptr + 2 * idx + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        ot = o_ptr.dtype.element_ty
        if V_ROT:  # out of the values' basis: the reference's unrotate(o).to(o.dtype) of its output in T
            out = rotate_rows(round_to(out, ot), signs, hs, BLOCK_M, BLOCK_D, B, LOG_B, False)
        o_ptrs = o_ptr + tok64[:, None] * o_row + head[:, None] * o_head + d[None, :]
        tl.store(o_ptrs, round_to(out, ot).to(ot), mask=qm)


@triton.jit
def _merge_kernel(
    part_ptr, ml_ptr, o_ptr, sg_ptr, o_row, o_head, heads, head_dim, num_splits, hs,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROT: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = sp < num_splits
    d_ok = d < head_dim
    idx = (row * heads + head) * num_splits + sp
    m = tl.load(ml_ptr + 2 * idx, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + 2 * idx + 1, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
    acc = tl.load(part_ptr + idx[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    ot = o_ptr.dtype.element_ty
    if ROT:  # partials over rotated values: the merged head rotated back once (see `_attn_kernel`)
        signs = tl.load(sg_ptr + d, mask=d_ok, other=0.0)[None, :]
        out = tl.reshape(rotate_rows(tl.reshape(round_to(out, ot), [1, BLOCK_D]), signs, hs, 1, BLOCK_D, B, LOG_B,
                                     False), [BLOCK_D])  # fmt: skip
    tl.store(o_ptr + row * o_row + head * o_head + d, round_to(out, ot).to(ot), mask=d_ok)


def attn_config(groups: int, head_dim: int, dtype: torch.dtype, decode: bool, interp: bool) -> dict[str, int]:
    """Tile sizes of `_attn_kernel`: block_q query tokens x G heads per tile (>= 16 rows for tl.dot),
    block_n keys per iteration, num_warps; sized so bf16 tiles fit in registers without spills on sm_90."""
    if decode:
        block_q = 1
    else:
        rows = 16 if interp else (64 if head_dim <= 128 and dtype != torch.float32 else 32)
        block_q = max(1, rows // groups)
    return _tile(block_q, groups, head_dim, dtype, interp)


def _tile(block_q: int, groups: int, head_dim: int, dtype: torch.dtype, interp: bool) -> dict[str, int]:
    block_m = max(16, next_pow2(block_q * groups))
    block_n = 32 if interp or dtype == torch.float32 else 64
    return {"block_q": block_q, "block_m": block_m, "block_n": block_n, "num_warps": _warps(block_m, head_dim)}


def _warps(block_m: int, head_dim: int) -> int:
    return 8 if block_m >= 64 or head_dim > 128 else 4


def invariant_config(groups: int, head_dim: int, dtype: torch.dtype, interp: bool) -> dict[str, int]:
    """Deterministic mode's one tile for every step, decode or prompt chunk: block_q tokens of 16 query
    rows (or one token of G heads), no key splits."""
    return _tile(max(1, 16 // groups), groups, head_dim, dtype, interp)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(args: PagedArgs, programs: int, window: int | None, device: torch.device) -> int:
    """Key splits for a decode step: enough programs to fill the device, >= 256 keys per split."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    keys = args.max_seq_len if window is None else min(args.max_seq_len, window)
    return max(1, min(triton.cdiv(2 * sms, max(programs, 1)), triton.cdiv(keys, 256), 32))


class Prep(NamedTuple):
    """prepare_qkv's inputs (kernels.fused.prepare_qkv) for a decode step whose attention kernel prepares its
    own q, k and v: q heads in registers, each row's k and v stored by the program that reads them first."""

    bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    norm_float: bool
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    args: PagedArgs,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    prep: Prep | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The attention kernel's launch: (out, None), or with key splits (out unwritten, (part, ml)): each split's
    float32 (acc [rows, heads, splits, D], (max, sum) [rows, heads, splits, 2]) for `_merge_kernel`'s combine
    (over rotated 4-bit values, in their rotated basis: `_merge_kernel` rotates back). Arguments as
    `paged_attention_args`.
    """
    kv_heads, head_dim = k_cache.shape[1], page_head_dim(k_cache)
    kb, vb = page_bits(k_cache), page_bits(v_cache)
    floats = [c.dtype in FLOATS for c in (k_cache, v_cache) if not page_bits(c)]
    if (kb == 0) != (vb == 0) or not all(floats) or ((kb or vb) and prep is not None):
        # keys and values both float or both quantized rows (int8 or 4-bit, cache/kv.py's formats); a kernel that
        # prepares its own k and v stores floats
        raise InvalidArgument(f"attention over {k_cache.dtype} keys and {v_cache.dtype} values"
                              + (" preparing its own q, k, v" if prep is not None else ""))
    if page_head_dim(v_cache) != head_dim:
        raise InvalidArgument(f"keys {tuple(k_cache.shape)} and values {tuple(v_cache.shape)} of different heads")
    if prep is not None:
        n, heads = q.shape[0], q.shape[1] // head_dim - 2 * kv_heads
        if args.max_query_len != 1:
            raise InvalidArgument("attention with prepare_qkv inside takes decode steps only")
    else:
        n, heads, _ = q.shape
        if head_dim != q.shape[2]:
            raise InvalidArgument(f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}")
    if heads <= 0 or heads % kv_heads or v_cache.shape[1] != kv_heads:
        raise InvalidArgument(f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}")
    if window is not None and window <= 0:
        raise InvalidArgument(f"sliding window must be positive, not {window}")
    groups = heads // kv_heads
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    if args.num_rows == 0:
        return out, None
    interp = interpreted(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be dense in head_dim"
    decode = args.max_query_len == 1
    cfg = attn_config(groups, head_dim, q.dtype, decode, interp)
    block_q = block_q or cfg["block_q"]
    block_m = max(16, next_pow2(block_q * groups))  # tl.dot needs >= 16 rows
    block_n = block_n or cfg["block_n"]
    num_warps = _warps(block_m, head_dim)  # of the tile that runs: one tile, one compiled kernel
    items, num_items = args.items(block_q)
    if num_splits is None:
        num_splits = _num_splits(args, num_items * kv_heads, window, q.device) if decode else 1
    split = num_splits > 1
    part = ml = out  # unused unless split
    if split:
        part = torch.empty(args.num_rows, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(args.num_rows, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    p = prep
    norm = p is not None and p.q_norm is not None and p.k_norm is not None
    slots = q if p is None else p.slot_mapping
    n_slots = 0 if p is None else p.slot_mapping.shape[0]
    if p is not None and n_slots == 0:
        slots, n_slots = torch.full((1,), -1, dtype=torch.long, device=q.device), 1
    k_rot, v_rot = rotates(k_cache), rotates(v_cache)
    signs, hs, block = rotation(head_dim, q.device) if k_rot or v_rot else (q, 1.0, 1)
    _attn_kernel[(num_items, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part, ml,
        args.block_table, args.seq_lens, args.query_start, args.positions, items,
        q.stride(0), 0 if p else q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1),
        args.block_table.stride(0), args.page_size, heads, head_dim, window or 0, num_splits, scale * _LOG2E,
        q if p is None or p.bias is None else p.bias, p.q_norm if norm else q, p.k_norm if norm else q,
        q if p is None else p.cos, q if p is None else p.sin, slots, 0 if p is None else p.cos.stride(0),
        kv_heads, 0 if p is None else p.cos.shape[-1], n_slots, 0.0 if p is None else float(p.eps), signs, hs,
        G=groups, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(max(head_dim, 16)),
        SPLIT=split, F32_DOT=interp or q.dtype == torch.float32,
        PREP=p is not None, HAS_BIAS=p is not None and p.bias is not None, NORM=norm,
        WEIGHT_IN_FLOAT=p is not None and p.norm_float, K_BITS=kb, V_BITS=vb, K_ROT=k_rot, V_ROT=v_rot, B=block,
        LOG_B=block.bit_length() - 1,
        # prepare_qkv's roundings step by step: no fused multiply-adds where it prepares
        num_warps=num_warps, enable_fp_fusion=p is None,
    )  # fmt: skip
    return out, ((part, ml) if split else None)


def paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    args: PagedArgs,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    prep: Prep | None = None,
) -> torch.Tensor:
    """Paged attention on prepared PagedArgs; q [N, heads, D] -> [N, heads, D] (rows past args.num_rows untouched).

    `num_splits` (key splits per tile; decode default: fill the device), `block_q` (query tokens
    per tile; default 1 for a decode step, else ~64 rows / G) and `block_n` (keys per iteration)
    only change the float rounding, never the meaning. With `prep` (a decode step only), q is the qkv
    matmul's output [N, (heads + 2 kv_heads) D] and the kernel does prepare_qkv's work first.
    """
    out, partials = attend(q, k_cache, v_cache, args, window, scale, num_splits, block_q, block_n, prep)
    if partials is not None:
        part, ml = partials
        heads, splits, head_dim = part.shape[1], part.shape[2], part.shape[3]
        rot = rotates(v_cache)
        signs, hs, block = rotation(head_dim, out.device) if rot else (out, 1.0, 1)
        _merge_kernel[(args.num_rows, heads)](
            part, ml, out, signs, out.stride(0), out.stride(1), heads, head_dim, splits, hs,
            BLOCK_S=next_pow2(splits), BLOCK_D=next_pow2(head_dim), ROT=rot, B=block, LOG_B=block.bit_length() - 1,
            enable_fp_fusion=True,
        )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same signature and meaning as kernels.attention.paged_attention; q [N, heads, D] -> [N, heads, D]."""
    return paged_attention_args(q, k_cache, v_cache, paged_args(meta, q.device), window, scale, num_splits)


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Same signature and meaning as kernels.attention_invariant.paged_attention_invariant: a row's bits do not
    depend on the other rows of its step nor on how its prompt was chunked; q [N, heads, D] -> [N, heads, D],
    rows past the metadata's (deterministic padding) zeros.

    Every step runs one compiled kernel (`invariant_config`) without key splits, so a row is reduced by one
    program over key blocks aligned to position 0, in order; blocks it cannot see (its tile's other rows'
    keys) leave its online softmax exactly as it was (p = 0, alpha = 1, or all zeros before its first key).
    """
    args = paged_args(meta, q.device)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    cfg = invariant_config(max(1, heads // max(kv_heads, 1)), q.shape[2], q.dtype, interpreted(q))
    out = paged_attention_args(q, k_cache, v_cache, args, window, scale, num_splits=1, block_q=cfg["block_q"],
                               block_n=cfg["block_n"])  # fmt: skip
    if out.shape[0] > args.num_rows:
        out[args.num_rows :].zero_()
    return out


def prepare_attention(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.prepare_attention. A decode step runs one launch (and the
    merge of its key splits): the attention kernel prepares q, k and v itself; other steps, and operands the
    kernel does not take, run prepare_qkv's kernel first."""
    args = paged_args(meta, qkv.device)
    prep = prep_for(qkv, spec, cos, sin, k_cache, v_cache, meta, args)
    if prep is None:
        q = prepare_qkv(qkv, spec, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_args(q, k_cache, v_cache, args, spec.window, spec.scale)
    return paged_attention_args(qkv, k_cache, v_cache, args, spec.window, spec.scale, prep=prep)


def prep_for(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    args: PagedArgs,
) -> Prep | None:
    """The `prep` of a decode step whose attention kernel can prepare its own q, k and v (prepare_qkv's operands
    in the kernel's one-dtype, dense-head layout), else None."""
    heads, kv_heads, bias, q_norm, k_norm = spec.heads, spec.kv_heads, spec.bias, spec.q_norm, spec.k_norm
    head_dim = spec.head_dim(qkv)
    norm = spec.norm
    rot = cos.shape[-1]
    # every row a sequence's own decode row, every row with a slot: then the program reading a row's position
    # stores exactly what prepare_qkv would (rows past slot_mapping, e.g. deterministic padding, go apart)
    fits = (
        args.max_query_len == 1 and qkv.dim() == 2 and qkv.shape[0] == args.num_rows == meta.slot_mapping.shape[0]
        and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
        and tuple(k_cache.shape[1:]) == (kv_heads, head_dim) and rot % 2 == 0 and 0 < rot <= head_dim
        and _fits(qkv, k_cache, v_cache, head_dim, bias, q_norm if norm else None, k_norm if norm else None, cos,
                  sin)
    )  # fmt: skip
    if not fits:
        return None
    return Prep(bias, q_norm, k_norm, spec.eps, spec.norm_float, cos.contiguous(), sin.contiguous(), meta.slot_mapping)
