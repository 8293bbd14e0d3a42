"""The KV page pool: which page holds what, who references it, and which full pages are cached.

K/V lives in ``num_pages`` pages of ``page_size`` token slots (the same page id in every layer). A
sequence owns a block_table (its page ids in order); token i of it sits in slot
``block_table[i // page_size] * page_size + i % page_size`` (its slot_mapping entry).

Every page is in exactly one state:

- free: in the free list, no reference, no hash;
- used: ``ref_count > 0`` (held by sequences, forks, prefix handles);
- cached: ``ref_count == 0`` but holding a registered content hash; evictable in LRU order.

Prefix caching (as vLLM v1): once a page is full and computed the engine registers it
(``register`` / ``register_full_pages``); when its sequence ends it stays cached until ``allocate``
needs it, and ``match_prefix`` hands it to a later prompt that starts with the same full pages.

Matches are exact whatever the hash does (``prefix_hash.PrefixIndex``): a hash collision can only
cost a miss, never return wrong pages. When two sequences compute the same page at once, the first
to register it holds its hash; the other is a duplicate that takes over if the holder is evicted
while it is still in use, and whose release refreshes the holder's place in the LRU.

Pinning (prefix handles) is a held reference: ``retain`` the pages, ``release`` them when the handle
is dropped; a page with a reference is never evicted.

Bookkeeping bugs (releasing a page with no reference, registering a page nobody holds, an unknown
page id) raise ``AssertionError`` explicitly (so they survive ``python -O``); they are engine bugs,
not caller errors. Bad sizes raise ``InvalidArgument``; an allocation that cannot fit raises
``KVCacheFull``. Not thread-safe: one engine loop owns a pool.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from superslm.cache import prefix_hash
from superslm.cache.prefix_hash import ExtraKey, PrefixIndex
from superslm.errors import InvalidArgument, KVCacheFull


class PageState(str, Enum):
    """The three states of a page (see the module docstring)."""

    FREE = "free"
    USED = "used"
    CACHED = "cached"


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a pool's occupancy (gauges) and its monotonic counters (for metrics)."""

    num_pages: int
    page_size: int
    num_free: int
    num_used: int
    num_cached: int
    #: calls to match_prefix
    prefix_queries: int
    #: tokens offered to match_prefix (len(tokens) summed over calls)
    prefix_query_tokens: int
    #: tokens covered by the pages match_prefix returned
    prefix_hit_tokens: int
    #: cached pages dropped by allocate to make room
    evictions: int
    #: hash lookups whose page had a different key (a collision, or a stale chain): counted as misses
    hash_conflicts: int

    @property
    def prefix_hit_rate(self) -> float:
        """prefix_hit_tokens / prefix_query_tokens (0.0 before any query)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def _bug(message: str) -> AssertionError:
    return AssertionError(f"PagePool: {message}")


class PagePool:
    """Reference-counted KV pages with an LRU prefix cache of full pages (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise InvalidArgument(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self._num_pages = num_pages
        self._page_size = page_size
        self._ref = [0] * num_pages
        # FIFO: pages come back in release order, and the lowest ids go out first on a fresh pool
        self._free: deque[int] = deque(range(num_pages))
        # ref 0 + registered; first = least recently used, evicted first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index = PrefixIndex(num_pages, page_size)
        self._prefix_queries = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._evictions = 0

    # --- sizes -----------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def page_size(self) -> int:
        """Token slots per page."""
        return self._page_size

    @property
    def num_free(self) -> int:
        """Pages in the free list."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages with no reference that hold a registered hash (evictable)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages with ``ref_count > 0``; num_free + num_cached + num_used == num_pages."""
        return self._num_pages - len(self._free) - len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out now: free + cached."""
        return len(self._free) + len(self._evictable)

    @property
    def num_registered(self) -> int:
        """Pages holding a registered hash, USED or CACHED."""
        return len(self._index.by_hash)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        return 0 <= n <= self.num_available

    # --- one page --------------------------------------------------------------------------------

    def ref_count(self, page: int) -> int:
        """How many holders reference ``page``."""
        return self._ref[self._check_id(page)]

    def page_state(self, page: int) -> PageState:
        """FREE, USED or CACHED."""
        page = self._check_id(page)
        if self._ref[page] > 0:
            return PageState.USED
        return PageState.CACHED if page in self._evictable else PageState.FREE

    def hash_of(self, page: int) -> bytes | None:
        """The content hash of ``page`` once registered (even when another page holds that hash)."""
        return self._index.hash[self._check_id(page)]

    def _check_id(self, page: int) -> int:
        # accepts numpy/torch integers too (block tables may live in arrays) and returns a plain int
        try:
            index = operator.index(page)
        except TypeError:
            index = -1
        if not 0 <= index < self._num_pages:
            raise _bug(f"page id {page!r} out of range [0, {self._num_pages})")
        return index

    # --- references ------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (ref_count 1 each), all or nothing.

        Free pages go first, then the least recently used cached pages, which lose their hash.
        Raises ``KVCacheFull``, leaving the pool unchanged, when fewer than ``n`` are available.
        """
        if n < 0:
            raise InvalidArgument(f"cannot allocate {n} pages")
        if n > self.num_available:
            raise KVCacheFull(
                f"need {n} KV pages, {self.num_available} available "
                f"({self.num_free} free + {self.num_cached} cached) of {self._num_pages}"
            )
        pages = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._evictable.popitem(last=False)
            self._index.evict(page)
            self._evictions += 1
            pages.append(page)
        for page in pages:
            self._ref[page] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add a reference to each page (a fork, a prefix handle's pin); each must be USED already.

        To take a reference on a CACHED page, match it with ``match_prefix``.
        """
        pages = [self._check_id(page) for page in pages]
        for page in pages:
            if self._ref[page] == 0:
                raise _bug(f"retain of page {page}, which has no reference")
        for page in pages:
            self._ref[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page (a page listed twice loses two); checked before any change.

        Pass a block_table in order: its pages enter the LRU tail first, so that, as in vLLM, a
        sequence's last pages are evicted before its first ones (which more prompts share). A page
        reaching 0 becomes CACHED when it holds a registered hash, else FREE.
        """
        pages = [self._check_id(page) for page in pages]
        for page, count in Counter(pages).items():
            if self._ref[page] < count:
                raise _bug(f"release of page {page} x{count} with ref_count {self._ref[page]}")
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if self._index.holds(page):
                    self._evictable[page] = None
                    continue
                self._free.append(page)
                holder = self._index.forget(page)
                if holder is not None and holder in self._evictable:
                    # a duplicate was just used: its holder is as recent (and stays older than its children)
                    self._evictable.move_to_end(holder)

    # --- prefix cache ----------------------------------------------------------------------------

    def page_hashes(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> list[bytes]:
        """The hash chain of the full pages of ``tokens`` (``prefix_hash.page_hashes``)."""
        return prefix_hash.page_hashes(tokens, self._page_size, extra_key)

    def register(
        self, page: int, tokens: Sequence[int], *, parent: int | None, extra_key: ExtraKey = None
    ) -> bool:
        """Register a full, computed, USED page as cacheable; returns whether it now holds its hash.

        ``tokens`` are the page's ``page_size`` token ids, ``parent`` the previous page of the same
        block_table (None for the first page), which must be registered already. The pool computes
        the page's hash from the parent's. When another page already holds that content, it is kept
        and this one is a duplicate (False): FREE once released, unless it inherits the content
        because the holder was evicted first. Registering a page again with the same content is a no-op.
        """
        page = self._check_id(page)
        if self._ref[page] == 0:
            raise _bug(f"register of page {page}, which has no reference")
        parent = None if parent is None else self._check_id(parent)
        return self._index.register(page, tuple(map(int, tokens)), parent, extra_key)

    def full_pages_registered(self, block_table: Sequence[int], num_computed_tokens: int) -> bool:
        """True when `register_full_pages` would register nothing: no full page, or the last full page holds
        its hash (registration goes in order, so every page before it does too). A decode step fills a page
        once in page_size tokens: this spares the other steps the call (and its extra key)."""
        num_full = num_computed_tokens // self._page_size
        if num_full == 0:
            return True
        if num_full > len(block_table):
            return False  # register_full_pages says why
        return self._index.hash[self._check_id(block_table[num_full - 1])] is not None

    def register_full_pages(
        self,
        block_table: Sequence[int],
        tokens: Sequence[int],
        num_computed_tokens: int,
        extra_key: ExtraKey = None,
    ) -> int:
        """Register every page of a sequence that is full and computed but not registered yet.

        Call after each step with the sequence's block_table, all its token ids and its
        num_computed_tokens; returns how many pages were registered by this call (holders or not).
        """
        num_full = num_computed_tokens // self._page_size
        if num_full > len(block_table) or num_computed_tokens > len(tokens):
            raise _bug(
                f"{num_computed_tokens} computed tokens but {len(tokens)} tokens, {len(block_table)} pages"
            )
        # registration goes in order, so registered pages are a prefix of the block_table
        start = num_full
        while start > 0 and self._index.hash[self._check_id(block_table[start - 1])] is None:
            start -= 1
        ps = self._page_size
        for k in range(start, num_full):
            parent = block_table[k - 1] if k > 0 else None
            self.register(block_table[k], tokens[k * ps : (k + 1) * ps], parent=parent, extra_key=extra_key)
        return num_full - start

    def match_prefix(
        self, tokens: Sequence[int], extra_key: ExtraKey = None, *, max_tokens: int | None = None
    ) -> list[int]:
        """The longest run of cached full pages that starts ``tokens``; takes a reference on each.

        Pass the whole prompt: the match covers at most ``max_tokens`` tokens, by default
        ``len(tokens) - 1``, so at least the last prompt token is left to compute (its logits start
        decoding). Use those pages as the head of the block_table, with num_computed_tokens =
        ``len(pages) * page_size``; ``release`` them like any other page. A CACHED page becomes USED
        again (leaving the LRU; it re-enters at the recent end when released).
        """
        if max_tokens is not None and max_tokens < 0:
            raise InvalidArgument(f"max_tokens must be >= 0, got {max_tokens}")
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        pages = self._index.match(tokens, extra_key, max(limit, 0) // self._page_size)
        for page in pages:
            if self._ref[page] == 0:
                del self._evictable[page]
            self._ref[page] += 1
        self._prefix_queries += 1
        self._prefix_query_tokens += len(tokens)
        self._prefix_hit_tokens += len(pages) * self._page_size
        return pages

    def clear_prefix_cache(self) -> int:
        """Forget every hash (after weights or an adapter changed); returns how many CACHED pages were freed.

        USED pages keep their references; ``register_full_pages`` registers them again.
        """
        freed = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._index.clear()
        return freed

    # --- metrics and checks ----------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Occupancy and counters now."""
        return CacheStats(
            num_pages=self._num_pages,
            page_size=self._page_size,
            num_free=self.num_free,
            num_used=self.num_used,
            num_cached=self.num_cached,
            prefix_queries=self._prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            evictions=self._evictions,
            hash_conflicts=self._index.conflicts,
        )

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests and debug builds)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise _bug("a page is twice in the free list")
        for page in range(self._num_pages):
            ref = self._ref[page]
            states = (page in free) + (page in self._evictable) + (ref > 0)
            if ref < 0 or states != 1:
                raise _bug(f"page {page} (ref {ref}) is in {states} states")
        self._index.check(free, self._evictable)

    def __repr__(self) -> str:
        used = f"{self.num_free} free, {self.num_used} used, {self.num_cached} cached"
        return f"PagePool({self._num_pages} pages x {self._page_size} tokens: {used})"
