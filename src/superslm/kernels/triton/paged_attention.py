"""Paged attention over the KV cache: one kernel for decode and mixed prefill/decode steps.

A program takes one tile of a sequence's query rows (`block_q` tokens x the G query heads that
share one KV head, so each key block is loaded once for the whole group) and one split of the
keys that tile can see; it walks the keys through the block_table with an online softmax.
Decode steps (one row per sequence) use block_q = 1 and split the keys over several programs
(flash-decoding); a second kernel merges the splits. Causal and sliding-window masks come from
each row's position, as in the torch reference (kernels.attention.paged_attention).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata
from superslm.kernels.triton._util import interpreted, next_pow2, round_to
from superslm.kernels.triton.paged_args import PagedArgs, paged_args

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, ml_ptr,
    bt_ptr, sl_ptr, qs_ptr, pos_ptr, item_ptr,
    q_row, q_head, k_slot, k_head, v_slot, v_head, o_row, o_head,
    bt_stride, page_size, heads, head_dim, window, num_splits, qk_scale,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
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
    q = tl.load(q_ptr + tok64[:, None] * q_row + head[:, None] * q_head + d[None, :], mask=qm, other=0.0)
    dot_ty = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    q = q.to(dot_ty)

    # keys this tile can see: [lo, hi), then this program's share of them
    hi = tl.minimum(tl.max(tl.where(row_ok, qpos, -1)) + 1, seq_len)
    first = tl.min(tl.where(row_ok, qpos, 2147483647)) - window + 1
    lo = tl.where(window > 0, tl.maximum(first, 0), 0)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

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
        k = tl.load(k_ptr + slot[:, None] * k_slot + kvh * k_head + d[None, :], mask=kv_m, other=0.0)
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
        v = tl.load(v_ptr + slot[:, None] * v_slot + kvh * v_head + d[None, :], mask=kv_m, other=0.0)
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
        o_ptrs = o_ptr + tok64[:, None] * o_row + head[:, None] * o_head + d[None, :]
        tl.store(o_ptrs, round_to(out, ot).to(ot), mask=qm)


@triton.jit
def _merge_kernel(
    part_ptr, ml_ptr, o_ptr, o_row, o_head, heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(o_ptr + row * o_row + head * o_head + d, round_to(out, ot).to(ot), mask=d_ok)


def attn_config(groups: int, head_dim: int, dtype: torch.dtype, decode: bool, interp: bool) -> dict[str, int]:
    """Tile sizes of `_attn_kernel`: block_q query tokens x G heads per tile (>= 16 rows for tl.dot),
    block_n keys per iteration, num_warps; sized so bf16 tiles fit in registers without spills on sm_90."""
    if decode:
        block_q = 1
    else:
        rows = 16 if interp else (64 if head_dim <= 128 and dtype != torch.float32 else 32)
        block_q = max(1, rows // groups)
    block_m = max(16, next_pow2(block_q * groups))
    block_n = 32 if interp or dtype == torch.float32 else 64
    num_warps = 8 if block_m >= 64 or head_dim > 128 else 4
    return {"block_q": block_q, "block_m": block_m, "block_n": block_n, "num_warps": num_warps}


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
) -> torch.Tensor:
    """Paged attention on prepared PagedArgs; q [N, heads, D] -> [N, heads, D] (rows past args.num_rows untouched).

    `num_splits` (key splits per tile; decode default: fill the device), `block_q` (query tokens
    per tile; default 1 for a decode step, else ~64 rows / G) and `block_n` (keys per iteration)
    only change the float rounding, never the meaning.
    """
    n, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or v_cache.shape[1] != kv_heads or k_cache.shape[2] != head_dim:
        raise InvalidArgument(f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}")
    if window is not None and window <= 0:
        raise InvalidArgument(f"sliding window must be positive, not {window}")
    groups = heads // kv_heads
    out = torch.empty_like(q)
    if args.num_rows == 0:
        return out
    interp = interpreted(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be dense in head_dim"
    decode = args.max_query_len == 1
    cfg = attn_config(groups, head_dim, q.dtype, decode, interp)
    block_q = block_q or cfg["block_q"]
    block_m = max(16, next_pow2(block_q * groups))  # tl.dot needs >= 16 rows
    block_n = block_n or cfg["block_n"]
    items, num_items = args.items(block_q)
    if num_splits is None:
        num_splits = _num_splits(args, num_items * kv_heads, window, q.device) if decode else 1
    split = num_splits > 1
    part = ml = out  # unused unless split
    if split:
        part = torch.empty(args.num_rows, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(args.num_rows, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _attn_kernel[(num_items, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part, ml,
        args.block_table, args.seq_lens, args.query_start, args.positions, items,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        args.block_table.stride(0), args.page_size, heads, head_dim, window or 0, num_splits, scale * _LOG2E,
        G=groups, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(max(head_dim, 16)),
        SPLIT=split, F32_DOT=interp or q.dtype == torch.float32,
        num_warps=cfg["num_warps"], enable_fp_fusion=True,
    )  # fmt: skip
    if split:
        _merge_kernel[(args.num_rows, heads)](
            part, ml, out, out.stride(0), out.stride(1), heads, head_dim, num_splits,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(head_dim), enable_fp_fusion=True,
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

