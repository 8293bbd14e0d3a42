"""The KV page pool and its prefix cache, without a model: refs, LRU eviction, hash chains, invariants."""

from __future__ import annotations

import copy
import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest

from superslm.cache import PagePool, PageState, page_hash, page_hashes, prefix_hash
from superslm.errors import InvalidArgument, KVCacheFull, SuperSLMError

PS = 4


def snapshot(pool: PagePool) -> tuple:
    """Everything observable about a pool."""
    pages = [(pool.ref_count(p), pool.page_state(p), pool.hash_of(p)) for p in range(pool.num_pages)]
    return pages, pool.num_free, pool.num_used, pool.num_cached, pool.num_registered, pool.stats()


def computed_pool(num_pages: int, tokens: list[int], extra=None) -> tuple[PagePool, list[int]]:
    """A pool where one sequence has computed and registered ``tokens``."""
    pool = PagePool(num_pages, PS)
    table = pool.allocate(-(-len(tokens) // PS))
    pool.register_full_pages(table, tokens, len(tokens), extra)
    return pool, table


# --- references ----------------------------------------------------------------------------------


def test_allocate_release_retain_ref_counts() -> None:
    pool = PagePool(8, PS)
    assert pool.allocate(0) == []
    a = pool.allocate(3)
    assert len(set(a)) == 3 and all(pool.ref_count(p) == 1 for p in a)
    assert (pool.num_used, pool.num_free, pool.num_cached, pool.num_available) == (3, 5, 0, 5)
    pool.retain(a[:2])
    pool.retain([a[0]])
    assert [pool.ref_count(p) for p in a] == [3, 2, 1]
    pool.release(a)
    assert [pool.ref_count(p) for p in a] == [2, 1, 0]
    assert pool.page_state(a[2]) is PageState.FREE and pool.page_state(a[0]) is PageState.USED
    pool.release([a[0], a[0], a[1]])  # a page listed twice loses two references
    assert pool.num_used == 0 and pool.num_free == 8
    pool.check()


def test_bookkeeping_bugs_raise_and_change_nothing() -> None:
    pool, table = computed_pool(6, list(range(8)))
    free_page = next(p for p in range(6) if pool.page_state(p) is PageState.FREE)
    before = snapshot(pool)
    with pytest.raises(AssertionError):
        pool.release([free_page])
    with pytest.raises(AssertionError):
        pool.release([table[1], table[0], table[0]])  # table[0] has one reference: nothing is released
    with pytest.raises(AssertionError):
        pool.retain([table[0], free_page])
    with pytest.raises(AssertionError):
        pool.release([6])
    with pytest.raises(AssertionError):
        pool.register(free_page, [1, 2, 3, 4], parent=None)
    with pytest.raises(AssertionError):
        pool.register(table[0], [1, 2, 3], parent=None)  # not a full page
    with pytest.raises(InvalidArgument):
        pool.allocate(-1)
    assert snapshot(pool) == before
    with pytest.raises(InvalidArgument):
        PagePool(0, PS)


def test_allocate_is_all_or_nothing() -> None:
    pool, table = computed_pool(6, list(range(8)))
    pool.release(table)  # 2 cached pages, 4 free
    held = pool.allocate(3)
    twin = copy.deepcopy(pool)
    before = snapshot(pool)
    assert pool.num_available == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    with pytest.raises(KVCacheFull) as info:
        pool.allocate(4)
    assert isinstance(info.value, SuperSLMError)
    assert snapshot(pool) == before
    # the same pages, in the same order, come out of the pool and of an untouched copy
    assert pool.allocate(3) == twin.allocate(3)
    assert pool.num_available == 0 and pool.stats().evictions == 2
    pool.release(held)
    pool.check()


def test_allocate_takes_free_pages_before_cached_ones() -> None:
    pool, table = computed_pool(4, list(range(8)))
    pool.release(table)
    fresh = pool.allocate(2)
    assert not set(fresh) & set(table) and pool.num_cached == 2 and pool.stats().evictions == 0
    evicted = pool.allocate(1)
    assert evicted[0] in table and pool.num_registered == 1 and pool.stats().evictions == 1
    pool.check()


# --- LRU -----------------------------------------------------------------------------------------


def test_lru_evicts_oldest_sequence_first_and_its_tail_before_its_head() -> None:
    pool = PagePool(6, PS)
    seq_a, seq_b = list(range(12)), list(range(100, 112))
    table_a, table_b = pool.allocate(3), pool.allocate(3)
    pool.register_full_pages(table_a, seq_a, 12)
    pool.register_full_pages(table_b, seq_b, 12)
    pool.release(table_a)
    pool.release(table_b)
    assert pool.num_cached == 6
    first = pool.allocate(1)
    assert first == [table_a[2]]
    # the evicted tail page no longer matches: only A's first two pages do
    assert pool.match_prefix(seq_a + [0]) == table_a[:2]
    pool.release(table_a[:2])  # A's head is now more recent than B
    order = [pool.allocate(1)[0] for _ in range(5)]
    assert order == [table_b[2], table_b[1], table_b[0], table_a[1], table_a[0]]
    assert pool.stats().evictions == 6
    pool.check()


# --- hashes --------------------------------------------------------------------------------------


def test_page_hash_matches_its_documented_encoding() -> None:
    tokens, parent = [5, 0, 70000, 2**40], hashlib.sha256(b"parent").digest()

    def reference(parent: bytes | None, extra: bytes) -> bytes:
        head = b"\x00" if parent is None else b"\x01" + struct.pack("<Q", len(parent)) + parent
        body = struct.pack("<Q", 4) + b"".join(struct.pack("<q", t) for t in tokens)
        return hashlib.sha256(b"superslm.kv-page.v1\x00" + head + extra + body).digest()

    lora = "lora-é".encode()
    assert page_hash(None, tokens) == reference(None, b"\x00")
    assert page_hash(parent, tokens, "lora-é") == reference(parent, b"\x01" + struct.pack("<Q", 7) + lora)
    assert page_hash(parent, tokens, lora) == reference(parent, b"\x02" + struct.pack("<Q", 7) + lora)
    keys = [page_hash(p, tokens, e) for p in (None, b"") for e in (None, "", b"", "a", b"a")]
    assert len(set(keys)) == len(keys)


def test_page_hashes_are_a_chain_and_the_same_in_another_process() -> None:
    tokens = [random.Random(1).randrange(50000) for _ in range(4 * PS + 3)]
    chain = page_hashes(tokens, PS, "salt")
    assert len(chain) == 4
    parent = None
    for k, digest in enumerate(chain):
        parent = page_hash(parent, tokens[k * PS : (k + 1) * PS], "salt")
        assert digest == parent
    changed = list(tokens)
    changed[2 * PS + 1] += 1
    other = page_hashes(changed, PS, "salt")
    assert other[:2] == chain[:2] and all(x != y for x, y in zip(other[2:], chain[2:], strict=True))
    code = f"from superslm.cache import page_hashes as h; print([x.hex() for x in h({tokens}, {PS}, 'salt')])"
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str([h.hex() for h in chain])


# --- prefix matching -----------------------------------------------------------------------------


def test_match_prefix_same_tokens_and_extra_key_hit() -> None:
    prompt = list(range(3 * PS))
    pool, table = computed_pool(8, prompt, "lora-1")
    pool.release(table)
    # never the whole prompt: its last token is left to compute
    assert pool.match_prefix(prompt, "lora-1") == table[:2]
    assert pool.match_prefix(prompt + [99], "lora-1") == table
    assert pool.match_prefix(prompt, "lora-1", max_tokens=len(prompt)) == table
    assert pool.match_prefix(prompt, "lora-1", max_tokens=PS + 1) == table[:1]
    assert pool.match_prefix(prompt[: PS - 1] + [7], "lora-1") == []
    assert [pool.ref_count(p) for p in table] == [4, 3, 2]
    assert pool.num_cached == 0
    stats = pool.stats()
    assert stats.prefix_queries == 5
    assert stats.prefix_query_tokens == 4 * len(prompt) + 1 + PS
    assert stats.prefix_hit_tokens == (2 + 3 + 3 + 1) * PS
    assert stats.prefix_hit_rate == stats.prefix_hit_tokens / stats.prefix_query_tokens
    pool.check()


@pytest.mark.parametrize("other", [None, "lora-2", b"lora-1"])
def test_match_prefix_misses_with_another_extra_key(other) -> None:
    prompt = list(range(3 * PS))
    pool, table = computed_pool(8, prompt, "lora-1")
    assert pool.match_prefix(prompt + [1], other) == []
    assert pool.stats().prefix_hit_tokens == 0


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_changed_token_in_page_k_breaks_the_chain_from_k(k: int) -> None:
    prompt = [random.Random(k).randrange(1000) for _ in range(4 * PS)]
    pool, table = computed_pool(8, prompt)
    pool.release(table)
    changed = list(prompt)
    changed[k * PS + k % PS] += 1
    assert pool.match_prefix(changed + [0]) == table[:k]
    pool.check()


def test_duplicate_pages_keep_the_first_holder_and_still_chain_their_children() -> None:
    shared, tail_b = list(range(2 * PS)), [7] * PS
    pool = PagePool(8, PS)
    table_a, table_b = pool.allocate(2), pool.allocate(3)
    pool.register_full_pages(table_a, shared, 2 * PS)
    assert pool.register_full_pages(table_b, shared + tail_b, 3 * PS) == 3  # computed at the same time
    assert pool.num_registered == 3
    assert pool.match_prefix(shared + tail_b + [0]) == table_a + table_b[2:]
    pool.release(table_a + table_b[2:])
    pool.release(table_b)
    assert [pool.page_state(p) for p in table_b] == [PageState.FREE, PageState.FREE, PageState.CACHED]
    pool.check()


def test_an_evicted_holder_hands_its_content_to_a_duplicate_in_use() -> None:
    shared, tail = list(range(2 * PS)), [7] * PS
    pool = PagePool(6, PS)
    table_a, table_b = pool.allocate(2), pool.allocate(3)
    pool.register_full_pages(table_a, shared, 2 * PS)
    pool.register_full_pages(table_b, shared + tail, 3 * PS)
    pool.release(table_a)
    other = pool.allocate(3)  # 1 free page + A's 2 cached ones
    assert set(table_a) < set(other) and pool.stats().evictions == 2
    assert pool.match_prefix(shared + tail + [0]) == table_b  # B's pages hold the same content
    pool.release(table_b + table_b)
    assert pool.num_cached == 3
    pool.check()


def test_releasing_a_duplicate_refreshes_its_holder_in_the_lru() -> None:
    shared, tail = list(range(PS)), [7] * PS
    pool = PagePool(5, PS)
    table_a, table_b = pool.allocate(1), pool.allocate(2)
    pool.register_full_pages(table_a, shared, PS)
    pool.register_full_pages(table_b, shared + tail, 2 * PS)  # B's first page is a duplicate of A's
    pool.release(table_a)
    pool.release(table_b)
    assert pool.page_state(table_b[0]) is PageState.FREE
    pool.allocate(pool.num_free + 1)  # evicts B's tail, not A's page, which B used last
    assert pool.page_state(table_a[0]) is PageState.CACHED
    assert pool.match_prefix(shared + tail + [0]) == table_a
    pool.check()


def test_block_tables_and_tokens_may_be_numpy_arrays() -> None:
    np = pytest.importorskip("numpy")
    prompt = list(range(2 * PS))
    pool, table = computed_pool(4, prompt)
    twin = PagePool(4, PS)
    twin_table = twin.allocate(2)
    twin.register_full_pages(np.array(twin_table), np.array(prompt, dtype=np.int32), np.int64(2 * PS))
    assert [twin.hash_of(p) for p in twin_table] == [pool.hash_of(p) for p in table]
    pages = twin.match_prefix(np.array(prompt + [0]))
    assert pages == twin_table and all(type(p) is int for p in pages)
    twin.release(np.array(pages + twin_table))
    assert twin.num_cached == 2
    twin.check()


def test_full_pages_registered_says_when_registration_has_nothing_to_do() -> None:
    pool = PagePool(8, PS)
    table = pool.allocate(3)
    tokens = list(range(3 * PS))
    assert pool.full_pages_registered(table, PS - 1)  # no full page yet
    assert not pool.full_pages_registered(table, 2 * PS)
    assert pool.register_full_pages(table, tokens, 2 * PS) == 2
    assert pool.full_pages_registered(table, 2 * PS) and pool.full_pages_registered(table, 3 * PS - 1)
    assert not pool.full_pages_registered(table, 3 * PS)  # the third page just filled
    pool.clear_prefix_cache()
    assert not pool.full_pages_registered(table, 2 * PS)  # forgotten: registered again by the next call
    assert pool.register_full_pages(table, tokens, 2 * PS) == 2
    assert not pool.full_pages_registered(table[:1], 2 * PS)  # a table shorter than its tokens: the call says why


def test_clear_prefix_cache_forgets_every_hash() -> None:
    prompt = list(range(3 * PS))
    pool, table = computed_pool(8, prompt)
    pool.release(table[2:])
    assert pool.clear_prefix_cache() == 1
    assert pool.num_cached == 0 and pool.num_registered == 0 and pool.match_prefix(prompt + [0]) == []
    assert pool.register_full_pages(table[:2], prompt, 2 * PS) == 2  # the live pages register again
    pool.release(table[:2] + pool.match_prefix(prompt + [0]))
    assert pool.num_cached == 2
    pool.check()


def test_a_forced_hash_collision_never_returns_wrong_pages(monkeypatch) -> None:
    monkeypatch.setattr(prefix_hash, "page_hash", lambda parent, tokens, extra_key=None: b"\x00" * 32)
    a, b = [1] * PS, [2] * PS
    pool, table = computed_pool(8, a + b)  # the second page's hash is taken: it stays unregistered
    assert pool.num_registered == 1 and pool.stats().hash_conflicts == 1
    pool.release(table)
    assert pool.match_prefix(a + a + [0]) == table[:1]  # not [page 0, page 0]
    assert pool.match_prefix(b + [0]) == []
    assert pool.match_prefix(a + b + [0]) == table[:1]
    assert pool.match_prefix(a + [0], "other") == []
    pool.check()
