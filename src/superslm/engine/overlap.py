"""Decode steps from the graphs, sampled on the device, and the next one launched before the host waits for
this one: the host prepares step N+1 while step N runs. `GraphSteps` does it for the Engine; the
`AsyncScheduler` (engine/scheduler.py) decides when the step after one in flight is known already.

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

from superslm.engine.output import OutputProcessor
from superslm.engine.request import Progress, Sequence
from superslm.engine.runner import StepWork
from superslm.engine.scheduler import AsyncScheduler, Scheduler
from superslm.sampling import sample

if TYPE_CHECKING:
    from superslm.engine.graphs import DecodeGraphs


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


class GraphSteps:
    """An engine's decode steps on its graphs: `step` runs one and accepts it, first launching the step after
    it where the scheduler (an AsyncScheduler) says that step is decided; `settle` accepts the step in flight.
    Each returns how many steps it accepted."""

    def __init__(self, graphs: DecodeGraphs, scheduler: Scheduler, output: OutputProcessor) -> None:
        self.graphs, self.scheduler, self.output = graphs, scheduler, output
        #: steps launched ahead: only with a scheduler that decides them
        self.overlap = isinstance(scheduler, AsyncScheduler)
        self.in_flight: InFlight | None = None
        self._host: list[torch.Tensor] | None = None  # pinned token copies, two taken in turn
        self._turn = 0

    def usable(self, chunks: list[tuple[Sequence, int]]) -> bool:
        return self.graphs.usable(chunks)

    def _stage(self, work: StepWork, tokens: torch.Tensor) -> InFlight:
        """`tokens` of `work` copied to the host behind the work queued so far, in one of two pinned buffers
        taken in turn (the other may still be read by the host or written by a queued copy)."""
        n = tokens.shape[0]
        if tokens.device.type != "cuda":
            return InFlight(work, tokens, tokens, None)
        if self._host is None:
            top = self.graphs.buckets[-1]
            self._host = [torch.empty(top, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._host[self._turn][:n]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return InFlight(work, tokens, host, ready)

    def step(self, chunks: list[tuple[Sequence, int]], out: list[Progress]) -> int:
        """Run the scheduled all-decode `chunks` from the graphs; launch the step after it where it can;
        accept this one into `out`."""
        work, logits = self.graphs.run(chunks)
        if not all(_device_sampled(s) for s, _ in chunks):
            out.extend(self.output.accept(work, logits))
            return 1
        step = self._stage(work, sample(logits, [s.sampler for s, _ in chunks]).tokens)
        self._launch_ahead(step)
        out.extend(self.output.accept(work, None, step.host_tokens()))
        self._drop_idle()
        return 1

    def _launch_ahead(self, step: InFlight) -> None:
        """Launch the step after `step` (whose tokens are on the device, not yet accepted) for the same
        sequences, where the scheduler has decided it (every sequence here samples on the device: `step`
        launches nothing otherwise, and a step ahead keeps its sequences)."""
        chunks = step.work.chunks
        if not self.overlap or not self.scheduler.schedule_ahead(chunks):  # type: ignore[attr-defined]
            return
        if not self.graphs.usable(chunks):
            return  # the grown tables past the graphs' width: the next schedule runs the built path
        nxt, logits = self.graphs.run(chunks, ahead=step.tokens)
        # the noise of each sequence's next output position, as its state will be once this token is in
        # (greedy rows draw no noise: their state as it is; a copy costs ~3 us a row)
        states = [s.sampler if s.sampler.params.greedy else dataclasses.replace(s.sampler, step=s.sampler.step + 1)
                  for s, _ in chunks]  # fmt: skip
        self.in_flight = self._stage(nxt, sample(logits, states).tokens)

    def _drop_idle(self) -> None:
        """Forget a step in flight that no live sequence is in (the step before it ended them all)."""
        flight = self.in_flight
        if flight is not None and not any(seq.id in self.output.seqs for seq, _ in flight.work.chunks):
            self.in_flight = None

    def settle(self, out: list[Progress], go_on: bool = False) -> int:
        """Accept the step in flight into `out` (sequences it no longer serves drop their rows); with
        `go_on`, first launch the step after it where the scheduler decides it."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return 0
        work = flight.work
        keep = [i for i, (seq, _) in enumerate(work.chunks) if seq.id in self.output.seqs]
        if not keep:
            return 0
        if len(keep) == len(work.chunks):
            if go_on:
                self._launch_ahead(flight)
            out.extend(self.output.accept(work, None, flight.host_tokens()))
            self._drop_idle()
            return 1
        chosen = flight.host_tokens().tolist()
        tokens = torch.tensor([chosen[i] for i in keep], dtype=torch.long)
        work = StepWork([work.chunks[i] for i in keep], work.tokens, work.meta, list(range(len(keep))), None,
                        work.next_layer)  # fmt: skip
        out.extend(self.output.accept(work, None, tokens))
        return 1
