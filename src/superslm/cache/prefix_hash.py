"""Content hashes of full KV pages, chained from the start of a sequence (as vLLM v1's block hashes),
and the index from hash to the page that holds that content.

A page's hash covers its parent page's hash, its token ids and an extra key (a cache salt, a LoRA
adapter id), so equal hashes at position k mean an equal prefix of k + 1 full pages. The hash is
sha256 over a canonical, length-prefixed byte encoding, never Python's ``hash()``, so it is the
same in every process and on every machine (it may be saved, logged, or compared across workers):

    b"superslm.kv-page.v1\\0"
    parent:    b"\\0"                          (first page)  |  b"\\1" + u64le(len) + parent
    extra_key: b"\\0" (None)  |  b"\\1" + u64le(len) + utf-8 (str)  |  b"\\2" + u64le(len) + bytes
    tokens:    u64le(count) + count * i64le

so ``"a"`` and ``b"a"`` are different extra keys, and ``None`` differs from ``""``.

The index never trusts a hash alone: a hash finds a candidate page, and its key (parent's content
identity, tokens, extra key) must equal the query's. By induction from the first page, a match holds
exactly the query's prefix; a collision (a different key under the same hash) only costs a miss.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

from superslm.errors import InvalidArgument

#: what may salt a page's hash: a cache salt, a LoRA adapter id, or nothing
ExtraKey = str | bytes | None

_DOMAIN = b"superslm.kv-page.v1\x00"


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def encode_page(parent: bytes | None, tokens: Sequence[int], extra_key: ExtraKey) -> bytes:
    """The canonical byte encoding that ``page_hash`` digests (see the module docstring)."""
    parts = [_DOMAIN]
    parts.append(b"\x00" if parent is None else b"\x01" + _field(bytes(parent)))
    if extra_key is None:
        parts.append(b"\x00")
    elif isinstance(extra_key, str):
        parts.append(b"\x01" + _field(extra_key.encode("utf-8")))
    elif isinstance(extra_key, bytes | bytearray):
        parts.append(b"\x02" + _field(bytes(extra_key)))
    else:
        raise InvalidArgument(f"extra_key must be str, bytes or None, not {type(extra_key).__name__}")
    n = len(tokens)
    parts.append(struct.pack(f"<Q{n}q", n, *tokens))
    return b"".join(parts)


def page_hash(parent: bytes | None, tokens: Sequence[int], extra_key: ExtraKey = None) -> bytes:
    """The 32-byte sha256 of one page: ``parent`` is the previous page's hash (None for the first)."""
    return hashlib.sha256(encode_page(parent, tokens, extra_key)).digest()


