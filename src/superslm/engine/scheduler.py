"""The one scheduling rule, in plain Python: which sequences compute how many tokens this step.

The scheduler alone grants and frees KV pages: prompts and answers (`grow`), restored sequences
(`resume`), prefix handles (`grant`, `free`, `adopt`) and caller-driven slots all ask it, so one object
knows why every page is held. For models with gated delta-rule layers it also gives each running sequence
a row of the recurrent states (`state_slot`), taken when it starts running and given back when it stops.

Every step has a budget of `rows` tokens. Generating sequences get their next token first; the rows
left go to the next chunks of prompts not read yet (running ones first, then new ones from the
waiting queue while slots are free), so decode and chunked prefill share one forward pass. When the
pool has no room, free cached pages are evicted first (the pool does that), then the sequence that
came last is preempted: its pages go back and it later resumes from its prompt and answer so far.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from superslm.cache import ExtraKey, PagePool
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
                 extra_key: Callable[[Sequence], ExtraKey] | None = None, chunk: int | None = None,
                 copy_page: Callable[[int, int, int], None] | None = None, recurrent: bool = False,
                 copy_state: Callable[[Sequence], None] | None = None,
                 usable_prefix: Callable[[list[int]], int] | None = None, draft_rows: int | None = None,
                 keep_state: Callable[[Sequence, int], None] | None = None, mtp: bool = False) -> None:
        self.pool, self.slots, self.rows = pool, slots, rows
        #: the KV holds the MTP block's layer too (engine/mtp_drafter.py): a page is offered to the prefix cache
        #: once the MTP rows of its positions are written, and a match drops its last page
        self.mtp = mtp
        #: free rows of the recurrent states (models with delta-rule layers), one per running sequence
        self.free_states: list[int] | None = list(range(slots)) if recurrent else None
        #: copy_state(seq): the recurrent states after seq's computed prefix (a prefix handle's, or a checkpoint's
        #: after cached pages) into its row
        self.copy_state = copy_state
        #: usable_prefix(pages): how many of a prefix cache match's pages a recurrent model can resume after (the
        #: longest run whose states were checkpointed); None: none can
        self.usable_prefix = usable_prefix
        #: the most draft rows one step carries (a delta-rule model keeps the states after each in a scratch row
        #: of its recurrent states); None: as many as the rows allow
        self.draft_rows = draft_rows
        self._drafts_left = draft_rows
        #: keep_state(seq, row): the recurrent states of scratch row `row` into seq's row (a rollback's)
        self.keep_state = keep_state
        #: the most prompt tokens one sequence reads in a step
        self.chunk = chunk or rows
        #: copy_page(src, dst, n): the KV of a page's first n slots into another page (the KV's owner does it)
        self.copy_page = copy_page
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

    # --- pages ------------------------------------------------------------------------------------

    def can_grant(self, n: int) -> bool:
        return self.pool.can_allocate(n)

    def grant(self, n: int) -> list[int]:
        """n pages, all or none (KVCacheFull where the pool cannot hold them, nothing changed)."""
        return self.pool.allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per page (a block_table in order: its last pages are evicted first)."""
        self.pool.release(pages)

    def cache_pages(self, pages: Seq[int], tokens: Seq[int]) -> None:
        """Offer the full pages holding `tokens` to the prefix cache (a prefix handle's, no salt)."""
        if self.prefix_caching:
            self.pool.register_full_pages(pages, tokens, len(tokens), None)

    def release(self, seq: Sequence) -> None:
        """Give a sequence's pages back, offering its full computed pages to the prefix cache first."""
        if seq.block_table:
            self.register(seq)
            self.free(seq.block_table)
        seq.block_table = []

    def registrable(self, seq: Sequence) -> int:
        """The tokens of seq whose pages may be offered to the prefix cache: its computed ones (with the MTP's
        layer, those whose MTP rows are written too: a page with a stale MTP row would mislead its readers)."""
        return min(seq.num_computed_tokens, seq.mtp_rows) if self.mtp else seq.num_computed_tokens

    def register(self, seq: Sequence) -> None:
        n = self.registrable(seq)
        if self.prefix_caching and seq.block_table and not self.pool.full_pages_registered(seq.block_table, n):
            self.pool.register_full_pages(seq.block_table, seq.tokens, n, self.extra_key(seq))

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or cancelled) and free its pages."""
        if seq in self.running:
            self._stop(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        for handle in (seq.request.prefix, seq.request.adapter):
            if handle is not None:
                handle.users.discard(id(seq))  # the object, not seq.id: every engine counts ids from 0

    def _run(self, seq: Sequence) -> None:
        """seq joins the running set (and takes a row of the recurrent states)."""
        self.running.append(seq)
        if self.free_states is not None:
            seq.state_slot = self.free_states.pop(0)

    def _stop(self, seq: Sequence) -> None:
        """seq leaves the running set (its row of the recurrent states goes back)."""
        self.running.remove(seq)
        if self.free_states is not None and seq.state_slot is not None:
            self.free_states.append(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self._stop(seq)
        self.release(seq)
        seq.drafts.clear()
        seq.num_computed_tokens = 0
        seq.mtp_rows = 0
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
        if not self.can_grant(need):
            return False
        seq.block_table.extend(self.grant(need))
        return True

    def rollback(self, seq: Sequence, state: int | None = None) -> None:
        """Take back the pages past seq's computed tokens: a step wrote its rejected drafts' K/V there, which
        nothing reads (a page is registered only once full and computed, and every later step writes a
        position's K/V before it attends to it), so they hold nothing seq needs. `state`: the scratch row of the
        recurrent states after seq's last kept row (a delta-rule model's rejected rows advanced its own row past
        it), copied back into seq's row."""
        if state is not None:
            if self.keep_state is None or seq.state_slot is None:
                raise TypeError("a rollback of recurrent states needs the scheduler's keep_state and a state row")
            self.keep_state(seq, state)
        keep = self.pages_for(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.free(extra)

    def grow_ahead(self, seqs: Seq[Sequence], n: int) -> bool:
        """Give every seq the pages for n more tokens from free pages only, all or none: a step launched
        ahead, which a stop may throw away, evicts no cached prefix and leaves the next schedule no
        preemption to make."""
        need = sum(max(0, self.pages_for(s.num_computed_tokens + n) - len(s.block_table)) for s in seqs)
        if need > self.pool.num_free:
            return False
        for seq in seqs:
            self.grow(seq, n)
        return True

    def resume(self, seq: Sequence, num_tokens: int) -> bool:
        """Run a restored sequence now with pages for its first num_tokens (whose KV the caller writes);
        False when no slot or no room is free (it waits in the queue instead, to be recomputed)."""
        pages = self.pages_for(num_tokens)
        if len(self.running) >= self.slots or not self.can_grant(pages):
            return False
        seq.block_table = self.grant(pages)
        seq.mtp_rows = num_tokens  # a saved sequence's KV holds the MTP's rows of its computed tokens too
        self._run(seq)
        return True

    def adopt(self, seq: Sequence) -> bool:
        """Give a sequence its prefix handle's pages: full ones shared, the partial last one copied into a
        page of its own (it will write there). False when the pool has no page for that copy now."""
        pre = seq.request.prefix
        n, ps = len(pre.tokens), self.pool.page_size
        full, partial = divmod(n, ps)
        if self.mtp:
            # the MTP's row of the prefix's last position reads the adopter's first token: that page is its own
            full, partial = (n - 1) // ps, n - (n - 1) // ps * ps
            seq.mtp_rows, seq.mtp_hidden = (n - 1, pre.hidden) if pre.hidden is not None else (0, None)
        if partial and not self.can_grant(1):
            return False
        self.pool.retain(pre.pages[:full])
        seq.block_table = list(pre.pages[:full])
        if partial:
            if self.copy_page is None:
                raise TypeError("a prefix with a partial page needs the scheduler's copy_page")
            page = self.grant(1)[0]
            self.copy_page(pre.pages[full], page, partial)
            seq.block_table.append(page)
        seq.num_computed_tokens = n
        seq.num_hashed_pages = full
        if seq.preemptions == 0:
            seq.cached = n
        return True

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether the pool could hold this sequence's next token with nothing else in it."""
        return self.pages_for(seq.num_tokens + 1) <= self.pool.num_pages

    # --- the rule ---------------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int, reserve: int = 0) -> int:
        """How many of seq's tokens to compute in this step: what is left, at most the budget and the chunk (a
        decoding sequence: its newest token and the drafts that fit beside the `reserve` rows of the decoding
        sequences after it, `Sequence.drafts` cut to them). A
        recurrent model's chunk that would run past its prompt's last page boundary stops there, so its states
        are checkpointed where a prompt starting the same way can resume (the few tokens after come next step)."""
        done = seq.num_computed_tokens
        if seq.num_tokens - done == 1 and seq.drafts:
            # a decode row and its drafts, as many as the budget and the step's draft rows hold (the ones left out
            # are proposed again)
            n = min(1 + len(seq.drafts), max(1, budget - reserve))
            if self._drafts_left is not None:
                n = min(n, 1 + self._drafts_left)
            del seq.drafts[n - 1 :]
            return n
        seq.drafts.clear()  # a sequence with more than its newest token to compute verifies nothing this step
        n = min(seq.num_tokens - done, budget, self.chunk)
        if self.free_states is not None and self.prefix_caching and n > 1 and seq.num_tokens - done == n:
            edge = (seq.num_tokens - 1) // self.pool.page_size * self.pool.page_size
            if done < edge < done + n:
                n = edge - done
        return n

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.rows
        self._drafts_left = self.draft_rows
        # generating sequences first, then running prefills; each group in arrival order
        order = sorted(self.running, key=lambda s: (s.prefilling, s.id))
        decoding = sum(not s.prefilling for s in order)  # each one's next token comes before anyone's drafts
        for seq in order:
            decoding -= not seq.prefilling
            if seq not in self.running or budget == 0:
                continue
            n = self._chunk(seq, budget, decoding)
            while not self.grow(seq, n):
                if seq.drafts:  # drafts are optional tokens: dropped before anyone is preempted for them
                    seq.drafts.clear()
                    n = 1
                    continue
                victim = max(self.running, key=lambda s: s.id)  # the one that came last
                if victim is seq and len(self.running) == 1:
                    # alone and still no room: it can never fit
                    self._stop(seq)
                    step.too_long.append(seq)
                    seq.end = END_LENGTH
                    break
                self._preempt(victim, step)
                if victim is seq:
                    break
                # the one that came last may have been scheduled already (a decoding sequence that came after a
                # preempted one now recomputing its prompt): its chunk goes with it, rows back to the budget
                for k, (other, m) in enumerate(step.chunks):
                    if other is victim:
                        del step.chunks[k]
                        budget += m
                        break
            if seq in self.running:
                step.chunks.append((seq, n))
                budget -= n
                if self._drafts_left is not None:
                    self._drafts_left -= len(seq.drafts)  # what _chunk left of them (none where grow dropped them)
        if step.preempted:
            return step  # no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.slots:
            seq = self.waiting[0]
            if not self.fits_alone(seq):
                self.waiting.popleft()
                step.too_long.append(seq)
                seq.end = END_LENGTH
                continue
            resumed = False
            if not seq.block_table and seq.request.prefix is not None:
                if not self.adopt(seq):
                    break
                resumed = True
            elif not seq.block_table and self.prefix_caching and not seq.wants_prompt_logprobs:
                pages = self.pool.match_prefix(seq.tokens, self.extra_key(seq))
                # with the MTP's layer the last page goes: its last MTP row read the next page's first token,
                # which the match did not check
                usable = pages[:-1] if self.mtp else pages
                if self.free_states is not None:  # a recurrent model resumes only where its states were kept
                    usable = usable[: self.usable_prefix(usable) if self.usable_prefix is not None else 0]
                    resumed = bool(usable)
                self.free(pages[len(usable):])
                pages = usable
                seq.block_table = pages
                seq.num_computed_tokens = seq.mtp_rows = len(pages) * self.pool.page_size
                seq.num_hashed_pages = len(pages)
                if seq.preemptions == 0:
                    seq.cached = seq.num_computed_tokens
            n = self._chunk(seq, budget)
            if not self.grow(seq, n):
                # keep its matched pages referenced only while it runs
                self.release(seq)
                seq.num_computed_tokens = 0
                seq.num_hashed_pages = 0
                break
            self.waiting.popleft()
            self._run(seq)
            if resumed and self.free_states is not None and self.copy_state is not None:
                self.copy_state(seq)
            step.chunks.append((seq, n))
            budget -= n
        if not step.chunks and not self.running and self.waiting:
            # nothing runs and the head still does not fit: pages held outside the queue (prefix
            # handles, low-level slots) leave it too little room, and nothing here will free them
            seq = self.waiting.popleft()
            seq.end = END_LENGTH
            step.too_long.append(seq)
        return step


class AsyncScheduler(Scheduler):
    """The scheduler of an engine that launches decode steps ahead (engine/overlap.py): the step after one
    still on the device is scheduled before its tokens reach the host, where nothing they could tell would
    change it. `schedule_ahead` is that decision; every other state change is the base class's."""

    def schedule_ahead(self, chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether the next decode step of exactly these sequences (the step whose tokens are in flight) is
        decided already, and if so grant its pages (free ones only: all or none)."""
        if len(self.running) != len(chunks):
            return False  # a sequence outside this step (a prompt, a restored one) is scheduled after it
        if self.waiting and len(self.running) < self.slots:
            return False  # a waiting request is admitted by the next schedule, after this step is accepted
        for seq, _ in chunks:
            if seq.end or seq.prefill_hidden is None:
                return False
            if len(seq.output) + 2 > seq.max_tokens:
                return False  # this step's token may be its last: the step after would be thrown away
        # the pages of the token after this step's
        return self.grow_ahead([seq for seq, _ in chunks], 2)
