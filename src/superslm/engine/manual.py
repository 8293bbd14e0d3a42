"""Low-level stepping: the caller says which slot each token row belongs to and which rows it wants
logits of (`Engine.step`). Slots here are caller-owned sequences that share the KV pool with
the engine's requests; their pages stay referenced until `reset`."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from superslm.cache.kv import KVCache, slot_mapping
from superslm.cache.state import RecurrentStates
from superslm.engine.scheduler import Scheduler
from superslm.errors import ContextLengthExceeded, InvalidArgument, KVCacheFull, TokenOutOfRange
from superslm.kernels.attention import AttnMetadata
from superslm.models.transformer import Transformer


class ManualSlots:
    """Caller-driven sequences: `step(tokens, slots, wanted)` appends rows and returns logits."""

    def __init__(self, net: Transformer, kv: KVCache, scheduler: Scheduler, slots: int, context: int,
                 deterministic: bool = False, states: RecurrentStates | None = None) -> None:
        self.net, self.kv, self.scheduler = net, kv, scheduler
        #: the delta-rule layers' states of the caller's slots (row s: slot s), where the net has such layers
        self.states = states
        self.deterministic = deterministic
        self.slots, self.context = slots, context
        self.lengths = [0] * slots
        self.tables: list[list[int]] = [[] for _ in range(slots)]

    def reset(self, slot: int) -> None:
        """Empty a slot and give its pages back."""
        self._check_slot(slot)
        if self.tables[slot]:
            self.scheduler.free(self.tables[slot])
        self.tables[slot], self.lengths[slot] = [], 0

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise InvalidArgument(f"slot {slot!r} is outside 0..{self.slots - 1}")

    def step(self, tokens: Seq[int], slots: Seq[int], wanted: Seq[bool]) -> torch.Tensor:
        """Append token rows to their slots; logits [number of wanted rows, vocab] in row order.

        Rows of one slot keep their order; each slot's positions continue from its length.
        """
        if len(wanted) != len(tokens):
            raise InvalidArgument("tokens, slots and wanted must be non-empty and of equal length")
        meta, order, dev = self._prepare(tokens, slots)
        with torch.inference_mode():
            h = self.net.run_layers(self.net.embed(self._tokens(tokens, order)), meta, self.kv.k, self.kv.v,
                                    states=self.states)
            picked = [i for i, r in sorted(enumerate(order), key=lambda x: x[1]) if wanted[r]]
            if not picked:
                return torch.empty(0, self.net.arch.vocab)
            return self.net.logits(h.index_select(0, torch.tensor(picked, device=dev)), self.deterministic)

    def hidden(self, tokens: Seq[int], slots: Seq[int], layers: Seq[int]) -> dict[int, torch.Tensor]:
        """Append token rows like `step`; the residual stream after each asked layer, in row order
        (0: embeddings; i: after layer i; the last layer's entry is after the final norm, as HF)."""
        total = len(self.net.layers)
        for i in layers:
            if not isinstance(i, int) or not 0 <= i <= total:
                raise InvalidArgument(f"layer {i!r} is outside 0..{total}")
        meta, order, dev = self._prepare(tokens, slots)
        back = torch.tensor([i for i, _ in sorted(enumerate(order), key=lambda x: x[1])], device=dev)
        n = len(tokens)
        out: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            h = self.net.embed(self._tokens(tokens, order))
            if 0 in layers:
                out[0] = h[:n].index_select(0, back).float()
            for i in range(total):
                h = self.net.run_layers(h, meta, self.kv.k, self.kv.v, i, i + 1, states=self.states)
                if i + 1 in layers:
                    x = h[:n].index_select(0, back)
                    if i + 1 == total and self.net.has_head:
                        x = self.net.final_norm(x)
                    out[i + 1] = x.float()
        return out

    def _tokens(self, tokens: Seq[int], order: list[int]) -> torch.Tensor:
        return torch.tensor([tokens[r] for r in order], device=self.net.device)

    def _prepare(self, tokens: Seq[int], slots: Seq[int]) -> tuple[AttnMetadata, list[int], torch.device]:
        """Pages and metadata for rows appended to their slots; `order` lists rows grouped by slot."""
        n = len(tokens)
        if not n or len(slots) != n:
            raise InvalidArgument("tokens, slots and wanted must be non-empty and of equal length")
        vocab = self.net.arch.vocab
        by_slot: dict[int, list[int]] = {}
        for row, (t, s) in enumerate(zip(tokens, slots)):
            self._check_slot(s)
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise TokenOutOfRange(f"token {t!r} at row {row} is outside the vocabulary [0, {vocab})")
            by_slot.setdefault(s, []).append(row)
        ps = self.scheduler.pool.page_size
        need = {}
        for s, rows in by_slot.items():
            if self.lengths[s] + len(rows) > self.context:
                raise ContextLengthExceeded(f"slot {s} would hold {self.lengths[s] + len(rows)} tokens")
            need[s] = -(-(self.lengths[s] + len(rows)) // ps) - len(self.tables[s])
        if not self.scheduler.can_grant(sum(need.values())):
            raise KVCacheFull(f"the KV pool cannot hold {sum(need.values())} more pages")
        for s, k in need.items():
            if k > 0:
                self.tables[s].extend(self.scheduler.grant(k))
        # the step's rows grouped by slot; `order` maps them back to the caller's row order
        order = [row for rows in by_slot.values() for row in rows]
        positions, slot_map, starts, lens, tables = [], [], [0], [], []
        for s, rows in by_slot.items():
            positions.extend(range(self.lengths[s], self.lengths[s] + len(rows)))
            slot_map.extend(slot_mapping(self.tables[s], self.lengths[s], self.lengths[s] + len(rows), ps))
            self.lengths[s] += len(rows)
            starts.append(starts[-1] + len(rows))
            lens.append(self.lengths[s])
            tables.append(tuple(self.tables[s]))
        dev = self.net.device
        meta = AttnMetadata(torch.tensor(positions, device=dev), torch.tensor(slot_map, device=dev),
                            tuple(starts), tuple(lens), tuple(tables), ps, deterministic=self.deterministic,
                            state_slots=tuple(by_slot))
        return meta, order, dev
