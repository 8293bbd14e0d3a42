"""The one scheduling rule, in plain Python: which sequences compute how many tokens this step.

Every step has a budget of `rows` tokens. Generating sequences get their next token first; the rows
left go to the next chunks of prompts not read yet (running ones first, then new ones from the
waiting queue while slots are free), so decode and chunked prefill share one forward pass. When the
pool has no room, free cached pages are evicted first (the pool does that), then the sequence that
came last is preempted: its pages go back and it later resumes from its prompt and answer so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from superslm.cache import PagePool
from superslm.engine.request import END_LENGTH, Sequence


@dataclass
class ScheduledStep:
    """What one step computes: (sequence, number of new tokens) in row order."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    #: sequences that can never fit (the pool is too small for them alone); they end with "length"
    too_long: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    """Holds the waiting queue and the running set; `schedule()` applies the rule once."""

    def __init__(self, pool: PagePool, slots: int, rows: int, prefix_caching: bool = True,
                 extra_key: Callable[[Sequence], str | None] | None = None, chunk: int | None = None,
                 adopt: Callable[[Sequence], bool] | None = None) -> None:
        self.pool, self.slots, self.rows = pool, slots, rows
        #: the most prompt tokens one sequence reads in a step
        self.chunk = chunk or rows
        #: gives a sequence its prefix handle's pages (False: no room now)
        self.adopt = adopt
        self.prefix_caching = prefix_caching
        self.extra_key = extra_key or (lambda s: s.salt)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- bookkeeping ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.page_size)

    def release(self, seq: Sequence) -> None:
        """Give a sequence's pages back, offering its full computed pages to the prefix cache first."""
        if seq.block_table:
            self.register(seq)
            self.pool.release(seq.block_table)
        seq.block_table = []

    def register(self, seq: Sequence) -> None:
        if (self.prefix_caching and seq.block_table
                and not self.pool.full_pages_registered(seq.block_table, seq.num_computed_tokens)):
            self.pool.register_full_pages(seq.block_table, seq.tokens, seq.num_computed_tokens, self.extra_key(seq))

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or cancelled) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        for handle in (seq.request.prefix, seq.request.adapter):
            if handle is not None:
                handle.users.discard(id(seq))  # the object, not seq.id: every engine counts ids from 0

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_pages = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def grow(self, seq: Sequence, n: int) -> bool:
        """Give seq the pages for n more tokens; False when the pool cannot (nothing changed)."""
        need = self.pages_for(seq.num_computed_tokens + n) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether the pool could hold this sequence's next token with nothing else in it."""
        return self.pages_for(seq.num_tokens + 1) <= self.pool.num_pages

    # --- the rule ---------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.rows
        # generating sequences first, then running prefills; each group in arrival order
        order = sorted(self.running, key=lambda s: (s.prefilling, s.id))
        for seq in order:
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk)
            while not self.grow(seq, n):
                victim = max(self.running, key=lambda s: s.id)  # the one that came last
                if victim is seq and len(self.running) == 1:
                    # alone and still no room: it can never fit
                    self.running.remove(seq)
                    step.too_long.append(seq)
                    seq.end = END_LENGTH
                    break
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq in self.running:
                step.chunks.append((seq, n))
                budget -= n
        if step.preempted:
            return step  # no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.slots:
            seq = self.waiting[0]
            if not self.fits_alone(seq):
                self.waiting.popleft()
                step.too_long.append(seq)
                seq.end = END_LENGTH
                continue
            if not seq.block_table and seq.request.prefix is not None and self.adopt is not None:
                if not self.adopt(seq):
                    break
            elif not seq.block_table and self.prefix_caching and not seq.wants_prompt_logprobs:
                pages = self.pool.match_prefix(seq.tokens, self.extra_key(seq))
                seq.block_table = pages
                seq.num_computed_tokens = len(pages) * self.pool.page_size
                seq.num_hashed_pages = len(pages)
                if seq.preemptions == 0:
                    seq.cached = seq.num_computed_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk)
            if not self.grow(seq, n):
                # keep its matched pages referenced only while it runs
                self.release(seq)
                seq.num_computed_tokens = 0
                seq.num_hashed_pages = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            step.chunks.append((seq, n))
            budget -= n
        if not step.chunks and not self.running and self.waiting:
            # nothing runs and the head still does not fit: pages held outside the queue (prefix
            # handles, low-level slots) leave it too little room, and nothing here will free them
            seq = self.waiting.popleft()
            seq.end = END_LENGTH
            step.too_long.append(seq)
        return step
