"""Streaming detokenizer: token ids in, new text out, one token at a time.

The approach of vLLM's incremental detokenizer: decode a small window of recent tokens twice, once
up to the last token already turned into text (the prefix) and once up to the newest token, and
emit the difference. The prefix gives the decoder its context, so a SentencePiece leading space is
not stripped and a UTF-8 character split over tokens is not broken; text that still ends in U+FFFD
(an unfinished character) is held back until the next token completes it. A run of SentencePiece
byte-fallback tokens is held back whole until a non-byte token closes it, since the decoder turns
the whole run into U+FFFD when any byte of it is invalid.
"""

from __future__ import annotations

import operator
from typing import Any

from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Past this many held-back tokens we emit all but the last few: a UTF-8 character is at most
# 4 bytes, so only the newest tokens can still change, and push stays O(window).
_MAX_PENDING = 16
_KEEP = 4


class StreamDecoder:
    """Turns a stream of token ids into text deltas.

    Invariant: `"".join(push(t) for t in ids) + flush() == tokenizer.decode(ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # window[:read] is already emitted (window[:prefix] only kept as decoding context)
        self._window: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:  # the usual context: the one token emitted last
            return self.tokenizer.piece(ids[0])
        return self.tokenizer.backend.decode(ids, skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        tok = self.tokenizer
        try:
            token_id = operator.index(token_id)
        except TypeError as e:
            raise InvalidArgument(f"token id must be an integer, not {type(token_id).__name__}") from e
        if not 0 <= token_id < tok.vocab_size:
            raise TokenOutOfRange(f"token id {token_id} is outside the vocabulary (size {tok.vocab_size})")
        # Decoding skips special tokens before the decoder runs, so dropping them here is exact.
        if self.skip_special_tokens and token_id in tok.special_ids:
            return ""
        self._window.append(token_id)
        if token_id in tok.byte_fallback_ids:
            # A run of byte-fallback tokens decodes as a whole: one invalid byte turns every byte
            # of the run into U+FFFD. So nothing of the run is final until a non-byte token ends it.
            return ""
        prefix_text = self._decode(self._window[self._prefix : self._read])
        new_text = self._decode(self._window[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._advance(new_text[len(prefix_text) :], len(self._window))
        pending = len(self._window) - self._read
        if pending > _MAX_PENDING:
            cut = len(self._window) - _KEEP
            head = self._decode(self._window[self._prefix : cut])
            if new_text.startswith(head) and len(head) >= len(prefix_text):
                return self._advance(head[len(prefix_text) :], cut)
        return ""

    def _advance(self, delta: str, read: int) -> str:
        """Mark window[:read] emitted and drop what is no longer needed as context."""
        self._prefix, self._read = self._read, read
        if self._prefix:
            del self._window[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character comes out as U+FFFD)."""
        if self._read == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix : self._read])
        new_text = self._decode(self._window[self._prefix :])
        return self._advance(new_text[len(prefix_text) :], len(self._window))

    def state(self) -> dict[str, Any]:
        """A plain, JSON-able snapshot; `StreamDecoder.from_state` resumes from it."""
        return {
            "window": list(self._window),
            "prefix": self._prefix,
            "read": self._read,
            "skip_special_tokens": self.skip_special_tokens,
        }

    @classmethod
    def from_state(cls, tokenizer: Tokenizer, state: dict[str, Any]) -> StreamDecoder:
        """Resume a decoder saved with `state()`."""
        try:
            window = [int(i) for i in state["window"]]
            prefix, read = int(state["prefix"]), int(state["read"])
            skip = bool(state["skip_special_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"malformed StreamDecoder state: {e}") from e
        if not 0 <= prefix <= read <= len(window):
            raise InvalidArgument("malformed StreamDecoder state: offsets out of order")
        tokenizer.decode(window)  # checks the ids against this vocabulary
        out = cls(tokenizer, skip_special_tokens=skip)
        out._window, out._prefix, out._read = window, prefix, read
        return out
