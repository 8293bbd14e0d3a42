"""Drafts from the model's own multi-token prediction block (`Engine(speculative="mtp")`, vLLM's "mtp" method).

The MTP block (models/mtp.py) predicts the token after next from the body's hidden state after its final norm at
position p and the token at p + 1, through one more attention layer with its own KV pages. As vLLM's proposer does,
it runs over every position of a sequence, the prompt's too, so that its attention sees them all: row p (hidden h_p,
token t_{p+1}) at position p, its keys and values at the slot of position p in the MTP's KV layer (the KV cache's
layers after the body's, `net.kv_layers + j`: pages shared with the body's page table, so the scheduler's page
ownership, preemption, prefix cache, save / restore and rollback cover them).

After each step is verified (`MTPSpeculator.propose_all`, from `OutputProcessor.accept`):

1. the MTP runs over the step's verified rows of every sequence (prompt chunks, decode rows and their kept drafts;
   not the rejected ones): positions `start .. num_computed_tokens - 1`, the body's normed hidden states of those
   rows (only those rows are normed) and the tokens after them; the last one, token `num_computed_tokens`, is the
   token the step just gave (a prompt chunk's: the next prompt token). `Sequence.mtp_rows` counts the positions
   whose MTP rows are written; the pass runs only where they are contiguous with the step's rows (a sequence
   restored from a blob of an engine without the MTP's layer never drafts: its drafts would read rows nobody
   wrote). A prefix handle (`Engine.prefix`) writes its rows but the last, which reads the adopter's first token:
   it keeps that position's normed hidden state (`Prefix.hidden`), each adopter holds its own copy of the page
   (`Scheduler.adopt`) and writes the row in its first pass (`Sequence.mtp_hidden`);
2. each decoding sequence's draft count comes from the existing machinery (`Speculative.draft_counts`: acceptance
   estimates, the step's cost, and `draft_cost` for the MTP's own work);
3. the last verified row's output gives the first draft (the head's argmax); up to depth - 1 more come from
   feeding the MTP its own normed output and the draft at the next position (`chain`). Those chained rows write
   the MTP layer's KV at positions not verified yet: in the sequence's own partial last page, or in scratch pages
   outside the pool (KVCache pages past PagePool's), never in a page anyone else reads; the verified pass of the
   next step writes those positions again.

Drafts are the head's argmax, a point mass q: verification's rule (keep draft j when row j's own choice equals it,
engine/speculative.py) is then the exact rejection rule, for greedy and sampled rows alike.

The prefix cache (engine/scheduler.py): a page is registered only once the MTP rows of all its positions are
written (`Scheduler.registrable`), and a match drops its last page, whose last MTP row was computed with the next
page's first token, which the match does not check (vLLM drops it too, for the hidden state it needs).

The MTP pass has one executor (the layers' reference path, `ModelRunner.mtp`); the decode graphs, which keep no
hidden states, are off on an MTP engine. With a layer budget (`Engine.advance(layer_budget=N)`) the pass runs in
the call that finishes the step's last layer, from the hidden states the step kept across calls.

Cost: the pass over the verified rows runs every step (its KV must hold every position, for this sequence's later
drafts and for the prefix cache), the head once a draft. A sequence whose drafts are not kept stops drafting (the
acceptance estimate) and pays the pass alone, plus its first draft every `PROBE_EVERY` steps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from superslm.cache.kv import slot_mapping
from superslm.engine.speculative import Speculative, Speculator
from superslm.errors import InvalidArgument, UnsupportedModel
from superslm.kernels.attention import AttnMetadata

if TYPE_CHECKING:
    from superslm.engine.request import Sequence
    from superslm.engine.runner import ModelRunner, StepWork
    from superslm.models.transformer import Transformer

#: a sequence that does not draft has its first draft computed every this many steps (its guess checked for free
#: against the next token, so that the acceptance estimate can climb back)
PROBE_EVERY = 4


def mtp_config(net: Transformer, config: Speculative, graphs: bool | None) -> Speculative:
    """An engine's "mtp" configuration, checked against its model (UnsupportedModel where it has no MTP block) and
    its decode graphs (graphs=True refused: they keep no hidden states), `draft_cost` estimated where not given."""
    if net.mtp is None:
        raise UnsupportedModel(f"speculative 'mtp' drafts with the model's multi-token prediction block; this "
                               f"{net.arch.family} model has none loaded (its checkpoint has no mtp / nextn tensors, "
                               "or it was loaded with fewer layers): use 'ngram'")
    if graphs:
        raise InvalidArgument("graphs=True: the MTP drafts from each step's hidden states, which the decode graphs "
                              "do not keep; speculative 'mtp' runs without them")
    return config if config.draft_cost is not None else replace(config, draft_cost=draft_cost(net))


def scratch_pages(config: Speculative, slots: int, page_size: int) -> int:
    """Pages outside the pool for the chained drafts' KV rows: ceil((k - 1) / page_size) a slot."""
    return slots * -(-(config.k - 1) // page_size)


def draft_cost(net: Transformer) -> float:
    """One draft's work in one-row steps, estimated by the bytes a row reads: the MTP's layers and fc and the head,
    over the body's layers and the head (a decode row on the CPU moves its weights; the embeddings are a gather)."""

    def size(module: torch.nn.Module) -> int:
        tensors = [*module.parameters(), *module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    assert net.mtp is not None
    head = size(net.head)
    return (size(net.mtp) + head) / max(1, sum(size(layer) for layer in net.layers) + head)


class MTPSpeculator(Speculator):
    """The drafting of an engine whose model has an MTP block (see the module's docstring)."""

    def __init__(self, config: Speculative, runner: ModelRunner, page_size: int, scratch: range) -> None:
        super().__init__(config)
        self.runner, self.page_size, self.scratch = runner, page_size, scratch
        #: scratch pages a chaining sequence gets (positions num_computed .. num_computed + k - 2 at most)
        self.per_seq = -(-(config.k - 1) // page_size)

    def propose_all(self, seqs: Seq[Sequence], work: StepWork | None = None) -> list[list[int]]:
        """Run the MTP over the step's verified rows, then draft each of `seqs` (its decoding sequences)."""
        if work is None:
            return [[] for _ in seqs]
        last = self.verified(work)
        c = self.config
        rooms, rates = [], []
        for seq in seqs:
            room = self.room(seq) if id(seq) in last else 0
            rooms.append(room)
            rates.append(self.state(seq).rate if room else 0.0)
        counts = c.draft_counts(rates, rooms)
        want = []
        for seq, room, k in zip(seqs, rooms, counts, strict=True):
            probe = False
            if room and not k:  # not worth a row: its first draft only, now and then, for the free check
                seq.spec.idle += 1
                probe = seq.spec.idle >= PROBE_EVERY
                if probe:
                    seq.spec.idle = 0
            want.append(k or int(probe))
        guesses = self.chain([(seq, *last[id(seq)]) if n else None for seq, n in zip(seqs, want, strict=True)],
                             want)
        out = []
        for seq, g, k in zip(seqs, guesses, counts, strict=True):
            if g and not k:
                seq.spec.guess, seq.spec.guess_at = g[0], len(seq.tokens)
                g = []
            if g and seq.grammar is not None:
                g = g[: seq.grammar.valid_drafts(g)]  # as far as the grammar allows them
            out.append(g)
        return out

    def verified(self, work: StepWork) -> dict[int, tuple[torch.Tensor, int]]:
        """The MTP over the step's verified rows of each live sequence whose MTP rows reach the step's first
        position (or the one before, whose normed hidden state waits in `Sequence.mtp_hidden`: a prefix handle's
        last position); returns, by id of each sequence run, (its last row's normed output [dim], the position
        after it)."""
        ps = self.page_size
        rows: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens, tables, owners = [0], [], [], []
        waiting: list[tuple[int, torch.Tensor]] = []  # (MTP row, its normed hidden state) of rows not in the step
        for i, (seq, n) in enumerate(work.chunks):
            start = work.meta.seq_lens[i] - n
            done = seq.num_computed_tokens
            if seq.end or not seq.block_table or done <= start or seq.num_tokens <= done:
                continue  # ended (its pages released) or nothing verified
            pending = seq.mtp_hidden is not None and seq.mtp_rows == start - 1
            if seq.mtp_rows != start and not pending:
                continue  # rows the MTP did not follow: they would attend over rows nobody wrote
            if pending:
                waiting.append((query_start[-1], seq.mtp_hidden))
                seq.mtp_hidden = None
            first = work.meta.query_start[i]
            begin = start - pending
            rows.extend(range(first, first + done - start))
            tokens.extend(seq.tokens[begin + 1 : done + 1])
            positions.extend(range(begin, done))
            slots.extend(slot_mapping(seq.block_table, begin, done, ps))
            query_start.append(query_start[-1] + done - begin)
            seq_lens.append(done)
            tables.append(tuple(seq.block_table))
            owners.append(seq)
        if not owners:
            return {}
        device = self.runner.net.device
        hidden = self.runner.final_hidden(work, rows)
        for at, h in waiting:  # in row order: each insertion leaves the later ones' offsets as counted
            hidden = torch.cat([hidden[:at], h.to(hidden)[None], hidden[at:]])
        meta = AttnMetadata(torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                            tuple(query_start), tuple(seq_lens), tuple(tables), ps,
                            deterministic=self.runner.deterministic)
        out = self.runner.mtp(hidden, torch.tensor(tokens, device=device), meta)
        last = {}
        for s, seq in enumerate(owners):
            seq.mtp_rows = seq_lens[s]
            last[id(seq)] = (out[query_start[s + 1] - 1], seq_lens[s])
        return last

    def prefix_rows(self, h: torch.Tensor, ids: list[int], pages: list[int]) -> torch.Tensor:
        """A prefix handle's MTP rows (`Engine.prefix`): rows 0 .. n - 2 of its n tokens `ids` written in its
        `pages` from the body's residual rows h [n, dim]; returns the normed hidden state of position n - 1, whose
        row each adopter writes with its own first token (in its own copy of that page: Scheduler.adopt)."""
        net, n, ps = self.runner.net, len(ids), self.page_size
        hidden = net.final_norm(h)
        if n > 1:
            device = net.device
            meta = AttnMetadata(torch.arange(n - 1, device=device),
                                torch.tensor(slot_mapping(pages, 0, n - 1, ps), device=device), (0, n - 1), (n - 1,),
                                (tuple(pages),), ps, deterministic=self.runner.deterministic)
            self.runner.mtp(hidden[: n - 1], torch.tensor(ids[1:], device=device), meta)
        return hidden[n - 1].clone()

    def chain(self, firsts: list[tuple[Sequence, torch.Tensor, int] | None], want: list[int]) -> list[list[int]]:
        """Up to want[i] drafts of each sequence from its last verified row's output (firsts[i]: the sequence, that
        output, the position of its newest token): the first is the head's argmax; draft j + 1 comes from the MTP
        row at position + j - 1 fed the previous output and draft j (its KV in the sequence's own partial page or
        a scratch page)."""
        drafts: list[list[int]] = [[] for _ in want]
        active = [i for i, k in enumerate(want) if k and firsts[i] is not None]
        if not active:
            return drafts
        h = torch.stack([firsts[i][1] for i in active])  # type: ignore[index]
        tokens = self.runner.mtp_tokens(h)
        for i, t in zip(active, tokens.tolist(), strict=True):
            drafts[i].append(t)
        ps, device, per_seq = self.page_size, self.runner.net.device, self.per_seq
        # each chaining sequence's scratch pages, the same at every depth (a row reads the rows chained before it)
        scratch = {i: list(self.scratch[n * per_seq : (n + 1) * per_seq]) for n, i in enumerate(active)}
        if len(active) * per_seq > len(self.scratch):
            raise AssertionError(f"{len(active)} sequences chain drafts; the scratch pages hold {len(self.scratch)}")
        for j in range(1, max(want)):
            keep = [a for a, i in enumerate(active) if want[i] > j]
            if not keep:
                break
            h, tokens, active = h[keep], tokens[keep], [active[a] for a in keep]
            positions, slots, tables = [], [], []
            for i in active:
                seq, _, pos = firsts[i]  # type: ignore[misc]
                p = pos + j - 1
                table = list(seq.block_table) + scratch[i]
                if p >= len(table) * ps:
                    raise AssertionError(f"no page for a chained draft row at position {p}")
                positions.append(p)
                slots.append(table[p // ps] * ps + p % ps)
                tables.append(tuple(table))
            meta = AttnMetadata(torch.tensor(positions, device=device), torch.tensor(slots, device=device),
                                tuple(range(len(active) + 1)), tuple(p + 1 for p in positions), tuple(tables), ps,
                                deterministic=self.runner.deterministic)
            h = self.runner.mtp(h, tokens, meta, step=j)
            tokens = self.runner.mtp_tokens(h)
            for i, t in zip(active, tokens.tolist(), strict=True):
                drafts[i].append(t)
        return drafts
