"""Batch-invariant paged attention (deterministic mode), torch reference.

A row's result must not depend on the other rows of its step, nor on how its prompt was chunked. So
every reduction a row takes part in has an order fixed by the row alone:
- every matrix product has one shape: ROWS (4) query rows by one block of KEYS (64) key positions
  aligned to position 0, the scores [ROWS, D] @ [D, KEYS] and P @ [V | 1] [ROWS, KEYS] @ [KEYS, D + 1]
  (the last column gives the softmax denominator), batched. BLAS libraries choose their kernel, and so
  the order of a dot product's terms, by the matrix shape (MKL on Intel CPUs: a row's scores changed
  between 4 and 64+ rows); one shape gives a row the same bits whatever else is in the batch and
  wherever it sits (`tests/test_deterministic.py` checks this where the tests run). Each query quad
  gets its own copy of its keys and values: memory, not arithmetic, grows with the rows of a unit;
- masked keys give exact zeros;
- the block results are added one after the other in block order (`block_sum`, a cumsum), so
  fully masked blocks, before or after the row's keys, add exact zeros;
- the softmax maximum is exact in any order.
Each step's layout (which q rows, which key slots, masks as an additive bias and as 0/1) is built once
per step and window (`_plan`, cached on the AttnMetadata): a layer then makes ~17 torch calls for all
the sequences that decode, and as many per group of prompt chunks. The arithmetic is float32 (float64
inputs stay float64) whatever the cache's format (int8 rows are dequantized as gathered, each on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from superslm.cache.kv import read_rows
from superslm.kernels.attention import AttnMetadata

#: query rows of every attention matmul
ROWS = 4
#: keys per block: one matmul reduces a block, the blocks are added in order
KEYS = 64
#: query tokens of a prompt chunk per unit of work (a longer chunk is cut; rows are independent)
TILE = 64
#: most elements of one tensor of a group (the keys and values copied per query quad):
#: kv heads * units * quads * keys * (dim + 1); a prompt chunk's tiles are cut shorter to fit
GROUP_BUDGET = 1 << 22
#: a masked score; exp() inputs are clamped to CLAMP first (no denormals: they are ~10x slower)
_MASKED = -1e30
_CLAMP = -80.0


@dataclass
class _Group:
    """Layout of some units (query rows of one sequence): kv heads x units x M/ROWS quads x nb blocks, each
    (quad, block) pair one ROWS x KEYS matmul."""

    units: int
    rows: int  # M, a multiple of ROWS
    blocks: int  # nb; a unit's keys are nb * KEYS slots from its first block on
    q_index: torch.Tensor  # [kv * U * M] rows of q.view(-1, D) (padding rows repeat a real row)
    kv_index: torch.Tensor  # [kv * U * nb * KEYS] rows of k_cache.view(-1, D) (masked keys: any slot)
    bias: torch.Tensor  # [kv * U * M/ROWS * nb, ROWS, KEYS] 0 where the key is visible to the row, _MASKED elsewhere
    visible: torch.Tensor  # [1, U, M/ROWS, nb, ROWS, KEYS] bool
    out_index: torch.Tensor  # [kv * U * M] where each result row goes (padding rows: trash rows)


@dataclass
class _Plan:
    groups: list[_Group]
    #: q rows * heads, and the trash rows after them that take the padding rows' results
    real: int
    total: int
    #: one group covering every row of q once: the output is a gather (`inverse`) instead of a scatter
    inverse: torch.Tensor | None


def block_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 one block after the other, in x's dtype (a cumsum): zero blocks
    anywhere add exact zeros, and no other dim changes the order (torch.sum's does not promise that)."""
    return x.cumsum(1)[:, -1]


