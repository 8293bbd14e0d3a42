"""Device tensors of a step's attention layout, built once from AttnMetadata and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata

#: attribute under which `paged_args` caches its result on an AttnMetadata (one build per step)
_CACHE_ATTR = "_triton_paged_args"


@dataclass
class PagedArgs:
    """What the paged-attention kernels read, on the device.

    block_table [S, max_pages] int32 (rows padded with page 0, never read past seq_lens),
    query_start [S + 1] int32, seq_lens [S] int32, positions [N] (meta.positions); and the host
    facts that size the launch.
    """

    block_table: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    page_size: int
    #: rows with a sequence: query_start[S]; rows past it (padding) are left alone
    num_rows: int
    max_query_len: int
    max_seq_len: int
    host_query_start: tuple[int, ...]
    _items: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def items(self, block_q: int) -> tuple[torch.Tensor, int]:
        """(int32 [I, 2] of (sequence, first row), I): each sequence's rows in tiles of block_q rows."""
        hit = self._items.get(block_q)
        if hit is None:
            qs = self.host_query_start
            work = [(s, r) for s in range(len(qs) - 1) for r in range(qs[s], qs[s + 1], block_q)]
            t = torch.tensor(work if work else [(0, 0)], dtype=torch.int32).to(self.seq_lens.device)
            hit = (t, len(work))
            self._items[block_q] = hit
        return hit


def build_paged_args(meta: AttnMetadata, device: torch.device | str) -> PagedArgs:
    """PagedArgs of `meta` on `device` (three small host-to-device copies)."""
    s = meta.num_seqs
    ps = meta.page_size
    if len(meta.block_tables) != s or len(meta.query_start) != s + 1:
        raise InvalidArgument("AttnMetadata: block_tables, query_start and seq_lens disagree on the sequence count")
    max_pages = max([len(b) for b in meta.block_tables] + [1])
    table = torch.zeros(max(s, 1), max_pages, dtype=torch.int32)
    for i, (pages, n) in enumerate(zip(meta.block_tables, meta.seq_lens)):
        if len(pages) * ps < n:
            raise InvalidArgument(f"sequence {i}: {len(pages)} pages of {ps} do not hold {n} tokens")
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    qs = tuple(int(x) for x in meta.query_start)
    q_lens = [qs[i + 1] - qs[i] for i in range(s)]
    return PagedArgs(
        block_table=table.to(device),
        query_start=torch.tensor(qs, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(meta.seq_lens, dtype=torch.int32).to(device),
        positions=meta.positions.to(device),
        page_size=ps,
        num_rows=qs[-1] if qs else 0,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(meta.seq_lens, default=0),
        host_query_start=qs,
    )


def _same_device(have: torch.device, want: torch.device) -> bool:
    # "cuda" (no index) means the current device: the tensors made for it carry "cuda:<n>"
    return have.type == want.type and (want.index is None or have.index == want.index)


def paged_args(meta: AttnMetadata, device: torch.device | str) -> PagedArgs:
    """`build_paged_args`, cached on the metadata object so the layers of one step share it."""
    hit = getattr(meta, _CACHE_ATTR, None)
    if hit is None or not _same_device(hit.seq_lens.device, torch.device(device)):
        hit = build_paged_args(meta, device)
        # AttnMetadata is a plain dataclass: an extra attribute lives as long as the step's metadata
        setattr(meta, _CACHE_ATTR, hit)
    return hit


def preset_paged_args(meta: AttnMetadata, args: PagedArgs) -> None:
    """Make `args` what `paged_args(meta, ...)` returns: static buffers a captured graph replays
    (engine/graphs.py) instead of tensors built from the metadata's host tuples."""
    setattr(meta, _CACHE_ATTR, args)
