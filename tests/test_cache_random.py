"""The KV page pool against a reference model under random operations, and an engine-like simulation (the
pool's bookkeeping without a model; the targeted cases are in test_cache.py)."""

from __future__ import annotations

import hashlib
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from superslm.cache import PagePool, PageState, prefix_hash
from superslm.errors import KVCacheFull

PS = 4  # page size


class Model:
    """The expected pool, kept with plain lists and true token prefixes (extra key, tokens) for hashes."""

    def __init__(self, num_pages: int) -> None:
        self.ref = [0] * num_pages
        self.free = list(range(num_pages))
        self.lru: list[int] = []  # oldest first
        self.content: list[tuple | None] = [None] * num_pages  # of holders and duplicates
        self.holder: dict[tuple, int] = {}
        self.dups: dict[tuple, list[int]] = {}  # oldest first
        self.evictions = self.queries = self.query_tokens = self.hit_tokens = 0

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free) + len(self.lru):
            return None
        out = [self.free.pop(0) for _ in range(min(n, len(self.free)))]
        while len(out) < n:
            page = self.lru.pop(0)
            content = self.content[page]
            if self.dups.get(content):  # the oldest duplicate in use inherits the content
                self.holder[content] = self.dups[content].pop(0)
            else:
                del self.holder[content]
            self.content[page] = None
            self.evictions += 1
            out.append(page)
        for page in out:
            self.ref[page] = 1
        return out

    def release(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self.ref[page] -= 1
            if self.ref[page] == 0:
                content = self.content[page]
                if content is not None and self.holder[content] == page:
                    self.lru.append(page)
                    continue
                self.free.append(page)
                if content is not None:  # a duplicate: its holder counts as just used
                    self.dups[content].remove(page)
                    self.content[page] = None
                    if self.holder[content] in self.lru:
                        self.lru.remove(self.holder[content])
                        self.lru.append(self.holder[content])

    def register(self, page: int, content: tuple) -> None:
        if self.content[page] is not None:
            return
        self.content[page] = content
        if content in self.holder:
            self.dups.setdefault(content, []).append(page)
        else:
            self.holder[content] = page

    def match(self, tokens: list[int], extra) -> list[int]:
        pages: list[int] = []
        while (len(pages) + 1) * PS <= len(tokens) - 1:
            page = self.holder.get((extra, tuple(tokens[: (len(pages) + 1) * PS])))
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.ref[page] == 0:
                self.lru.remove(page)
            self.ref[page] += 1
        self.queries += 1
        self.query_tokens += len(tokens)
        self.hit_tokens += len(pages) * PS
        return pages

    def clear(self) -> None:
        self.free += self.lru
        self.lru, self.holder, self.dups, self.content = [], {}, {}, [None] * len(self.ref)

    def compare(self, pool: PagePool) -> None:
        states = [
            PageState.USED if r else PageState.CACHED if p in self.lru else PageState.FREE
            for p, r in enumerate(self.ref)
        ]
        assert [pool.page_state(p) for p in range(pool.num_pages)] == states
        assert [pool.ref_count(p) for p in range(pool.num_pages)] == self.ref
        stats = pool.stats()
        assert (pool.num_free, pool.num_cached, pool.num_registered) == (
            len(self.free),
            len(self.lru),
            len(self.holder),
        )
        counters = (stats.evictions, stats.prefix_queries, stats.prefix_query_tokens, stats.prefix_hit_tokens)
        assert counters == (self.evictions, self.queries, self.query_tokens, self.hit_tokens)


@dataclass
class Seq:
    tokens: list[int]
    extra: object
    block_table: list[int]
    num_computed: int
    num_registered: int  # -1 after clear_prefix_cache


@dataclass
class Driver:
    """Random engine-like operations on a pool (and a model, when the hash is the real one)."""

    pool: PagePool
    model: Model | None
    rng: random.Random
    seqs: list[Seq] = field(default_factory=list)
    handles: list[list[int]] = field(default_factory=list)
    contents: dict[int, tuple | None] = field(default_factory=dict)  # true content of computed pages

    def __post_init__(self) -> None:
        # prompts share prefixes, and the same page content recurs at other positions behind other prefixes
        chunks = [[self.rng.randrange(3) for _ in range(PS)] for _ in range(3)]
        self.prefixes = [sum((self.rng.choice(chunks) for _ in range(3)), []) for _ in range(6)]

    def match(self, tokens: list[int], extra) -> list[int]:
        pages = self.pool.match_prefix(tokens, extra)
        assert len(pages) * PS < len(tokens)
        for k, page in enumerate(pages):  # every page holds exactly the query's prefix
            assert self.contents[page] == (extra, tuple(tokens[: (k + 1) * PS]))
        if self.model:
            assert pages == self.model.match(tokens, extra)
        return pages

    def allocate(self, n: int) -> list[int] | None:
        try:
            pages = self.pool.allocate(n)
        except KVCacheFull:
            pages = None
        if self.model:
            assert pages == self.model.allocate(n)
        for page in pages or []:
            self.contents[page] = None
        return pages

    def release(self, pages: list[int]) -> None:
        self.pool.release(pages)
        if self.model:
            self.model.release(pages)

    def new_seq(self, tokens: list[int], extra) -> Seq | None:
        pages = self.match(tokens, extra)
        new = self.allocate(-(-len(tokens) // PS) - len(pages))
        if new is None:
            self.release(pages)
            return None
        seq = Seq(tokens, extra, pages + new, len(pages) * PS, len(pages))
        self.seqs.append(seq)
        return seq

    def step(self, seq: Seq, chunk: int) -> bool:
        """Prefill up to ``chunk`` tokens or decode one; False when the sequence was preempted."""
        if seq.num_computed < len(seq.tokens):
            seq.num_computed = min(len(seq.tokens), seq.num_computed + chunk)
        else:
            seq.tokens.append(self.rng.randrange(3))
            if len(seq.tokens) > len(seq.block_table) * PS:
                page = self.allocate(1)
                if page is None:
                    self.finish(seq)
                    return False
                seq.block_table += page
            seq.num_computed += 1
        done = self.pool.full_pages_registered(seq.block_table, seq.num_computed)
        n = self.pool.register_full_pages(seq.block_table, seq.tokens, seq.num_computed, seq.extra)
        assert not done or n == 0  # the shortcut the scheduler takes skips no registration
        full = seq.num_computed // PS
        if seq.num_registered >= 0:
            assert n == full - seq.num_registered
        for k in range(max(seq.num_registered, 0), full):
            content = (seq.extra, tuple(seq.tokens[: (k + 1) * PS]))
            self.contents[seq.block_table[k]] = content
            if self.model:
                self.model.register(seq.block_table[k], content)
        seq.num_registered = full
        return True

    def finish(self, seq: Seq) -> None:
        self.release(seq.block_table)
        self.seqs.remove(seq)

    def random_op(self) -> None:
        rng, pool = self.rng, self.pool
        op = rng.random()
        if op < 0.2 and len(self.seqs) < 6 or not self.seqs:
            head = rng.choice(self.prefixes)[: rng.randint(0, 3 * PS)]
            tail = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            self.new_seq(head + tail, rng.choice([None, "a", b"a"]))
        elif op < 0.6:
            self.step(rng.choice(self.seqs), rng.randint(1, 2 * PS))
        elif op < 0.75:
            self.finish(rng.choice(self.seqs))
        elif op < 0.9 and len(self.handles) >= 3:
            self.release(self.handles.pop(rng.randrange(len(self.handles))))
        elif op < 0.82:
            seq = rng.choice(self.seqs)  # a prefix handle pins the sequence's full computed pages
            handle = seq.block_table[: seq.num_computed // PS]
            pool.retain(handle)
            if self.model:
                for page in handle:
                    self.model.ref[page] += 1
            self.handles.append(handle)
        elif op < 0.9 and self.handles:
            self.release(self.handles.pop(rng.randrange(len(self.handles))))
        elif op < 0.95:
            pages = self.allocate(rng.randint(0, pool.num_pages // 2))
            if pages:
                self.handles.append(pages)
        elif op < 0.995:
            free = [p for p in range(pool.num_pages) if pool.page_state(p) is PageState.FREE]
            if free:
                with pytest.raises(AssertionError):
                    pool.release([rng.choice(free)])
        else:
            pool.clear_prefix_cache()
            if self.model:
                self.model.clear()
            for seq in self.seqs:
                # unknown: pages shared with another sequence may be registered again by it first
                seq.num_registered = -1

    def verify(self) -> None:
        self.pool.check()
        held = Counter(p for seq in self.seqs for p in seq.block_table)
        held.update(p for handle in self.handles for p in handle)
        assert [self.pool.ref_count(p) for p in range(self.pool.num_pages)] == [
            held[p] for p in range(self.pool.num_pages)
        ]
        assert self.pool.num_free + self.pool.num_used + self.pool.num_cached == self.pool.num_pages
        if self.model:
            self.model.compare(self.pool)


def test_5000_random_operations_against_a_reference_model() -> None:
    pool = PagePool(24, PS)
    driver = Driver(pool, Model(24), random.Random(5000))
    for _ in range(5000):
        driver.random_op()
        driver.verify()
    stats = pool.stats()
    assert stats.prefix_hit_tokens > 0 and stats.evictions > 0 and stats.hash_conflicts == 0


def two_bit_hash(parent, tokens, extra_key=None) -> bytes:
    return bytes([hashlib.sha256(prefix_hash.encode_page(parent, tokens, extra_key)).digest()[0] & 3])


@pytest.mark.parametrize("weak_hash", [two_bit_hash, lambda parent, tokens, extra_key=None: b"\x00"])
def test_random_operations_with_colliding_hashes_never_match_wrong_pages(weak_hash, monkeypatch) -> None:
    monkeypatch.setattr(prefix_hash, "page_hash", weak_hash)
    # the pool now misses where the model hits: only soundness (Driver.match) and the refs are checked
    for seed in range(4):
        pool = PagePool(24, PS)
        driver = Driver(pool, None, random.Random(seed))
        for _ in range(1500):
            driver.random_op()
            driver.verify()
        stats = pool.stats()
        assert stats.prefix_hit_tokens > 0 and stats.hash_conflicts > 0


def test_200_sequences_with_random_cancels_end_with_no_page_used() -> None:
    rng = random.Random(200)
    pool = PagePool(40, PS)
    driver = Driver(pool, Model(40), rng)
    waiting = deque()
    for _ in range(200):
        head = rng.choice(driver.prefixes)[: rng.randint(PS, 3 * PS)]
        tail = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        waiting.append((head + tail, rng.choice([None, "a"]), rng.randint(1, 12)))
    running: list[tuple[Seq, int]] = []
    done = cancelled = preempted = 0
    for _ in range(10_000):
        if not waiting and not running:
            break
        while waiting and len(running) < 8:
            tokens, extra, max_new = waiting[0]
            seq = driver.new_seq(list(tokens), extra)
            if seq is None:
                break
            waiting.popleft()
            running.append((seq, len(tokens) + max_new))
        for seq, target in list(running):
            if not driver.step(seq, 2 * PS):  # preempted: recomputed later from its tokens so far
                running.remove((seq, target))
                waiting.appendleft((seq.tokens, seq.extra, target - len(seq.tokens)))
                preempted += 1
            elif len(seq.tokens) >= target and seq.num_computed == len(seq.tokens):
                driver.finish(seq)
                running.remove((seq, target))
                done += 1
            elif rng.random() < 0.03:
                driver.finish(seq)
                running.remove((seq, target))
                cancelled += 1
        if waiting and rng.random() < 0.01:
            waiting.pop()
            cancelled += 1
        driver.verify()
    assert not waiting and not running and done + cancelled == 200 and cancelled > 0
    assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages
    assert pool.stats().prefix_hit_tokens > 0 and pool.stats().evictions > 0
    pool.check()


def test_a_page_under_a_colliding_parent_never_matches(monkeypatch) -> None:
    # a hash blind to the parent: [D, B] and [A, B] collide on their second page
    monkeypatch.setattr(prefix_hash, "page_hash", lambda parent, tokens, extra_key=None: bytes(tokens))
    a, b, d, x = ([t] * PS for t in (1, 2, 4, 9))
    pool = PagePool(8, PS)
    table_0, table_1 = pool.allocate(2), pool.allocate(3)
    pool.register_full_pages(table_0, d + b, 2 * PS)
    pool.register_full_pages(table_1, a + b + x, 3 * PS)  # B's hash is taken by the other chain
    assert pool.match_prefix(d + b + x + [0]) == table_0  # table_1[2] holds [A, B, X], not [D, B, X]
    assert pool.match_prefix(a + b + x + [0]) == table_1[:1]
    pool.check()