def page_hashes(tokens: Sequence[int], page_size: int, extra_key: ExtraKey = None) -> list[bytes]:
    """The hash chain of the full pages of ``tokens`` (a trailing partial page has no hash)."""
    if page_size < 1:
        raise InvalidArgument(f"page_size must be >= 1, got {page_size}")
    out: list[bytes] = []
    parent: bytes | None = None
    for k in range(len(tokens) // page_size):
        # looked up through the module so that a test's monkeypatched page_hash applies here too
        parent = page_hash(parent, tokens[k * page_size : (k + 1) * page_size], extra_key)
        out.append(parent)
    return out


#: the parent identity of a sequence's first page; content identities start at 1
_ROOT = 0


def _bug(message: str) -> AssertionError:
    return AssertionError(f"PagePool: {message}")


class PrefixIndex:
    """Which page holds which content: hash -> holder page, with keys that make every match exact.

    Each registered page gets a content identity (an int, never reused). The first page to register
    some content holds its hash and keeps its key (parent's identity, a copy of its tokens, the extra
    key); a later page with the same key is a duplicate: it shares the identity (so its children chain
    under it) and takes over the hash if the holder is evicted while it is still in use. A page whose
    hash is held by a different key (a collision) gets no identity: nothing below it is ever matched.

    Knows nothing of references: ``PagePool`` owns the pages and calls ``evict`` and ``forget``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.by_hash: dict[bytes, int] = {}
        # per page: content hash (holder or not), content identity, and for holders their key
        self.hash: list[bytes | None] = [None] * num_pages
        self.ident: list[int | None] = [None] * num_pages
        self.key: list[tuple[int, tuple[int, ...], ExtraKey] | None] = [None] * num_pages
        # identity -> its duplicates in use, oldest first (heirs of the holder)
        self.dups: dict[int, dict[int, None]] = {}
        self.next_ident = _ROOT + 1
        self.conflicts = 0

    def holds(self, page: int) -> bool:
        """Whether ``page`` is the page its hash maps to."""
        digest = self.hash[page]
        return digest is not None and self.by_hash.get(digest) == page

    def register(self, page: int, tokens: tuple[int, ...], parent: int | None, extra_key: ExtraKey) -> bool:
        """See ``PagePool.register``; ids and references are checked by the pool."""
        if len(tokens) != self.page_size:
            raise _bug(f"register of a page with {len(tokens)} tokens; only full pages ({self.page_size})")
        if parent is None:
            parent_hash, parent_ident = None, _ROOT
        else:
            parent_hash, parent_ident = self.hash[parent], self.ident[parent]
            if parent_hash is None:
                raise _bug(f"register of page {page} before its parent page {parent}")
        digest = page_hash(parent_hash, tokens, extra_key)
        if self.hash[page] is not None:
            if self.hash[page] != digest:
                raise _bug(f"page {page} registered again with different content")
            return self.holds(page)
        self.hash[page] = digest
        if parent_ident is None:
            return False
        key = (parent_ident, tokens, extra_key)
        holder = self.by_hash.get(digest)
        if holder is None:
            self.by_hash[digest], self.key[page], self.ident[page] = page, key, self.next_ident
            self.next_ident += 1
            return True
        if self.key[holder] == key:
            ident = self.ident[holder]
            self.ident[page] = ident
            self.dups.setdefault(ident, {})[page] = None  # type: ignore[arg-type]
        else:
            self.conflicts += 1
        return False

    def match(self, tokens: Sequence[int], extra_key: ExtraKey, max_pages: int) -> list[int]:
        """The holders of the longest verified run of full pages that starts ``tokens``."""
        ps = self.page_size
        pages: list[int] = []
        parent_hash: bytes | None = None
        parent_ident: int | None = _ROOT
        for k in range(max_pages):
            chunk = tuple(map(int, tokens[k * ps : (k + 1) * ps]))
            digest = page_hash(parent_hash, chunk, extra_key)
            page = self.by_hash.get(digest)
            if page is None:
                break
            if self.key[page] != (parent_ident, chunk, extra_key):
                self.conflicts += 1
                break
            pages.append(page)
            parent_hash, parent_ident = digest, self.ident[page]
        return pages

    def evict(self, page: int) -> None:
        """A holder is reused for other content: its oldest duplicate in use inherits the hash."""
        digest, ident = self.hash[page], self.ident[page]
        heirs = self.dups.get(ident)  # type: ignore[arg-type]
        if heirs:
            heir = next(iter(heirs))
            self._drop_dup(heir)
            self.by_hash[digest], self.key[heir] = heir, self.key[page]  # type: ignore[index]
        else:
            del self.by_hash[digest]  # type: ignore[arg-type]
        self.hash[page] = self.ident[page] = self.key[page] = None

    def forget(self, page: int) -> int | None:
        """A page that holds no hash goes free; returns the holder of the same content, if any."""
        digest, ident = self.hash[page], self.ident[page]
        if ident is not None:
            self._drop_dup(page)
        self.hash[page] = self.ident[page] = None
        return None if ident is None else self.by_hash[digest]  # type: ignore[index]

    def _drop_dup(self, page: int) -> None:
        heirs = self.dups[self.ident[page]]  # type: ignore[index]
        del heirs[page]
        if not heirs:
            del self.dups[self.ident[page]]  # type: ignore[arg-type]

    def clear(self) -> None:
        """Forget every hash."""
        self.by_hash.clear()
        self.dups.clear()
        for page in range(len(self.hash)):
            self.hash[page] = self.ident[page] = self.key[page] = None

    def check(self, free: set[int], cached: Iterable[int]) -> None:
        """Raise ``AssertionError`` on a broken invariant, given the pool's free and cached pages."""
        holder_idents: set[int] = set()
        for page, (digest, ident, key) in enumerate(zip(self.hash, self.ident, self.key, strict=True)):
            holder = self.holds(page)
            if page in free and (digest is not None or ident is not None or key is not None):
                raise _bug(f"free page {page} keeps a hash")
            if holder != (key is not None) or (digest is None and ident is not None):
                raise _bug(f"page {page}: holder {holder}, hash {digest!r}, identity {ident}, key {key!r}")
            if holder:
                if ident is None or not _ROOT < ident < self.next_ident or ident in holder_idents:
                    raise _bug(f"holder page {page} has a bad identity {ident}")
                if len(key[1]) != self.page_size:  # type: ignore[index]
                    raise _bug(f"holder page {page} keeps {len(key[1])} tokens")  # type: ignore[index]
                holder_idents.add(ident)
            elif ident is not None and page not in self.dups.get(ident, {}):
                raise _bug(f"duplicate page {page} is not listed under identity {ident}")
        for page in cached:
            if not self.holds(page):
                raise _bug(f"cached page {page} holds no hash")
        for digest, page in self.by_hash.items():
            if self.hash[page] != digest:
                raise _bug(f"hash map entry points at page {page}, which has another hash")
        for ident, heirs in self.dups.items():
            if ident not in holder_idents or any(self.ident[p] != ident or self.holds(p) for p in heirs):
                raise _bug(f"duplicates {list(heirs)} of identity {ident} without a holder")
