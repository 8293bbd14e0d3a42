"""One step's forward pass: flat rows from the scheduled chunks, through the layers, to logits.

The work of a step is an object (`StepWork`) so it can stop between layers and continue later:
`Engine.advance(layer_budget=N)` runs at most N layers of it per call. `ModelRunner` is the one place that
picks a step's path: the decode graphs or the layers run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from superslm.cache.kv import KVCache, slot_mapping
from superslm.cache.state import RecurrentStates
from superslm.devices import ThreadPolicy
from superslm.engine.request import Sequence
from superslm.kernels import cpu_decode
from superslm.kernels.attention import AttnMetadata
from superslm.models.layers import _linear
from superslm.models.transformer import Transformer

if TYPE_CHECKING:
    from superslm.engine.overlap import GraphSteps
    from superslm.engine.request import Progress


@dataclass
class StepWork:
    """A step in flight: its chunks, metadata, residual stream and the next layer to run."""

    chunks: list[tuple[Sequence, int]]
    tokens: torch.Tensor
    meta: AttnMetadata
    #: per chunk: the row whose logits are sampled, or -1 while the sequence's prompt is unfinished (a chunk with
    #: drafts: its last draft's row; the rows of its newest token and its other drafts come before it)
    sample_rows: list[int]
    h: torch.Tensor | None = None
    next_layer: int = 0
    #: whether the C++ plan runs the step's layers (chosen once, at its first layer: `Transformer.plan_step`)
    plan: bool = False
    #: per chunk, the drafts its rows verify (Sequence.drafts as scheduled); empty: no chunk has any
    drafts: tuple[tuple[int, ...], ...] = ()

    def drafts_of(self, i: int) -> tuple[int, ...]:
        """The drafts chunk i verifies (none for most)."""
        return self.drafts[i] if self.drafts else ()

    def draft_states(self, i: int) -> tuple[int, ...]:
        """The scratch rows holding chunk i's recurrent states after each of its rows but the last (a delta-rule
        model's chunk with drafts; none otherwise)."""
        return self.meta.state_drafts[i] if self.meta.state_drafts else ()

    def logit_rows(self) -> list[int]:
        """The rows whose logits the step samples, in chunk order: each sampling chunk's newest token's row, then
        its drafts' rows."""
        return [r for i, row in enumerate(self.sample_rows) if row >= 0
                for r in range(row - len(self.drafts_of(i)), row + 1)]


