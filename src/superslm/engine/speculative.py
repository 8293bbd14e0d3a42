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

Adaptive: each sequence keeps an estimate p of the chance that a draft token is kept (a moving average over the
drafts verified: each kept draft a success, the first rejected one a failure). A step's cost is a fixed part plus
one part a row (`row_cost`: a row's share of a one-row step), and the step's decoding sequences together choose
their draft counts k_i to maximize the expected tokens of the step, the sum of (1 - p_i^(k_i+1)) / (1 - p_i), over
its cost: at batch 1 a draft row costs a quarter of the step, at batch 8 about what a sequence's own row costs, so
there a draft must be kept about as often as a plain row gives a token (`Speculative.draft_counts`); none where no
draft beats plain steps. While it does not draft, the lookup's first guess is checked against the token the
plain step gives (free: no row is computed for it), so the estimate follows the text back up where copying resumes
(an answer quoting its prompt again after a few words of its own), and prose that the n-grams guess badly drafts
little.
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

    `k`: the most drafts a step carries per sequence; `min_n` .. `max_n`: the n-gram lengths the prompt lookup tries,
    longest first; `row_cost`: one row's share of a one-row decode step, the rest being what a step costs
    whatever its rows (SmolLM2 on 2 AMD EPYC cores: 1 row 9 ms, 4 rows 15.5, 7 rows 22: ~2.2 ms a row over ~6.8
    fixed, 0.25; 0: rows are free); `decay`: the weight of the past in the acceptance
    estimate's moving average (see the module's docstring). A replay of SmolLM2's 256 greedy tokens rewriting a
    340-token function: 71 steps at these settings, 149 with a fixed k of 3 and pauses after misses.
    """

    method: str = "ngram"
    k: int = 8
    min_n: int = 2
    max_n: int = 4
    row_cost: float = 0.25
    decay: float = 0.8

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
        for name in ("k", "min_n", "max_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"speculative {name} must be a positive integer, got {v!r}")
        if self.min_n > self.max_n:
            raise InvalidArgument(f"speculative min_n {self.min_n} is more than max_n {self.max_n}")
        if not (isinstance(self.row_cost, (int, float)) and 0.0 <= self.row_cost):
            raise InvalidArgument(f"speculative row_cost must be a number >= 0, got {self.row_cost!r}")
        if not (isinstance(self.decay, (int, float)) and 0.0 <= self.decay < 1.0):
            raise InvalidArgument(f"speculative decay must be in [0, 1), got {self.decay!r}")
        return self

    def best_k(self, p: float, room: int) -> int:
        """The draft count (0 .. min(k, room)) of a sequence decoding alone at a per-draft acceptance chance p."""
        return self.draft_counts([p], [room])[0]

    def draft_counts(self, rates: Seq[float], rooms: Seq[int]) -> list[int]:
        """The draft counts k_i (0 .. min(k, rooms[i])) of one step's decoding sequences, at per-draft acceptance
        chances `rates`, that maximize the step's expected tokens per unit of its cost: sequence i gives
        (1 - p_i^(k_i+1)) / (1 - p_i) tokens, and the step costs fixed + (B + sum k_i) rows, where
        fixed = 1 / row_cost - 1 rows (a one-row step costs 1 / row_cost rows). Ties go to fewer drafts.

        Solved exactly by Dinkelbach's iteration: at a throughput lam, each sequence alone picks the k maximizing
        tokens(k) - lam * k; lam becomes the throughput of those picks, until it stops growing (a few rounds)."""
        ps = [min(max(float(p), 0.0), 0.99) for p in rates]  # p = 1 would always say k: near it the limit is k + 1
        caps = [max(0, min(self.k, r)) for r in rooms]
        # tokens[i][k]: expected tokens of sequence i's step with k drafts, 1 + p + ... + p^k
        tokens = [[(1 - p ** (k + 1)) / (1 - p) for k in range(cap + 1)] for p, cap in zip(ps, caps, strict=True)]
        counts = [0] * len(ps)
        if self.row_cost == 0:  # free rows: every draft that may be kept is worth its row
            return [cap if p > 0 else 0 for p, cap in zip(ps, caps, strict=True)]
        fixed = 1.0 / self.row_cost - 1.0
        lam = len(ps) / (fixed + len(ps))
        for _ in range(64):  # Dinkelbach converges in a few rounds; the bound is a guard against float cycling
            picks = []
            for t in tokens:
                best, best_k = t[0], 0
                for k in range(1, len(t)):
                    if t[k] - lam * k > best + 1e-12:
                        best, best_k = t[k] - lam * k, k
                picks.append(best_k)
            value = sum(t[k] for t, k in zip(tokens, picks, strict=True)) / (fixed + len(ps) + sum(picks))
            if value <= lam + 1e-12:
                break
            counts, lam = picks, value
        return counts


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
    """One sequence's drafting: its drafter, acceptance estimate, the guess checked at its next step, and counts."""

    drafter: NgramDrafter
    #: the moving average of draft tokens kept (optimistic at first: a copy drafts fully from its first step)
    rate: float = 1.0
    #: a step without drafts: the lookup's first guess and the position of the token it guessed
    guess: int = -1
    guess_at: int = -1
    proposed: int = 0
    accepted: int = 0
    #: steps that carried drafts
    steps: int = 0

    def learn(self, kept: bool, decay: float) -> None:
        self.rate = decay * self.rate + (1.0 - decay) * kept


class Speculator:
    """An engine's drafting: proposes each decoding sequence's drafts after its step is accepted, learns from
    each verification (`record`) and each free check of a guess it did not draft, and keeps the engine's totals."""

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
        """The drafts of seq's next decode step when it decodes alone (see `propose_all`)."""
        return self.propose_all([seq])[0]

    def propose_all(self, seqs: Seq[Sequence]) -> list[list[int]]:
        """The drafts of each of the next decode step's sequences (at most k each, never past a sequence's last
        token), their counts chosen together (`Speculative.draft_counts`): [] where the acceptance estimates say
        plain rows give more for their cost, or the n-grams find nothing."""
        c = self.config
        guesses: list[list[int]] = []
        rates: list[float] = []
        for seq in seqs:
            room = min(c.k, seq.max_tokens - len(seq.output) - 1)  # the step's last row gives one more token
            if room < 1 or not self.drafts_for(seq):
                guesses.append([])
                rates.append(0.0)
                continue
            st = seq.spec
            if st is None:
                st = seq.spec = SpecState(NgramDrafter(c.min_n, c.max_n))
            tokens = seq.tokens
            if 0 <= st.guess_at < len(tokens):  # the plain step since the last proposal: was the guess right?
                st.learn(tokens[st.guess_at] == st.guess, c.decay)
            st.guess_at = -1
            guesses.append(st.drafter.propose(tokens, room))
            rates.append(st.rate)
        counts = c.draft_counts(rates, [len(g) for g in guesses])
        for seq, g, k in zip(seqs, guesses, counts, strict=True):
            if g and not k:
                seq.spec.guess, seq.spec.guess_at = g[0], len(seq.tokens)
        return [g[:k] for g, k in zip(guesses, counts, strict=True)]

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
        # each kept draft a success; the first rejected one a failure (the ones after it were never tried)
        for _ in range(accepted):
            st.learn(True, self.config.decay)
        if accepted < proposed:
            st.learn(False, self.config.decay)

    def stats(self) -> dict[str, Any]:
        """The engine's totals: drafts proposed and accepted, the steps of sequences that carried drafts."""
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {"drafts_proposed": self.proposed, "drafts_accepted": self.accepted, "acceptance_rate": rate,
                "draft_steps": self.steps}
