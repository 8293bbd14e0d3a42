"""Stop strings over streamed text: emit what is safe, hold back what could still start a stop.

Decoded text arrives in pieces (one per token, sometimes empty while a multi-byte character is
incomplete). A stop string can straddle pieces, so the checker holds back the longest tail of the
unemitted text that is a proper prefix of some stop string, and releases it once it cannot be one.

When several stop strings occur, the one that *ends* first wins (ties: the one that starts first).
That is the one a character-by-character stream would meet first, so the result does not depend on
how the text is cut into pieces: the concatenated output is always the text before that match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from superslm.errors import InvalidArgument


@dataclass(frozen=True)
class StopResult:
    """What one `StopChecker.push` lets through."""

    text: str
    """Text that is safe to emit now (never contains, nor ends inside, a stop string)."""
    stopped: bool = False
    """True once a stop string has completed: the request is finished."""
    stop: str | None = None
    """The stop string that matched (None unless stopped)."""


class StopChecker:
    """Incremental stop-string matcher for one sequence; state is plain data (`state()`).

    With no stop strings every piece passes straight through.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        """Args: stop: the stop strings (non-empty; duplicates are harmless)."""
        if isinstance(stop, str):
            stop = (stop,)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop[{i}]: stop strings must be non-empty strings, got {s!r}")
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # dedup, keep order
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._held = ""
        #: the tail of the text emitted so far (len(longest stop) - 1 characters): a stop string that ends in a
        #: later piece may start there when pieces passed unchecked (min_tokens)
        self._context = ""
        self._stopped = False
        self._match: str | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings."""
        return self._stop

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because it could be the start of a stop string."""
        return self._held

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched."""
        return self._stopped

    def push(self, piece: str, check: bool = True) -> StopResult:
        """Feed the next piece of decoded text; return what may be emitted now.

        `check=False` (vLLM's min_tokens: stop strings count from that token on): the piece passes whole and
        matches are not looked for, but a stop string that ends in a later, checked piece may start in it (the
        text already emitted stays emitted). After a stop every further push returns empty text, stopped=True.
        """
        if self._stopped:
            return StopResult("", True, self._match)
        if not self._stop:
            return StopResult(piece)
        if not check:
            text, self._held = self._held + piece, ""
            self._remember(text)
            return StopResult(text)
        ctx = self._context
        buf = ctx + self._held + piece
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stop:
            # the first occurrence ending past the emitted context (one inside it was not looked for)
            start = buf.find(s, max(0, len(ctx) - len(s) + 1))
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self._stopped, self._match, self._held, self._context = True, best[2], "", ""
            return StopResult(buf[len(ctx) : max(best[1], len(ctx))], True, best[2])
        keep = min(self._holdback(buf), len(buf) - len(ctx))  # what is emitted cannot be held back
        self._held = buf[len(buf) - keep :]
        out = buf[len(ctx) : len(buf) - keep]
        self._remember(out)
        return StopResult(out)

    def _remember(self, emitted: str) -> None:
        """Keep the last len(longest stop) - 1 characters emitted (where a later match could start)."""
        self._context = (self._context + emitted)[-(self._max_len - 1) :] if self._max_len > 1 else ""

    def flush(self) -> str:
        """The sequence ended for another reason (EOS, length): return and clear the held text."""
        if self._stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _holdback(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def state(self) -> dict[str, Any]:
        """Plain, JSON-ready data from which `from_state` rebuilds an identical checker."""
        return {"stop": list(self._stop), "held": self._held, "stopped": self._stopped, "match": self._match,
                "context": self._context}

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> StopChecker:
        """Rebuild from `state()` output (ValueError where a field has the wrong type)."""
        stop, held, stopped, match = data["stop"], data["held"], data["stopped"], data["match"]
        context = data.get("context", "")
        if not isinstance(stop, list) or not isinstance(held, str) or not isinstance(stopped, bool) \
                or not isinstance(context, str) or not (match is None or isinstance(match, str)):
            raise ValueError("malformed StopChecker state")
        checker = cls(stop)
        checker._held, checker._stopped, checker._match, checker._context = held, stopped, match, context
        return checker