def _units(meta: AttnMetadata, window: int | None, kv: int, groups: int, dim: int
           ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:  # fmt: skip
    """(sequence, first row, row count) of the one-row sequences and of the chunk tiles: at most TILE
    tokens, fewer where the keys and values copied for their quads would pass GROUP_BUDGET (a row's
    result does not depend on its tile)."""
    single, chunks = [], []
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        if b - a == 1:
            single.append((s, a, 1))
            continue
        keys = -(-meta.seq_lens[s] // KEYS) * KEYS
        if window is not None:
            keys = min(keys, (-(-(window + TILE) // KEYS) + 1) * KEYS)
        quads = max(1, GROUP_BUDGET // (kv * keys * (dim + 1)))
        tile = max(1, min(TILE, quads * ROWS // groups))
        for t in range(a, b, tile):
            chunks.append((s, t, min(tile, b - t)))
    return single, chunks


def _group(meta: AttnMetadata, units: list[tuple[int, int, int]], pos: list[int], window: int | None,
           kv: int, groups: int, first_out: int, dtype: torch.dtype) -> _Group:
    """The layout of `units`; padding rows send their results to trash rows from `first_out` on."""
    dev = meta.slot_mapping.device
    heads, ps = kv * groups, meta.page_size
    m = -(-max(n for _, _, n in units) * groups // ROWS) * ROWS
    firsts, lasts = [], []
    for _, a, n in units:
        lo = 0 if window is None else max(0, min(pos[a : a + n]) - window + 1)
        firsts.append(lo // KEYS)
        lasts.append(max(pos[a : a + n]) // KEYS)
    nb = max(b - f + 1 for f, b in zip(firsts, lasts))
    u, lp = len(units), nb * KEYS
    # keys: positions from each unit's first block on; past the sequence's end they are masked
    lens = torch.tensor([meta.seq_lens[s] for s, _, _ in units], device=dev)
    kpos = torch.tensor(firsts, device=dev)[:, None] * KEYS + torch.arange(lp, device=dev)[None, :]
    kclip = torch.minimum(kpos, lens[:, None] - 1)
    width = max(len(meta.block_tables[s]) for s, _, _ in units)
    tables = torch.tensor([list(meta.block_tables[s]) + [0] * (width - len(meta.block_tables[s]))
                           for s, _, _ in units], dtype=torch.long, device=dev)
    slots = tables.gather(1, kclip // ps) * ps + kclip % ps  # [U, Lp]
    # query rows ordered (token, group); a padding row repeats the unit's last token
    r = torch.arange(m, device=dev)
    count = torch.tensor([n for _, _, n in units], device=dev)
    tok = torch.minimum(r[None, :] // groups, count[:, None] - 1)  # [U, M]
    row = torch.tensor([a for _, a, _ in units], device=dev)[:, None] + tok
    qpos = torch.tensor(pos, device=dev)[row]
    visible = kpos[:, None, :] <= qpos[:, :, None]  # [U, M, Lp]; every row sees its own key at least
    if window is not None:
        visible &= kpos[:, None, :] > qpos[:, :, None] - window
    # [U, M, Lp] -> [U, M/ROWS, nb, ROWS, KEYS]: one (quad, block) pair per matmul
    visible = visible.view(u, m // ROWS, ROWS, nb, KEYS).transpose(2, 3).contiguous()
    bias = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, _MASKED)
    h = torch.arange(kv, device=dev)[:, None, None] * groups + (r % groups)[None, None, :]  # [kv, 1, M]
    q_index = (row[None] * heads + h).reshape(-1)
    kv_index = (slots[None] * kv + torch.arange(kv, device=dev)[:, None, None]).reshape(-1)
    pad = ~(r[None, :] < count[:, None] * groups).expand(kv, u, m).reshape(-1)
    out_index = q_index.clone()
    out_index[pad] = first_out + torch.arange(int(pad.sum()), device=dev)
    return _Group(u, m, nb, q_index, kv_index, bias.expand(kv, *bias.shape).reshape(-1, ROWS, KEYS), visible[None],
                  out_index)


def _pack(units: list[tuple[int, int, int]], pos: list[int], kv: int, groups: int, dim: int) -> list[list]:
    """Units, longest keys first, in groups whose copied keys and values hold at most GROUP_BUDGET
    elements each (a unit alone may hold more: a decode row's keys are not cut)."""
    units = sorted(units, key=lambda t: -pos[t[1] + t[2] - 1])
    out: list[list[tuple[int, int, int]]] = []
    for t in units:
        if out:
            cur = out[-1]
            keys = (pos[cur[0][1] + cur[0][2] - 1] // KEYS + 1) * KEYS  # the first unit's are the most
            quads = -(-max(n for _, _, n in cur + [t]) * groups // ROWS)
            if kv * (len(cur) + 1) * quads * keys * (dim + 1) <= GROUP_BUDGET:
                cur.append(t)
                continue
        out.append([t])
    return out


def _plan(meta: AttnMetadata, window: int | None, kv: int, groups: int, dim: int, q_rows: int,
          dtype: torch.dtype) -> _Plan:
    dev = meta.slot_mapping.device
    pos = meta.positions.tolist()
    single, chunks = _units(meta, window, kv, groups, dim)
    # decoding sequences apart from prompt chunks: their 1-token units need only ROWS query rows
    batches = _pack(single, pos, kv, groups, dim) + _pack(chunks, pos, kv, groups, dim)
    real = q_rows * kv * groups
    out, total = [], real
    for units in batches:
        g = _group(meta, units, pos, window, kv, groups, total, dtype)
        total += int((g.out_index >= real).sum())
        out.append(g)
    inverse = None
    if len(out) == 1 and meta.query_start[-1] == q_rows:
        inverse = torch.empty(real, dtype=torch.long, device=dev)
        keep = out[0].out_index < real
        inverse[out[0].out_index[keep]] = torch.nonzero(keep)[:, 0]
    return _Plan(out, real, total, inverse)


def _attend(g: _Group, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float, kv: int) -> torch.Tensor:
    """One group: [kv * units * M, D] results in the bias's dtype."""
    d, dt = qf.shape[1], g.bias.dtype
    b, quads, nb = kv * g.units, g.rows // ROWS, g.blocks
    pairs = (b, quads, nb)  # one matmul per (kv head and unit, quad, key block)
    q = qf.index_select(0, g.q_index).to(dt).view(b, quads, 1, ROWS, d).expand(*pairs, ROWS, d)
    k = read_rows(kf, g.kv_index, dt).view(b, 1, nb, KEYS, d).expand(*pairs, KEYS, d)
    v = read_rows(vf, g.kv_index, dt).view(b, nb, KEYS, d)  # int8 pages: these rows dequantized, elementwise
    v = torch.cat([v, v.new_ones(1, 1, 1, 1).expand(b, nb, KEYS, 1)], -1)  # [V | 1]
    v = v.view(b, 1, nb, KEYS, d + 1).expand(*pairs, KEYS, d + 1)
    s = torch.baddbmm(g.bias, q.reshape(-1, ROWS, d), k.reshape(-1, KEYS, d).transpose(1, 2), alpha=scale)
    s6 = s.view(kv, g.units, quads, nb, ROWS, KEYS)
    s6.sub_(s6.amax((3, 5), keepdim=True)).clamp_min_(_CLAMP).exp_()
    s6.mul_(g.visible)  # masked keys: exact zeros
    acc = torch.bmm(s, v.reshape(-1, KEYS, d + 1))  # [b * quads * nb, ROWS, D + 1]
    acc = block_sum(acc.view(b * quads, nb, ROWS * (d + 1))).reshape(b * quads * ROWS, d + 1)
    return acc[:, :d] / acc[:, d:]


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Same signature and meaning as kernels.attention.paged_attention; q [N, heads, D] -> [N, heads, D].

    q may have more rows than the metadata (deterministic mode pads a step's rows): theirs are zeros.
    """
    n, heads, d = q.shape
    kv = k_cache.shape[1]
    dt = torch.promote_types(q.dtype, torch.float32)
    plan = meta.step_cache(("invariant", window, kv, heads, d, n, dt),
                           lambda: _plan(meta, window, kv, heads // kv, d, n, dt))
    qf = q.reshape(n * heads, d)
    kf, vf = k_cache.view(-1, k_cache.shape[-1]), v_cache.view(-1, v_cache.shape[-1])  # rows of (slot, kv head)
    if plan.inverse is not None:
        o = _attend(plan.groups[0], qf, kf, vf, scale, kv)
        return o.index_select(0, plan.inverse).to(q.dtype).view(n, heads, d)
    out = torch.zeros(plan.total, d, dtype=dt, device=q.device)
    for g in plan.groups:
        out.index_copy_(0, g.out_index, _attend(g, qf, kf, vf, scale, kv))
    return out[: plan.real].to(q.dtype).view(n, heads, d)
