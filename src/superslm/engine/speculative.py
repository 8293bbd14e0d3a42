"""Speculative decoding: a cheap guess at a sequence's next tokens, verified by one step of the model.

A drafter proposes up to k tokens that may follow a sequence's tokens (`NgramDrafter.propose`, vLLM's `ngram`
prompt lookup). They become the sequence's `drafts` (vLLM's spec_token_ids), tokens of the request not verified
yet: the scheduler schedules them as more rows of its next decode step (its pages granted like any other token's),
the step computes the last token and the d drafts as 1 + d rows, and the output processor keeps the drafts its own
choices agree with, plus the token after the last one kept; the rest is rolled back (num_computed_tokens counts
only verified tokens and the scheduler takes back the pages past them).

Exactness: row j of a drafting sequence is sampled exactly as plain decoding would sample that position, its
sampler state as it will be once drafts[:j] are accepted (`SamplerState.ahead`: the random stream's position,
penalty counts) and its bans with them (min_tokens, bad words); draft j is kept when row j's choice equals it.
With the seeded Gumbel race of sampling/noise.py this is the standard rejection rule for a deterministic drafter
(q a point mass on d): the race picks d with probability p(d), and otherwise a token of p with d removed,
renormalized; and since its noise is a function of (seed, position), the tokens are the very tokens plain
decoding gives (bit-identical where the logits are: deterministic mode), not merely tokens of the same law.

Not drafted: rows with a grammar (their matcher would have to walk and roll back along the drafts), damped greedy
(its anti-LM state likewise), requests that opt out (`Request.speculative=False`), and a sequence's last token
(max_tokens). Models with delta-rule layers are refused (their recurrent state cannot roll back a rejected row).

Adaptive: each sequence keeps an acceptance estimate (a moving average of the fraction of its drafts kept); below
`threshold` it stops drafting for `pause` steps, doubling up to `max_pause` while probes keep failing, so prose
that the n-grams guess badly pays for few draft rows.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from superslm.errors import InvalidArgument

if TYPE_CHECKING:
    from superslm.engine.request import Sequence


@dataclass(frozen=True)
class Speculative:
    """How an engine drafts (`Engine(speculative=...)`; "ngram" is `Speculative()`).

    `k`: the most drafts a step carries per sequence (3: SmolLM2 rewriting code on 2 AVX2 cores decoded 131-139
    tok/s at 3, 124-127 at 2, 108 at 4, 84-92 without drafts; a CPU step's cost grows with its rows there);
    `min_n` .. `max_n`: the n-gram lengths the prompt lookup tries, longest first; `threshold`, `pause`,
    `max_pause`: the adaptive rule (see the module's docstring).
    """

    method: str = "ngram"
    k: int = 3
    min_n: int = 2
    max_n: int = 4
    threshold: float = 0.3
    pause: int = 8
    max_pause: int = 128

    @classmethod
    def of(cls, value: Any) -> Speculative | None:
        """The configuration an Engine argument names: None (no drafts), "ngram", or a Speculative."""
        if value is None:
            return None
        if value == "ngram":
            return cls()
        if isinstance(value, Speculative):
            return value.validate()
        raise InvalidArgument(f"speculative must be None, 'ngram' or a Speculative, got {value!r}")

    def validate(self) -> Speculative:
        if self.method != "ngram":
            raise InvalidArgument(f"unknown speculative method {self.method!r} (known: 'ngram')")
        for name in ("k", "min_n", "max_n", "pause", "max_pause"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"speculative {name} must be a positive integer, got {v!r}")
        if self.min_n > self.max_n:
            raise InvalidArgument(f"speculative min_n {self.min_n} is more than max_n {self.max_n}")
        if self.pause > self.max_pause:
            raise InvalidArgument(f"speculative pause {self.pause} is more than max_pause {self.max_pause}")
        if not 0.0 <= self.threshold <= 1.0:
            raise InvalidArgument(f"speculative threshold must be in [0, 1], got {self.threshold!r}")
        return self


class NgramDrafter:
    """Prompt lookup over one sequence's tokens (prompt and answer so far): the tokens that followed the most recent
    earlier occurrence of its last n tokens, n from `max_n` down to `min_n`.

    The index is incremental: each n-gram is entered once (the position just past its most recent occurrence), so
    a proposal costs the new tokens' n-grams and `max_n - min_n + 1` lookups, whatever the length. It relies on
    what the engine guarantees: a sequence's tokens only grow (drafts are never among them)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._after: dict[tuple[int, ...], int] = {}
        #: n-grams ending before this position are in the index
        self._indexed = 0

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens`; [] where no n-gram of its end occurred before."""
        last = len(tokens) - 1
        if k < 1 or last < self.min_n:
            return []
        after = self._after
        # the n-grams ending at the last token are looked up, not entered: an occurrence must be an earlier one
        for end in range(max(self._indexed, self.min_n - 1), last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                after[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            at = after.get(tuple(tokens[last + 1 - n :]))
            if at is not None:
                # past the end the copy goes on from its own start: a match `len - at` tokens back is a loop of that
                # period, whose next k tokens repeat it (the most recent occurrence of a loop is one period back)
                out = list(tokens[at : at + k])
                period = last + 1 - at
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []


@dataclass
class SpecState:
    """One sequence's drafting: its drafter, acceptance estimate, pause and counts."""

    drafter: NgramDrafter
    #: the moving average of the fraction of its drafts kept (optimistic at first)
    rate: float = 1.0
    #: steps left without drafts, and the pause the next failure takes
    wait: int = 0
    backoff: int = 0
    proposed: int = 0
    accepted: int = 0
    #: steps that carried drafts
    steps: int = 0


class Speculator:
    """An engine's drafting: proposes each decoding sequence's drafts after its step is accepted, learns from
    each verification (`record`), and keeps the engine's totals."""

    def __init__(self, config: Speculative) -> None:
        self.config = config
        self.proposed = 0
        self.accepted = 0
        self.steps = 0

    @staticmethod
    def drafts_for(seq: Sequence) -> bool:
        """Whether seq may carry drafts at all (see the module's docstring for why the others do not)."""
        return seq.request.speculative is not False and seq.grammar is None and seq.sampler.params.damped is None

    def propose(self, seq: Sequence) -> list[int]:
        """The drafts of seq's next decode step (at most k, never past its last token); [] while it pauses or
        its n-grams find nothing."""
        c = self.config
        room = min(c.k, seq.max_tokens - len(seq.output) - 1)  # the step's last row gives one more token
        if room < 1 or not self.drafts_for(seq):
            return []
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState(NgramDrafter(c.min_n, c.max_n), backoff=c.pause)
        if st.wait > 0:
            st.wait -= 1
            return []
        return st.drafter.propose(seq.tokens, room)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification: `accepted` of seq's `proposed` drafts were kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        st = seq.spec
        if st is None:
            return
        st.proposed += proposed
        st.accepted += accepted
        st.steps += 1
        c = self.config
        st.rate = 0.5 * st.rate + 0.5 * accepted / proposed
        if st.rate < c.threshold:
            # mostly rejected: stop for a while, then probe from the threshold (one good step resumes drafting)
            st.wait, st.backoff = st.backoff, min(2 * st.backoff, c.max_pause)
            st.rate = c.threshold
        elif accepted:
            st.backoff = c.pause

    def stats(self) -> dict[str, Any]:
        """The engine's totals: drafts proposed and accepted, the steps of sequences that carried drafts."""
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {"drafts_proposed": self.proposed, "drafts_accepted": self.accepted, "acceptance_rate": rate,
                "draft_steps": self.steps}
