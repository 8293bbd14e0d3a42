"""Attention over a paged KV cache: the per-step metadata and the torch reference.

A step is a flat list of rows (tokens) from several sequences: prefill chunks and decode tokens
alike. Each sequence's rows are contiguous (`query_start`), its keys live in the pages of its
block_table, and every row's K/V is written to `slot_mapping[row]` (page * page_size + offset).
The caches are in a page format of cache/kv.py (float rows, int8 codes with a scale per token and head, or
rotated 4-bit codes with a scale): written through `write_rows`, read through `read_stored`, which dequantizes only
the rows a sequence gathers. 4-bit rows stay in their rotated basis: the query is rotated once per head where the
keys are rotated, and the output rotated back once per head where the values are (`_Basis`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from superslm.cache.kv import read_stored, rotate, rotated, unrotate, write_rows

_MISSING = object()


@dataclass(frozen=True, eq=False)
class QKVSpec:
    """How one layer's attention reads its fused qkv rows [N, (heads + 2 kv_heads) D]: the bias added to them,
    q's and k's per-head RMS norms (Qwen3, Gemma 3: weights [D], `eps` and `norm_float` as kernels.norm.rms_norm
    takes them), the sliding `window` (None: every earlier key) and the score `scale`. The kernels that prepare
    q, k and v and attend (kernels.fused and their Triton twins) take it in one argument."""

    heads: int
    kv_heads: int
    bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    norm_float: bool = False
    window: int | None = None
    scale: float = 1.0

    @property
    def norm(self) -> bool:
        """Whether q and k go through their RMS norms (both weights given)."""
        return self.q_norm is not None and self.k_norm is not None

    def head_dim(self, qkv: torch.Tensor) -> int:
        return qkv.shape[1] // (self.heads + 2 * self.kv_heads)


@dataclass
class AttnMetadata:
    """Per-step attention layout; built once per step by the engine and shared by every layer."""

    #: [N] position of each row in its sequence
    positions: torch.Tensor
    #: [N] flat KV slot each row's key and value are written to
    slot_mapping: torch.Tensor
    #: S + 1 offsets: rows query_start[s]:query_start[s+1] belong to sequence s
    query_start: tuple[int, ...]
    #: S context lengths after this step (keys 0..seq_lens[s]-1 are visible to the sequence)
    seq_lens: tuple[int, ...]
    #: S page-id lists, each covering at least seq_lens[s] tokens
    block_tables: tuple[tuple[int, ...], ...]
    page_size: int
    #: deterministic mode: batch-invariant kernels and rows padded to a multiple of 16
    deterministic: bool = False
    #: LoRA adapters of the step's rows (superslm.adapters.LoraBatch), applied by the linears
    lora: Any = None
    #: S rows of the recurrent states (cache.state.RecurrentStates) each sequence's delta-rule layers read and write
    state_slots: tuple[int, ...] = ()
    #: per sequence, the scratch rows of the recurrent states that receive its states after each of its rows but
    #: the last, where its rows are a decode row and its drafts (engine/speculative.py); empty for the others, and
    #: () where no sequence of the step carries drafts
    state_drafts: tuple[tuple[int, ...], ...] = ()
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _masks: dict[tuple[int, int | None], tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)
    _decode: dict[int | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _step: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def one_prompt(cls, n: int, page_size: int, device: torch.device | str | None = None) -> AttnMetadata:
        """One sequence's first n tokens in one step, its keys on pages 0, 1, ... of the cache (calibration,
        perplexity and tests run whole texts this way)."""
        pages = tuple(range(-(-n // page_size)))
        return cls(torch.arange(n, device=device), torch.arange(n, device=device), (0, n), (n,), (pages,), page_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def step_cache(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()` once per step and key: what a kernel derives from the metadata alone (index
        tensors, masks, layouts) is then shared by every layer of the step."""
        hit = self._step.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._step[key] = build()
        return hit

    def key_slots(self, s: int) -> torch.Tensor:
        """[seq_lens[s]] KV slots of sequence s, in position order (cached for the step)."""
        slots = self._slots.get(s)
        if slots is None:
            n, ps = self.seq_lens[s], self.page_size
            pages = torch.tensor(self.block_tables[s][: (n + ps - 1) // ps], dtype=torch.long)
            slots = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:n]
            slots = slots.to(self.slot_mapping.device)
            self._slots[s] = slots
        return slots

    def mask(self, s: int, window: int | None) -> tuple[int, torch.Tensor]:
        """(first key position, bool mask [rows, keys]) of sequence s: causal, within the window."""
        key = (s, window)
        hit = self._masks.get(key)
        if hit is None:
            a, b = self.query_start[s], self.query_start[s + 1]
            qpos = self.positions[a:b]
            first = 0
            if window is not None:
                # keys before the first row's window are never visible: skip them entirely
                first = max(0, int(qpos.min()) - window + 1)
            kpos = torch.arange(first, self.seq_lens[s], device=qpos.device)
            m = kpos[None, :] <= qpos[:, None]
            if window is not None:
                m &= kpos[None, :] > (qpos[:, None] - window)
            hit = (first, m)
            self._masks[key] = hit
        return hit


    def decode_batch(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For the sequences with one query row: (their rows [D], key slots [D, L], visible [D, L]),
        keys padded to the longest; None when fewer than two sequences decode this step."""
        if window in self._decode:
            return self._decode[window]
        seqs = [s for s in range(self.num_seqs) if self.query_start[s + 1] - self.query_start[s] == 1]
        if len(seqs) < 2:
            return None
        firsts = [max(0, self.seq_lens[s] - window) if window is not None else 0 for s in seqs]
        width = max(self.seq_lens[s] - f for s, f in zip(seqs, firsts))
        dev = self.slot_mapping.device
        idx = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
        visible = torch.zeros(len(seqs), width, dtype=torch.bool, device=dev)
        for i, (s, f) in enumerate(zip(seqs, firsts)):
            n = self.seq_lens[s] - f
            idx[i, :n] = self.key_slots(s)[f:]
            visible[i, :n] = True
        rows = torch.tensor([self.query_start[s] for s in seqs], dtype=torch.long, device=dev)
        self._decode[window] = (rows, idx, visible)
        return self._decode[window]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [N, kv_heads, head_dim] into the caches [slots, kv_heads, width] at slot_mapping, each in its
    page format (int8 rows: quantized per token and head, cache.kv.quantize_rows; 4-bit rows rotated first)."""
    write_rows(k_cache, slot_mapping, k)
    write_rows(v_cache, slot_mapping, v)


class _Basis:
    """Where the caches' rows are rotated (4-bit rows, cache/kv.py): q into the keys' basis, each output head
    out of the values' basis; both identities for float and int8 rows."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.keys, self.values = rotated(k_cache), rotated(v_cache)

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return rotate(q).to(q.dtype) if self.keys else q

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return unrotate(o).to(o.dtype) if self.values else o


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Reference: gather each sequence's keys and run SDPA. q [N, heads, D] -> [N, heads, D].

    One sequence at a time, so a row's arithmetic never depends on the other sequences of the step. Int8 and
    4-bit pages: each sequence's gathered rows are dequantized to q's dtype, never the whole cache; 4-bit rows
    are attended in their rotated basis (q rotated, the output rotated back: a rotation per head, not per key).
    """
    basis = _Basis(k_cache, v_cache)
    out = torch.empty_like(q)
    q = basis.query(q)
    groups = q.shape[1] // k_cache.shape[1]
    batched = meta.decode_batch(window)
    if batched is not None:
        # every decoding sequence in one SDPA call, keys padded to the longest
        rows, idx, visible = batched
        k = read_stored(k_cache, idx, q.dtype).transpose(1, 2)  # [D, kv_heads, L, D]
        v = read_stored(v_cache, idx, q.dtype).transpose(1, 2)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        qd = q.index_select(0, rows)[:, :, None, :]  # [D, heads, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=visible[:, None, None, :], scale=scale)
        out[rows] = basis.output(o[:, :, 0])
    single = set(batched[0].tolist()) if batched is not None else set()
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        if a == b or a in single:
            continue
        if b - a == meta.seq_lens[s] and (window is None or window >= b - a):
            # a whole prompt from position 0: SDPA's own causal mask takes its fused kernel, which never
            # holds the [heads, rows, keys] scores (9 MB a layer at 512 tokens) nor repeats kv heads
            slots = meta.key_slots(s)
            k = read_stored(k_cache, slots, q.dtype).transpose(0, 1)[None]  # [1, kv_heads, L, D]
            v = read_stored(v_cache, slots, q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k, v, is_causal=True, scale=scale,
                                               enable_gqa=groups > 1)
            out[a:b] = basis.output(o[0].transpose(0, 1))
            continue
        first, mask = meta.mask(s, window)
        slots = meta.key_slots(s)[first:]
        k = read_stored(k_cache, slots, q.dtype).transpose(0, 1)  # [kv_heads, L, D]
        v = read_stored(v_cache, slots, q.dtype).transpose(0, 1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)  # [heads, L, D]
            v = v.repeat_interleave(groups, dim=0)
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[a:b] = basis.output(o.transpose(0, 1))
    return out
