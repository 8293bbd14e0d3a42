"""Batch-invariant paged attention (deterministic mode), torch reference.

A row's result must not depend on the other rows of its step, nor on how its prompt was chunked. So
every reduction has a shape fixed by the row alone:
- query rows are padded to a multiple of 16 (the matmul kernels then give each row the same bits
  wherever it sits);
- keys are laid out from position 0 in blocks of 16, padded to a power-of-two number of blocks;
  masked keys contribute exact zeros;
- sums over keys are pairwise trees over adjacent leaves, so a longer zero-padded tail only adds
  zero subtrees; P @ V is a matmul per 16-key block followed by the same tree over blocks.
The result equals softmax attention up to float rounding, and is bit-identical for a given row.
"""

from __future__ import annotations

import torch

from superslm.kernels.attention import AttnMetadata

BLOCK = 16


def _pad_rows(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % multiple
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by adding adjacent pairs, level by level."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _attend(
    qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, blocks: int
) -> torch.Tensor:
    """Batched core: qs [B, kv_heads, M, D] (M a multiple of 16), k/v [B, Lp, kv_heads, D] with
    Lp = blocks * 16 keys from position 0, visible [B, M, Lp] -> [B, kv_heads, M, D]."""
    b, kv_heads, m, d = qs.shape
    kt = k.permute(0, 2, 3, 1).reshape(b * kv_heads, d, blocks * BLOCK)
    scores = torch.bmm(qs.reshape(b * kv_heads, m, d), kt).view(b, kv_heads, m, -1) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    top = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # rows that see no key: 0
    p = torch.exp(scores - top)  # masked keys give exact zeros
    # P @ [V | 1] per 16-key block, then one tree over blocks: the last column is the denominator
    ones = v.new_ones(b, blocks * BLOCK, kv_heads, 1)
    pb = p.view(b, kv_heads, m, blocks, BLOCK).permute(0, 1, 3, 2, 4).reshape(-1, m, BLOCK)
    vb = torch.cat([v, ones], -1).view(b, blocks, BLOCK, kv_heads, d + 1).permute(0, 3, 1, 2, 4)
    partial = torch.bmm(pb, vb.reshape(-1, BLOCK, d + 1)).view(b, kv_heads, blocks, m, d + 1)
    acc = tree_sum(partial.permute(0, 1, 3, 4, 2))  # [B, kv_heads, M, D + 1]
    return acc[..., :d] / acc[..., d:].clamp_min(torch.finfo(acc.dtype).tiny)


def _visible(qpos: torch.Tensor, padded: int, window: int | None, real: int) -> torch.Tensor:
    """[rows, Lp] causal (and windowed) visibility; padded query rows see nothing."""
    kpos = torch.arange(padded, device=qpos.device)
    vis = kpos[None, :] <= qpos[:, None]
    if window is not None:
        vis &= kpos[None, :] > (qpos[:, None] - window)
    vis[real:] = False
    return vis


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Same signature and meaning as kernels.attention.paged_attention; q [N, heads, D] -> [N, heads, D]."""
    out = torch.zeros_like(q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    single = [s for s in range(meta.num_seqs) if meta.query_start[s + 1] - meta.query_start[s] == 1]
    if len(single) > 1:
        # every one-row sequence in one batch: keys padded to a common power of two of blocks
        # (zero subtrees), each query row padded to 16 rows as in the chunked path
        blocks = _pow2(max(-(-meta.seq_lens[s] // BLOCK) for s in single))
        padded = blocks * BLOCK
        rows = [meta.query_start[s] for s in single]
        idx = torch.zeros(len(single), padded, dtype=torch.long, device=q.device)
        real = torch.zeros(len(single), padded, dtype=torch.bool, device=q.device)
        for i, s in enumerate(single):
            n = meta.seq_lens[s]
            idx[i, :n] = meta.key_slots(s)
            real[i, :n] = True
        k = (k_cache[idx].to(q.dtype) * real[..., None, None])  # [B, Lp, kv_heads, D], zeros past the end
        v = (v_cache[idx].to(q.dtype) * real[..., None, None])
        row_idx = torch.tensor(rows, device=q.device)
        qs = torch.zeros(len(single), BLOCK, heads, d, dtype=q.dtype, device=q.device)
        qs[:, 0] = q.index_select(0, row_idx)
        qs = qs.view(len(single), BLOCK, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(
            len(single), kv_heads, groups * BLOCK, d)
        qpos = meta.positions.index_select(0, row_idx)
        vis = torch.stack([_visible(p.view(1), padded, window, 1) for p in qpos])  # [B, 1, Lp]
        vis = torch.cat([vis, vis.new_zeros(len(single), BLOCK - 1, padded)], 1).repeat(1, groups, 1)
        o = _attend(qs, k, v, vis, scale, blocks)  # [B, kv_heads, G*16, D]
        o = o.view(len(single), kv_heads, groups, BLOCK, d)[:, :, :, 0].reshape(len(single), heads, d)
        out[row_idx] = o
    done = set(single) if len(single) > 1 else set()
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        if a == b or s in done:
            continue
        n, length = b - a, meta.seq_lens[s]
        blocks = _pow2(-(-length // BLOCK))
        padded = blocks * BLOCK
        slots = meta.key_slots(s)
        k = _pad_rows(k_cache[slots].to(q.dtype), 0, padded)  # [Lp, kv_heads, D]
        v = _pad_rows(v_cache[slots].to(q.dtype), 0, padded)
        # queries grouped by kv head: [kv_heads, groups * n16, D], rows ordered (group, row)
        qs = _pad_rows(q[a:b], 0, BLOCK).view(-1, kv_heads, groups, d).permute(1, 2, 0, 3)
        m16 = qs.shape[2]
        qs = qs.reshape(1, kv_heads, groups * m16, d)
        vis = _visible(_pad_rows(meta.positions[a:b], 0, BLOCK), padded, window, n).repeat(groups, 1)
        o = _attend(qs, k[None], v[None], vis[None], scale, blocks)[0]
        # back to [rows, heads, D]: heads are ordered (kv head, group)
        o = o.view(kv_heads, groups, m16, d).permute(2, 0, 1, 3).reshape(m16, heads, d)
        out[a:b] = o[:n]
    return out
