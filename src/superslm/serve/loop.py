"""The engine loop: one thread owns the Engine; async HTTP handlers talk to it through commands.

The Engine is not thread-safe, so exactly one thread calls it. A handler builds a `Submission` (the
Requests of one HTTP request, one per choice), hands it over with `EngineLoop.submit`, and reads
lists of `Event`s from the submission's asyncio queue; the loop thread puts them there with
`call_soon_threadsafe`. Admission is bounded: at most `slots + max_waiting` sequences are accepted
and not yet ended, beyond that `submit` raises QueueFull at once (HTTP 503).

This module needs no web framework.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from superslm.engine import Progress, Request
from superslm.engine.request import END_STOP
from superslm.errors import InternalError, QueueFull, SuperSLMError, UnknownRequest
from superslm.serve.worker import ServiceThread

if TYPE_CHECKING:
    from superslm.engine import Engine

log = logging.getLogger("superslm.serve")


class LoopMetrics(Protocol):
    """What the loop reports, from its own thread (see metrics.Metrics)."""

    def on_admitted(self, prompt_tokens: int) -> None: ...
    def on_generated(self, tokens: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_next_token(self, seconds: float) -> None: ...
    def on_sequence_end(self, reason: str) -> None: ...
    def on_forced(self, tokens: int) -> None: ...


@dataclass
class Event:
    """One choice's news: a Progress, or the error that ended it before it started."""

    index: int
    progress: Progress | None = None
    error: SuperSLMError | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and counters, taken by the loop thread after each step."""

    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_used: int = 0
    pages_cached: int = 0
    pages_free: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    evictions: int = 0
    steps: int = 0
    #: speculative decoding (zeros on an engine that does not draft): draft tokens proposed and accepted,
    #: and the sequence steps that carried drafts
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_steps: int = 0
    #: the expert cache (`--expert-slots`; zeros without one): slots per block, hits, misses, read ms
    expert_slots: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_read_ms: float = 0.0


class Submission:
    """The sequences of one HTTP request and the queue their events arrive on.

    Create it inside the handler's event loop. `prompt_tokens` is what usage reports (each distinct
    prompt once), counted by the metrics when the loop admits it.
    """

    def __init__(self, requests: Sequence[Request], prompt_tokens: int) -> None:
        self.requests = list(requests)
        self.prompt_tokens = prompt_tokens
        self.events: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.created = time.monotonic()
        #: set by the handler (any thread may read it)
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        # loop-thread state: engine id per choice, and when each choice last sampled a token
        self.ids: dict[int, int] = {}
        self.last_token: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def deliver(self, events: list[Event]) -> None:
        """Hand events to the handler's event loop (called from the loop thread)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, events)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening any more
            pass


def sampled_tokens(p: Progress) -> int:
    """Tokens the model sampled in this Progress: its tokens, plus the stop token it does not return."""
    return len(p.tokens) + (1 if p.end == END_STOP and isinstance(p.stop_reason, int) else 0)


