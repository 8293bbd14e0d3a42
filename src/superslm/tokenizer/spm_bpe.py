"""Gemma's SentencePiece BPE in plain Python, over a GGUF vocabulary kept in ~8 MB.

`tokenizers` holds Gemma 3's 262k pieces in two hash maps of Rust strings plus 515k merges: ~96 MB
resident, and reading its tokenizer.json peaks ~350 MB higher. This backend keeps the pieces in one
UTF-8 blob with their offsets and an open-addressing table of ids (2 slots a piece), and derives each
merge from the vocabulary as the GGUF build does (`gguf_vocab._spm_merges`): pieces a and b merge
when a + b is a piece, ranked by that piece's id, then by the longer left part. It tokenizes exactly
as the `tokenizers` backend built from the same metadata (tests hold them equal), with the subset of
its API that `Tokenizer` uses.

The text between added tokens is one BPE word, as in `tokenizers` (Gemma has no pre-tokenizer);
it is cut before a "▁" wherever no piece can span the cut (checked against the vocabulary at build),
so words can be cached and the heap stays short.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable, Sequence
from heapq import heapify, heappop, heappush
from typing import NamedTuple

import numpy as np

from superslm.errors import InvalidArgument, TokenizerError

_SPACE = "\u2581"
_SPACE_BYTES = _SPACE.encode("utf-8")
#: distinct words kept tokenized (the cache is dropped whole when full), up to _CACHE_CHARS characters each:
#: text without spaces (CJK) is one long word
_CACHE_WORDS = 16384
_CACHE_CHARS = 256


class AddedToken(NamedTuple):
    """An added token as `tokenizers` reports it (`get_added_tokens_decoder`)."""

    content: str
    special: bool


class Encoding(NamedTuple):
    ids: list[int]


#: what Rust's u8::from_str_radix(_, 16) accepts in the two bytes the ByteFallback decoder reads
_HEX_BYTE = re.compile(rb"\+[0-9A-Fa-f]|[0-9A-Fa-f]{2}")


def _byte_value(piece: str) -> int | None:
    """The byte of a "<0xNN>" piece, tested as the ByteFallback decoder does (6 bytes long), else None."""
    b = piece.encode("utf-8")
    if len(b) == 6 and b.startswith(b"<0x") and b.endswith(b">") and _HEX_BYTE.fullmatch(b[3:5]):
        return int(b[3:5], 16)
    return None


class SentencePieceBPE:
    """Text <-> ids for a Gemma SentencePiece vocabulary (spaces as "▁", byte fallback, no prefix space).

    `pieces`: every token's spelling by id (space-only tokens already spelled with "▁");
    `special`: ids matched whole in text and dropped by skip_special_tokens; `user`: ids matched
    whole in text and kept; `bos`/`eos`: what `add_special_tokens` adds (None: nothing).
    """

    def __init__(self, pieces: Iterable[str], special: Iterable[int], user: Iterable[int],
                 unk_id: int | None = None, bos: int | None = None, eos: int | None = None) -> None:
        blob = bytearray()
        offsets = array("I", [0])
        crossing: set[str] = set()  # chars c with c + "▁" inside some piece: a cut after c is unsafe
        for p in pieces:
            blob += p.encode("utf-8")
            offsets.append(len(blob))
            j = p.find(_SPACE, 1)
            while j > 0:
                if p[j - 1] != _SPACE:
                    crossing.add(p[j - 1])
                j = p.find(_SPACE, j + 1)
        self._blob = bytes(blob)
        self._off = offsets
        self._n = n = len(offsets) - 1
        if n == 0:
            raise TokenizerError("empty SentencePiece vocabulary")
        self._mask, self._table = self._hash_table()
        self.unk_id = unk_id
        self.bos, self.eos = bos, eos
        self._special = frozenset(special)
        added = {i: self.id_to_token(i) for i in (*self._special, *user)}
        self._added_ids = {t: i for i, t in sorted(added.items(), reverse=True)}  # lowest id wins
        self._added = {i: AddedToken(t, i in self._special) for i, t in added.items()}
        by_first: dict[str, set[int]] = {}
        for t in self._added_ids:
            if t:
                by_first.setdefault(t[0], set()).add(len(t))
        self._added_lengths = {c: sorted(ls, reverse=True) for c, ls in by_first.items()}
        self._added_start = re.compile("[" + "".join(re.escape(c) for c in by_first) + "]") if by_first else None
        self._byte_ids = [self._lookup(f"<0x{b:02X}>".encode()) for b in range(256)]
        self._crossing = frozenset(crossing)
        self._can_cut = self._lookup(_SPACE_BYTES) >= 0  # else "▁" is spelled by byte pieces: never cut
        self._cache: dict[str, list[int]] = {}

    # --- the vocabulary as a hash table ---------------------------------------------------------

    def _hash_table(self) -> tuple[int, array]:
        """Open addressing with linear probing at load <= 1/2: id by hash(piece) (built in this process,
        so Python's randomized bytes hash is fine)."""
        blob, off, n = self._blob, self._off, self._n
        hashes = np.fromiter((hash(blob[off[i] : off[i + 1]]) for i in range(n)), dtype=np.int64, count=n)
        size = 1 << max(4, (2 * n - 1).bit_length())
        mask = size - 1
        table = np.full(size, -1, dtype=np.int32)
        slot = hashes & mask
        pending = np.arange(n)
        while pending.size:
            # each free slot takes its lowest pending id; the others probe on
            s = slot[pending]
            free = table[s] < 0
            cand, cs = pending[free], s[free]
            taken_slots, first = np.unique(cs, return_index=True)
            table[taken_slots] = cand[first]
            placed = np.zeros(n, dtype=bool)
            placed[cand[first]] = True
            pending = pending[~placed[pending]]
            slot[pending] = (slot[pending] + 1) & mask
        return mask, array("i", table.tobytes())

    def _lookup(self, piece: bytes) -> int:
        """The id of `piece` (UTF-8), or -1."""
        table, blob, off, mask = self._table, self._blob, self._off, self._mask
        i = hash(piece) & mask
        size = len(piece)
        while True:
            t = table[i]
            if t < 0:
                return -1
            start = off[t]
            if off[t + 1] - start == size and blob[start : start + size] == piece:
                return t
            i = (i + 1) & mask

    def _piece(self, i: int) -> bytes:
        return self._blob[self._off[i] : self._off[i + 1]]

    # --- the API `Tokenizer` uses (a subset of tokenizers.Tokenizer's) --------------------------

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._n

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._added)

    def id_to_token(self, i: int) -> str | None:
        return self._piece(i).decode("utf-8") if 0 <= i < self._n else None

    def token_to_id(self, token: str) -> int | None:
        i = self._added_ids.get(token)
        if i is not None:
            return i
        i = self._lookup(token.encode("utf-8"))
        return i if i >= 0 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"text is not valid Unicode: {e.reason} at {e.start}") from None
        ids: list[int] = []
        if add_special_tokens and self.bos is not None:
            ids.append(self.bos)
        for part, added in self._split_added(text):
            if added is not None:
                ids.append(added)
            else:
                for word in self._words(part.replace(" ", _SPACE)):
                    ids += self._bpe(word)
        if add_special_tokens and self.eos is not None:
            ids.append(self.eos)
        return Encoding(ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[Encoding]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """As the Replace("▁", " "), ByteFallback, Fuse decoders do: runs of <0xNN> tokens become their
        UTF-8 text, or one U+FFFD per byte when they are not valid UTF-8."""
        out: list[str] = []
        run = bytearray()
        n_run = 0
        for i in ids:
            if skip_special_tokens and i in self._special:
                continue
            text = self._piece(i).decode("utf-8").replace(_SPACE, " ")
            b = _byte_value(text)
            if b is not None:
                run.append(b)
                n_run += 1
                continue
            if n_run:
                out.append(_fuse_bytes(run))
                run.clear()
                n_run = 0
            out.append(text)
        if n_run:
            out.append(_fuse_bytes(run))
        return "".join(out)

    # --- encoding -------------------------------------------------------------------------------

    def _split_added(self, text: str) -> list[tuple[str, int | None]]:
        """Text around the added tokens it contains, leftmost-longest (as `tokenizers` matches them)."""
        if self._added_start is None:
            return [(text, None)] if text else []
        out: list[tuple[str, int | None]] = []
        done = 0
        ids, lengths = self._added_ids, self._added_lengths
        for m in self._added_start.finditer(text):
            p = m.start()
            if p < done:
                continue
            for n in lengths[text[p]]:
                i = ids.get(text[p : p + n])
                if i is not None:
                    if p > done:
                        out.append((text[done:p], None))
                    out.append(("", i))
                    done = p + n
                    break
        if done < len(text):
            out.append((text[done:], None))
        return out

    def _words(self, text: str) -> list[str]:
        """`text` cut before each "▁" that follows a char no piece joins to a "▁" (merges cannot span it)."""
        if not self._can_cut:
            return [text] if text else []
        words: list[str] = []
        start = 0
        j = text.find(_SPACE, 1)
        while j > 0:
            c = text[j - 1]
            # a char outside the vocabulary is spelled by other pieces (<0xNN>, unknown): never cut after it
            if c != _SPACE and c not in self._crossing and self._lookup(c.encode("utf-8")) >= 0:
                words.append(text[start:j])
                start = j
            j = text.find(_SPACE, j + 1)
        words.append(text[start:])
        return [w for w in words if w]

    def _symbols(self, word: str) -> tuple[list[int], list[bytes]]:
        """The word's first symbols, as the `tokenizers` BPE makes them: a char's piece, else its <0xNN>
        pieces, else one unknown token for a run of such chars (fuse_unk), held back until the next char
        in the vocabulary (byte pieces come out before it); without an unknown token the char is dropped."""
        ids: list[int] = []
        pieces: list[bytes] = []
        unk = False
        for ch in word:
            b = ch.encode("utf-8")
            t = self._lookup(b)
            if t >= 0:
                if unk:
                    ids.append(self.unk_id)  # type: ignore[arg-type]
                    pieces.append(self._piece(self.unk_id))  # type: ignore[arg-type]
                    unk = False
                ids.append(t)
                pieces.append(b)
                continue
            byte_ids = [self._byte_ids[x] for x in b]
            if min(byte_ids) >= 0:
                ids += byte_ids
                pieces += [self._piece(x) for x in byte_ids]
            elif self.unk_id is not None:
                unk = True
        if unk:
            ids.append(self.unk_id)  # type: ignore[arg-type]
            pieces.append(self._piece(self.unk_id))  # type: ignore[arg-type]
        return ids, pieces

    def _merge(self, left: bytes, right: bytes) -> tuple[int, int] | None:
        """(rank, merged id) of the pair, or None: ranked by the merged piece's id, then longer left."""
        t = self._lookup(left + right)
        return None if t < 0 else ((t << 8) | (255 - min(len(left), 255)), t)

    def _bpe(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids, pieces = self._symbols(word)
        n = len(ids)
        if n == 0:  # every char dropped (no unknown token)
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for p in range(n - 1):
            m = self._merge(pieces[p], pieces[p + 1])
            if m is not None:
                heap.append((m[0], p, m[1]))
        heapify(heap)
        # the `tokenizers` BPE loop: lowest rank first, then leftmost; a stale entry is one whose
        # pair no longer merges into the same id
        while heap:
            _, p, new = heappop(heap)
            q = nxt[p]
            if not alive[p] or q < 0:
                continue
            m = self._merge(pieces[p], pieces[q])
            if m is None or m[1] != new:
                continue
            pieces[p] += pieces[q]
            ids[p] = new
            alive[q] = False
            r = nxt[q]
            nxt[p] = r
            if r >= 0:
                prv[r] = p
                m = self._merge(pieces[p], pieces[r])
                if m is not None:
                    heappush(heap, (m[0], p, m[1]))
            o = prv[p]
            if o >= 0:
                m = self._merge(pieces[o], pieces[p])
                if m is not None:
                    heappush(heap, (m[0], o, m[1]))
        out = [ids[i] for i in range(n) if alive[i]]
        if len(word) <= _CACHE_CHARS:
            if len(self._cache) >= _CACHE_WORDS:
                self._cache.clear()
            self._cache[word] = out
        return out


def _fuse_bytes(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
