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
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        if a == b:
            continue
        n, length = b - a, meta.seq_lens[s]
        blocks = _pow2(-(-length // BLOCK))
        padded = blocks * BLOCK
        slots = meta.key_slots(s)
        k = _pad_rows(k_cache[slots].to(q.dtype), 0, padded)  # [Lp, kv_heads, D]
        v = _pad_rows(v_cache[slots].to(q.dtype), 0, padded)
        # queries grouped by kv head: [kv_heads, groups * n16, D]
        qs = _pad_rows(q[a:b], 0, BLOCK).view(-1, kv_heads, groups, d).permute(1, 2, 0, 3)
        m16 = qs.shape[2]
        qs = qs.reshape(kv_heads, groups * m16, d)
        scores = torch.bmm(qs, k.permute(1, 2, 0)) * scale  # [kv_heads, G*M, Lp]
        qpos = _pad_rows(meta.positions[a:b], 0, BLOCK)
        kpos = torch.arange(padded, device=q.device)
        visible = kpos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= kpos[None, :] > (qpos[:, None] - window)
        visible[n:] = False
        visible = visible.repeat(groups, 1)  # rows ordered (group, row) as in qs
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # padded rows see no key
        p = torch.exp(scores - top)  # masked keys give exact zeros
        denom = tree_sum(p)  # [kv_heads, G*M]
        # P @ V per 16-key block, then a tree over blocks
        pb = p.view(kv_heads, groups * m16, blocks, BLOCK).permute(0, 2, 1, 3).reshape(-1, groups * m16, BLOCK)
        vb = v.view(blocks, BLOCK, kv_heads, d).permute(2, 0, 1, 3).reshape(-1, BLOCK, d)
        partial = torch.bmm(pb, vb).view(kv_heads, blocks, groups * m16, d)
        acc = tree_sum(partial.permute(0, 2, 3, 1))  # [kv_heads, G*M, D]
        o = acc / denom.clamp_min(torch.finfo(acc.dtype).tiny)[..., None]
        # back to [rows, heads, D]: heads are ordered (kv head, group)
        o = o.view(kv_heads, groups, m16, d).permute(2, 0, 1, 3).reshape(m16, heads, d)
        out[a:b] = o[:n]
    return out