def build_step(
    chunks: list[tuple[Sequence, int]], page_size: int, device: torch.device, deterministic: bool = False,
    scratch: range | None = None,
) -> StepWork:
    """Rows, positions, slot mapping and block tables of the scheduled chunks. `scratch`: the recurrent states'
    scratch rows (a delta-rule model's, cache.state.RecurrentStates.scratch_rows), handed out in row order to the
    draft rows (AttnMetadata.state_drafts); the scheduler schedules no more drafts than there are."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    tables: list[tuple[int, ...]] = []
    sample_rows: list[int] = []
    drafts: list[tuple[int, ...]] = []
    for seq, n in chunks:
        start = seq.num_computed_tokens
        all_tokens = seq.tokens
        # rows past the newest token are drafts (the scheduler cut them to the ones it scheduled)
        d = max(0, start + n - len(all_tokens))
        drafts.append(tuple(seq.drafts[:d]))
        if d:
            all_tokens = all_tokens + seq.drafts[:d]
        tokens.extend(all_tokens[start : start + n])
        table = seq.block_table
        positions.extend(range(start, start + n))
        slots.extend(slot_mapping(table, start, start + n, page_size))
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        tables.append(tuple(table))
        # a chunk that reaches the newest token gives the next token's logits
        sample_rows.append(query_start[-1] - 1 if start + n == len(all_tokens) else -1)
    lora = None
    if any(seq.request.adapter is not None for seq, _ in chunks):
        from superslm.adapters.lora import LoraBatch, group_rows

        per_row = [seq.request.adapter for seq, n in chunks for _ in range(n)]
        lora = LoraBatch(group_rows(per_row, device), deterministic)
    meta = AttnMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start=tuple(query_start),
        seq_lens=tuple(seq_lens),
        block_tables=tuple(tables),
        page_size=page_size,
        deterministic=deterministic,
        lora=lora,
        state_slots=tuple(-1 if seq.state_slot is None else seq.state_slot for seq, _ in chunks),
        state_drafts=_state_drafts(drafts, scratch) if scratch is not None and any(drafts) else (),
    )
    return StepWork(chunks, torch.tensor(tokens, dtype=torch.long, device=device), meta, sample_rows,
                    drafts=tuple(drafts) if any(drafts) else ())


def _state_drafts(drafts: list[tuple[int, ...]], scratch: range) -> tuple[tuple[int, ...], ...]:
    """Per chunk, the scratch rows that keep the states after its rows but the last (one a draft)."""
    out, used = [], 0
    for d in drafts:
        out.append(tuple(scratch[used : used + len(d)]))
        used += len(d)
    if used > len(scratch):
        raise AssertionError(f"a step carries {used} drafts; the recurrent states keep {len(scratch)}")
    return tuple(out)


def run_layers(net: Transformer, kv: KVCache, work: StepWork, budget: int | None = None,
               states: RecurrentStates | None = None) -> bool:
    """Run up to `budget` layers of the step (all when None); True once every layer has run. `states`: the
    delta-rule layers' recurrent states, where the net has such layers."""
    if work.h is None:
        work.h = net.embed(work.tokens)
        # the step's executor, chosen once for all its layers; decode rows with their drafts are decode rows to it
        drafting = bool(work.drafts) and all(n == 1 + len(work.drafts_of(i)) and work.sample_rows[i] >= 0
                                             for i, (_, n) in enumerate(work.chunks))
        work.plan = net.plan_step(work.h, work.meta, kv.k, drafting=drafting)
    total = len(net.layers)
    end = total if budget is None else min(total, work.next_layer + budget)
    work.h = net.run_layers(work.h, work.meta, kv.k, kv.v, work.next_layer, end, plan=work.plan, states=states)
    for seq, _ in work.chunks:
        seq.layers_run += end - work.next_layer
    work.next_layer = end
    return end == total


def step_greedy(net: Transformer, work: StepWork) -> torch.Tensor | None:
    """The argmax token of each sampling row (int64 [rows], `StepWork.logit_rows`) when the head can certify it
    without all the logits (`Transformer.greedy_tokens`), else None."""
    rows = work.logit_rows()
    assert work.h is not None
    if len(rows) < cpu_decode.GREEDY_MIN_ROWS:  # a decode step at batch 1 pays nothing for asking
        return None
    idx = torch.tensor(rows, dtype=torch.long, device=work.h.device)
    return net.greedy_tokens(work.h.index_select(0, idx), work.meta.deterministic)


def step_logits(net: Transformer, work: StepWork) -> torch.Tensor:
    """Logits [rows that sample, vocab] (float32) of a finished step (`StepWork.logit_rows`)."""
    rows = work.logit_rows()
    assert work.h is not None
    if not rows:
        return torch.empty(0, net.arch.vocab)
    idx = torch.tensor(rows, dtype=torch.long, device=work.h.device)
    return net.logits(work.h.index_select(0, idx), work.meta.deterministic)