class EngineLoop(ServiceThread):
    """Runs `engine` in a thread of its own; `submit` and `cancel` may be called from any thread.
    `drain` refuses new submissions while those in flight go on; `stop` cancels what is in flight."""

    thread_name = "superslm-engine"

    def __init__(self, engine: Engine, max_waiting: int, metrics: LoopMetrics) -> None:
        super().__init__()
        self.engine = engine
        self.capacity = engine.slots + max_waiting
        self.metrics = metrics
        # guarded by _lock
        self._adds: list[Submission] = []
        self._cancels: list[Submission] = []
        self._admitted = 0
        self._stats = EngineStats()
        # loop thread only: engine id -> (submission, choice index)
        self._live: dict[int, tuple[Submission, int]] = {}

    # --- any thread -------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.alive and not self._draining

    def submit(self, sub: Submission) -> None:
        """Queue a submission, or raise QueueFull (no room, or draining) or InternalError (the loop died)."""
        if self._thread is None:  # an app used without its lifespan (some test clients skip it)
            self.start()
        with self._lock:
            if not self.alive:
                raise InternalError("the engine loop has stopped")
            if self._draining or self._stopping:
                raise QueueFull("the server is shutting down")
            if self._admitted + len(sub) > self.capacity:
                raise QueueFull(
                    f"the server is full ({self._admitted} sequences in flight, room for {self.capacity}); "
                    "retry later"
                )
            self._admitted += len(sub)
            self._adds.append(sub)
            self._wake.notify()

    def cancel(self, sub: Submission) -> None:
        """End a submission's sequences now; their pages go back to the pool on the loop's next turn."""
        sub.cancelled = True
        with self._lock:
            self._cancels.append(sub)
            self._wake.notify()

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the loop thread)."""
        with self._lock:
            return self._stats

    @property
    def admitted(self) -> int:
        """Sequences accepted and not yet ended."""
        with self._lock:
            return self._admitted

    # --- the loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._snapshot()
            while True:
                with self._lock:
                    while not (self._adds or self._cancels or self._stopping or self.engine.busy()):
                        self._wake.wait()
                    adds, self._adds = self._adds, []
                    cancels, self._cancels = self._cancels, []
                    stopping = self._stopping
                for sub in cancels:
                    self._cancel(sub)
                for sub in adds:
                    self._add(sub)
                if stopping:
                    for sub, _ in list(self._live.values()):
                        self._cancel(sub)
                if self.engine.busy():
                    progress = self.engine.advance()
                    self._snapshot()
                    self._dispatch(progress)
                else:
                    self._snapshot()
                    if stopping:
                        return
        except BaseException as e:  # a bug in a lower layer: fail every request, report dead
            log.exception("the engine loop died")
            self.error = e
            self._fail_all(e)

    def _add(self, sub: Submission) -> None:
        if sub.cancelled:
            self._release(len(sub))
            return
        for i, req in enumerate(sub.requests):
            try:
                rid = self.engine.add(req)
            except Exception as e:
                err = e if isinstance(e, SuperSLMError) else InternalError(f"engine.add failed: {e}")
                if not isinstance(e, SuperSLMError):
                    log.exception("engine.add failed")
                for other in sub.ids.values():
                    self._live.pop(other, None)
                    try:
                        self.engine.cancel(other)
                    except UnknownRequest:  # ended in add() (a grammar's forced tokens reached max_tokens)
                        pass
                self._release(len(sub))
                sub.deliver([Event(i, error=err)])
                return
            sub.ids[i] = rid
            self._live[rid] = (sub, i)
        self.metrics.on_admitted(sub.prompt_tokens)

    def _cancel(self, sub: Submission) -> None:
        for rid in sub.ids.values():
            if rid in self._live:
                try:
                    self.engine.cancel(rid)
                except UnknownRequest:  # ended in the same step; its Progress is on the way
                    pass

    def _dispatch(self, progress: list[Progress]) -> None:
        now = time.monotonic()
        out: dict[Submission, list[Event]] = {}
        ended = 0
        for p in progress:
            entry = self._live.get(p.id)
            if entry is None:
                continue
            sub, i = entry
            n = sampled_tokens(p)
            if n:
                self.metrics.on_generated(n)
                last = sub.last_token.get(i)
                if last is None:
                    self.metrics.on_first_token(now - sub.created)
                    n, last = n - 1, now
                for _ in range(n):
                    self.metrics.on_next_token(now - last)
                sub.last_token[i] = now
            if p.end:
                del self._live[p.id]
                ended += 1
                self.metrics.on_sequence_end(p.end)
                if p.forced_tokens:
                    self.metrics.on_forced(p.forced_tokens)
            out.setdefault(sub, []).append(Event(i, progress=p))
        if ended:
            self._release(ended)
        for sub, events in out.items():
            sub.deliver(events)

    def _release(self, n: int) -> None:
        with self._lock:
            self._admitted -= n

    def _snapshot(self) -> None:
        e = self.engine
        pool = e.pool.stats()
        spec = e.speculator.stats() if e.speculator is not None else {}
        experts = e.expert_cache()
        with self._lock:
            pending = sum(len(s) for s in self._adds)
            self._stats = EngineStats(
                running=len(e.scheduler.running),
                waiting=len(e.scheduler.waiting) + pending,
                pages_total=pool.num_pages,
                pages_used=pool.num_used,
                pages_cached=pool.num_cached,
                pages_free=pool.num_free,
                prefix_query_tokens=pool.prefix_query_tokens,
                prefix_hit_tokens=pool.prefix_hit_tokens,
                prefix_hit_rate=pool.prefix_hit_rate,
                preemptions=e.scheduler.num_preemptions,
                evictions=pool.evictions,
                steps=e.steps,
                drafts_proposed=spec.get("drafts_proposed", 0),
                drafts_accepted=spec.get("drafts_accepted", 0),
                draft_steps=spec.get("draft_steps", 0),
                expert_slots=experts["slots"],
                expert_hits=experts["hits"],
                expert_misses=experts["misses"],
                expert_read_ms=experts["read_ms"],
            )

    def _fail_all(self, exc: BaseException) -> None:
        err = InternalError(f"the engine loop stopped: {type(exc).__name__}")
        with self._lock:
            pending, self._adds = self._adds, []
            self._admitted = 0
        subs: dict[Submission, None] = {sub: None for sub, _ in self._live.values()}
        subs.update({sub: None for sub in pending})
        self._live.clear()
        for sub in subs:
            sub.deliver([Event(i, error=err) for i in range(len(sub))])
