"""The next decode step launched before the host waits for this one (issue 9: the host prepares step N+1
while step N runs). A mixin of Engine (it uses its fields).

On a GPU a decode step's host work (copying the tokens back, detokenizing, stop checks, the next step's rows)
runs while the device idles, unless the device already has the next step: so when every sequence of a graph
step samples on the device and none can end by length, step N+1 is launched from step N's tokens, still on
the device (`DecodeGraphs.run(..., ahead=tokens)`), before the host accepts step N. Step N's tokens are
copied to pinned host memory behind step N (an event marks the copy), not behind N+1: the host waits for N
alone, then accepts it while N+1 runs; the next `advance` does the same for N+1.
Sequences that step N ends (a stop token or string, a cancel) drop their row of N+1: its KV write lands in
a slot of their own pages, past their last token, before any later step can reuse the page (one stream).
Tokens, KV and Progress are those of the steps run one at a time (the same kernels, the same batch, the
seeded noise keyed by each sequence's step, `SamplerState.step` + 1 for the step ahead), but for one thing:
with every slot busy and requests waiting, a slot that a stop frees is filled one step later (the step
after it was already running), so the batches of later steps, and in the default mode their roundings, differ.
A step ahead takes only free pages (never evicts a cached prefix page for a step it may throw away).
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
    host: torch.Tensor
    """The same tokens' copy in host memory, valid once `ready` has happened."""
    ready: torch.cuda.Event | None
    """Marks the copy (None on a CPU, where the copy is done when made)."""

    def host_tokens(self) -> torch.Tensor:
        """The tokens on the host: waits for this step alone, not for a step launched after it."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


def _device_sampled(seq: Sequence) -> bool:
    """Whether seq's next token is sampled on the device from the logits alone (no grammar mask, penalty
    counts, damped choice, logprobs, min_tokens' ban, bad words or allowed ids: the host's bitmask)."""
    p = seq.sampler.params
    return (seq.grammar is None and p.damped is None and p.logprobs is None and not p.uses_penalties
            and len(seq.output) >= p.min_tokens and not seq.bad_words and seq.allowed is None)


class OverlapMixin:
    """Engine's step-ahead decode: `_graph_step` runs a graph step, `_settle` accepts the one in flight."""

    def _stage(self: Engine, work: StepWork, tokens: torch.Tensor) -> InFlight:
        """`tokens` of `work` copied to the host behind the work queued so far, in one of two pinned buffers
        taken in turn (the other may still be read by the host or written by a queued copy)."""
        n = tokens.shape[0]
        if tokens.device.type != "cuda":
            return InFlight(work, tokens, tokens, None)
        if self._host_tokens is None:
            top = self._graphs.buckets[-1]  # type: ignore[union-attr]
            self._host_tokens = [torch.empty(top, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._host_tokens[self._host_turn][:n]
        self._host_turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return InFlight(work, tokens, host, ready)

    def _graph_step(self: Engine, chunks: list[tuple[Sequence, int]], out: list[Progress]) -> None:
        """Run the scheduled all-decode `chunks` from the graphs; launch the step after it where it can;
        accept this one into `out`."""
        work, logits = self._graphs.run(chunks)  # type: ignore[union-attr]
        self.steps += 1
        if not all(_device_sampled(s) for s, _ in chunks):
            out.extend(self.output.accept(work, logits))
            return
        step = self._stage(work, sample(logits, [s.sampler for s, _ in chunks]).tokens)
        self._launch_ahead(step)
        out.extend(self.output.accept(work, None, step.host_tokens()))
        self._drop_idle_flight()

    def _launch_ahead(self: Engine, step: InFlight) -> None:
        """Launch the step after `step` (whose tokens are on the device, not yet accepted) for the same
        sequences, where nothing the host will learn from `step` could change that step."""
        sched = self.scheduler
        chunks = step.work.chunks
        if not self.overlap or len(sched.running) != len(chunks):
            return  # a sequence outside this step (a prompt, a restored one) is scheduled after it
        if sched.waiting and len(sched.running) < self.slots:
            return  # a waiting request is admitted by the next schedule, after this step is accepted
        # every sequence here samples on the device (`_graph_step` launches no step otherwise, and a step
        # ahead keeps its sequences)
        for seq, _ in chunks:
            if seq.end or seq.prefill_hidden is None:
                return
            if len(seq.output) + 2 > seq.max_tokens:
                return  # this step's token may be its last: the step after would be thrown away
        # the pages of the token after this step's (free pages only, all or none)
        if not sched.grow_ahead([seq for seq, _ in chunks], 2):
            return
        if not self._graphs.usable(chunks):  # type: ignore[union-attr]
            return  # the grown tables past the graphs' width: the next schedule runs the built path
        nxt, logits = self._graphs.run(chunks, ahead=step.tokens)  # type: ignore[union-attr]
        # the noise of each sequence's next output position, as its state will be once this token is in
        # (greedy rows draw no noise: their state as it is; a copy costs ~3 us a row)
        states = [s.sampler if s.sampler.params.greedy else dataclasses.replace(s.sampler, step=s.sampler.step + 1)
                  for s, _ in chunks]  # fmt: skip
        self._in_flight = self._stage(nxt, sample(logits, states).tokens)

    def _drop_idle_flight(self: Engine) -> None:
        """Forget a step in flight that no live sequence is in (the step before it ended them all)."""
        flight = self._in_flight
        if flight is not None and not any(seq.id in self.output.seqs for seq, _ in flight.work.chunks):
            self._in_flight = None

    def _settle(self: Engine, out: list[Progress], go_on: bool = False) -> None:
        """Accept the step in flight into `out` (sequences it no longer serves drop their rows); with
        `go_on`, first launch the step after it where `_launch_ahead` can."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        work = flight.work
        keep = [i for i, (seq, _) in enumerate(work.chunks) if seq.id in self.output.seqs]
        if not keep:
            return
        self.steps += 1
        if len(keep) == len(work.chunks):
            if go_on:
                self._launch_ahead(flight)
            out.extend(self.output.accept(work, None, flight.host_tokens()))
            self._drop_idle_flight()
            return
        chosen = flight.host_tokens().tolist()
        tokens = torch.tensor([chosen[i] for i in keep], dtype=torch.long)
        work = StepWork([work.chunks[i] for i in keep], work.tokens, work.meta, list(range(len(keep))), None,
                        work.next_layer)  # fmt: skip
        out.extend(self.output.accept(work, None, tokens))