class ModelRunner:
    """Runs each scheduled step through the net, the one place that picks its executor. A decode step the graphs
    can take runs there (`GraphSteps`: sampled on the device, accepted at once, the step after it maybe launched
    ahead); any other step runs its layers eagerly, in the C++ plan or layer by layer (`Transformer.plan_step`,
    chosen once per step), at most `layer_budget` of them a call (`work` holds it until its last layer), and is
    handed back for the engine to sample. `steps` counts the steps run to the end."""

    def __init__(self, net: Transformer, kv: KVCache, page_size: int, deterministic: bool,
                 graphs: GraphSteps | None = None, adaptive_threads: bool = True,
                 states: RecurrentStates | None = None) -> None:  # fmt: skip
        self.net, self.kv, self.page_size, self.deterministic = net, kv, page_size, deterministic
        self.states = states
        self.graphs = graphs
        self.work: StepWork | None = None
        self.steps = 0
        #: the CPU threads of each step, fewer while other processes keep cores busy (None: torch's as set)
        self.threads = ThreadPolicy() if adaptive_threads and net.device.type == "cpu" else None

    @property
    def in_flight(self) -> bool:
        """Whether a step launched ahead waits to be accepted (`settle`)."""
        return self.graphs is not None and self.graphs.in_flight is not None

    def busy(self) -> bool:
        return self.work is not None or self.in_flight

    def in_step(self, seq: Sequence) -> bool:
        """Whether seq has rows in a step not yet accepted (stopped between layers, or in flight)."""
        flight = self.graphs.in_flight.work if self.graphs is not None and self.graphs.in_flight else None
        return any(s is seq for w in (self.work, flight) if w is not None for s, _ in w.chunks)

    def run(self, chunks: list[tuple[Sequence, int]] | None, layer_budget: int | None,
            out: list[Progress]) -> StepWork | None:  # fmt: skip
        """Run the scheduled `chunks` (None: go on with the step stopped between layers). Returns the finished
        eager step, whose tokens the caller samples; None when a graph step was accepted into `out` or layers
        are left."""
        if chunks is not None:
            if self.graphs is not None and layer_budget is None and self.graphs.usable(chunks):
                self.steps += self.graphs.step(chunks, out)
                return None
            if self.threads is not None:
                self.threads.choose()
            scratch = None if self.states is None else self.states.scratch_rows
            self.work = build_step(chunks, self.page_size, self.net.device, self.deterministic, scratch)
        assert self.work is not None, "no step to go on with"
        if not run_layers(self.net, self.kv, self.work, layer_budget, self.states):
            return None
        work, self.work = self.work, None
        self.steps += 1
        return work

    def settle(self, out: list[Progress], go_on: bool = False) -> None:
        """Accept the step in flight into `out` (with `go_on`, launch the one after it first where decided)."""
        if self.graphs is not None:
            self.steps += self.graphs.settle(out, go_on)

    def logits(self, work: StepWork) -> torch.Tensor:
        return step_logits(self.net, work)

    # --- the MTP block (engine/mtp_drafter.py): one executor, the layers' reference path -------------

    def final_hidden(self, work: StepWork, rows: list[int]) -> torch.Tensor:
        """The body's hidden states after its final norm [len(rows), dim] of a finished step's rows (the MTP's
        input): only the rows asked for are normed."""
        assert work.h is not None
        idx = torch.tensor(rows, dtype=torch.long, device=work.h.device)
        return self.net.final_norm(work.h.index_select(0, idx))

    def mtp(self, hidden: torch.Tensor, tokens: torch.Tensor, meta: AttnMetadata, step: int = 0) -> torch.Tensor:
        """The MTP block's normed outputs [N, dim] of rows (hidden[r], tokens[r]) at meta's positions, their keys
        and values written at meta's slots in the MTP layer's pages: KV layer `net.kv_layers + step % arch.mtp`
        (models/mtp.py: vLLM's layer for draft step `step`)."""
        net = self.net
        assert net.mtp is not None
        j = net.kv_layers + step % net.arch.mtp
        cos_sin = net.rope_table_list(meta.positions)[0]  # the global rope, as every attention layer reads it
        return net.mtp(hidden, net.embed(tokens), meta, cos_sin, self.kv.k[j], self.kv.v[j], step)

    def mtp_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The head's argmax token of each MTP output row (int64 [N]): the drafts, greedy (first index on ties)."""
        logits = _linear(self.net.head, out, self.deterministic).float()
        return logits.argmax(dim=-1)
