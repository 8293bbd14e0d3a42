"""The next decode step launched before the host waits for this one (issue 9: the host prepares step N+1
while step N runs). A mixin of Engine (it uses its fields).

On a GPU a decode step's host work (sampling inputs, copying the tokens back, detokenizing, stop checks,
the next step's rows) runs while the device idles, unless the device already has the next step: so when
every sequence of a graph step samples on the device and none can end by length, step N+1 is launched
from step N's tokens, still on the device (`DecodeGraphs.run(..., ahead=tokens)`), before the host
accepts step N. The host then accepts step N while N+1 runs; the next `advance` does the same for N+1.
Sequences that step N ends (a stop token or string, a cancel) drop their row of N+1: its KV write lands in
a slot of their own pages, past their last token, before any later step can reuse the page (one stream).
Tokens, KV and Progress are those of the steps run one at a time: the same kernels, the same batch, and
the seeded noise keyed by each sequence's step (`SamplerState.step` + 1 for the step ahead).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from superslm.engine.request import Progress, Sequence
from superslm.engine.runner import StepWork
from superslm.sampling import sample

if TYPE_CHECKING:
    from superslm.engine.engine import Engine


@dataclass
class InFlight:
    """A decode step launched and sampled on the device, not yet accepted by the host."""

    work: StepWork
    tokens: torch.Tensor
    """int64 [B] on the device: the step's sampled token of each chunk's sequence."""


def _device_sampled(seq: Sequence) -> bool:
    """Whether seq's next token is sampled on the device from the logits alone (no grammar mask, penalty
    counts, damped choice or logprobs, which the host computes from the tokens before it)."""
    p = seq.sampler.params
    return seq.grammar is None and p.damped is None and p.logprobs is None and not p.uses_penalties


class OverlapMixin:
    """Engine's step-ahead decode: `_graph_step` runs a graph step, `_settle` accepts the one in flight."""

    def _graph_step(self: Engine, chunks: list[tuple[Sequence, int]], out: list[Progress]) -> None:
        """Run the scheduled all-decode `chunks` from the graphs; launch the step after it where it can;
        accept this one into `out`."""
        work, logits = self._graphs.run(chunks)  # type: ignore[union-attr]
        tokens = None
        if all(_device_sampled(s) for s, _ in chunks):
            tokens = sample(logits, [s.sampler for s, _ in chunks]).tokens
            self._launch_ahead(work, tokens)
        self.steps += 1
        out.extend(self._accept(work, None if tokens is not None else logits, tokens))

    def _launch_ahead(self: Engine, work: StepWork, tokens: torch.Tensor) -> None:
        """Launch the step after `work` (whose tokens are on the device, not yet accepted) for the same
        sequences, where nothing the host will learn from `work` could change that step."""
        if not self.overlap or self.scheduler.waiting:
            return  # a waiting request is admitted by the next schedule, after this step is accepted
        chunks = work.chunks
        for seq, _ in chunks:
            if seq.end or not _device_sampled(seq) or seq.prefill_hidden is None:
                return
            if len(seq.output) + 2 > seq.max_tokens:
                return  # this step's token may be its last: the step after would be thrown away
        # the pages of the token after this step's (all or none: otherwise the next schedule may preempt)
        if not all(self.scheduler.grow(seq, 2) for seq, _ in chunks) or not self._graphs.fits_ahead(chunks):
            return
        nxt, logits = self._graphs.run(chunks, ahead=tokens)  # type: ignore[union-attr]
        # the noise of each sequence's next output position, as its state will be once this token is in
        states = [dataclasses.replace(s.sampler, step=s.sampler.step + 1) for s, _ in chunks]
        self._in_flight = InFlight(nxt, sample(logits, states).tokens)

    def _settle(self: Engine, out: list[Progress], go_on: bool = False) -> None:
        """Accept the step in flight into `out` (sequences it no longer serves drop their rows); with
        `go_on`, first launch the step after it where `_launch_ahead` can."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        work = flight.work
        keep = [i for i, (seq, _) in enumerate(work.chunks) if seq.id in self._seqs]
        if len(keep) == len(work.chunks):
            if go_on:
                self._launch_ahead(work, flight.tokens)
            tokens = flight.tokens
        else:
            chosen = flight.tokens.tolist()
            tokens = torch.tensor([chosen[i] for i in keep], dtype=torch.long)
            work = StepWork([work.chunks[i] for i in keep], work.tokens, work.meta, list(range(len(keep))), None,
                            work.next_layer)  # fmt: skip
        self.steps += 1
        out.extend(self._accept(work, None, tokens))
