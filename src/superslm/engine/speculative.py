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

A sequence with a grammar drafts the lookup's guess as far as its grammar allows it, else the bytes the grammar
forces from here as the tokenizer writes them (`GrammarState.forced_draft`: where the grammar forces text but leaves
its spelling in tokens open, jump-forward cannot take it, a draft can); each draft row is masked as the grammar
will stand once the drafts before it are accepted, and jump-forward runs after the step's last kept token only (the
draft rows before it sample what the grammar forces: their masks allow it alone).

Not drafted: damped greedy (its anti-LM state would have to walk and roll back along the drafts), requests that
opt out (`Request.speculative=False`), and a sequence's last token (max_tokens).

Delta-rule layers (Qwen3.5, Qwen3-Next) keep a recurrent state per sequence, which every row advances, the rejected
ones too. So a drafting sequence's rows go through the recurrent step one at a time, as plain decoding steps them
(the same arithmetic, so deterministic mode stays bit-identical), and the states after each row but the last are
kept in scratch rows of the recurrent states (`RecurrentStates.scratch_rows`, laid out by `runner.build_step` as
`AttnMetadata.state_drafts`); verification names the last kept row, and the scheduler's rollback copies the states
after it back into the sequence's row. The scheduler schedules no more drafts a step than there are scratch rows,
and prefix-cache checkpoints are taken after verification, from the sequence's row or the scratch row of a kept
row that ends a page: only verified states are ever checkpointed.

Adaptive: each sequence keeps an estimate p of the chance that a draft token is kept (a moving average over the
drafts verified: each kept draft a success, the first rejected one a failure). The step's decoding sequences choose
their draft counts together, for the most expected tokens per unit of the step's cost (`Speculative.draft_counts`):
a one-row step costs 1, more rows cost what the kernels they run on make them cost (`Speculative.step_cost`: on the
VNNI kernels a fixed part plus a part a row in tiles of 4, measured on SmolLM2: 1 row 7.1 ms, 4 rows 13, 8 rows 20, 12
rows 28, 16 rows 35; on AVX2 without VNNI a curve measured the same way, `AVX2_COSTS`: a row ~0.33 of a one-row
step at any batch, dearer past 63 rows, where the prompt GEMMs take the step). So at
batch 1 three drafts cost less than two more plain steps, and at batch 8 a draft must be kept about as often as a
plain row gives a token; none where no draft beats plain steps. While it does not draft, the lookup's first guess is
checked against the token the plain step gives (free: no row is computed for it), so the estimate follows the text
back up where copying resumes (an answer quoting its prompt again after a few words of its own), and prose that the
n-grams guess badly drafts little.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from superslm import cext
from superslm.errors import InvalidArgument

if TYPE_CHECKING:
    from superslm.engine.request import Sequence
    from superslm.engine.runner import StepWork

#: the most tokens the MTP block drafts a step: its first draft, then its own output fed back twice
MTP_DEPTH = 3
#: (fixed_cost, row_cost, row_tile) of a step on the VNNI kernels (see Speculative's docstring)
VNNI_PRICES = (0.85, 0.25, 4)
#: a step's cost by rows, in one-row steps, where multi-row steps run the AVX2 row kernels (kernels/cpu/avx2_rows.cpp:
#: 2-63 rows, the weights unpacked once and multiplied against each row: ~0.33 of a one-row step a row) and from 64
#: rows the prompt GEMMs (kernels/cpu_prompt.py: dearer than 63 rows here); SmolLM2-135M Q4_1 on an AMD EPYC with
#: AVX2 and no VNNI, steps of 1 + d and 8 + d rows timed in one process (benchmarks/spec_rows.py)
AVX2_COSTS: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.42), (4, 2.1), (8, 3.7), (16, 6.2), (32, 11.5), (63, 22.0),
                                             (64, 30.0), (72, 33.0))
#: the acceptance estimate a sequence starts from under AVX2_COSTS: at 1 every sequence of a batch drafts fully at its
#: first match, which on prose is mostly rejected (benchmarks/speculative.py's story at batch 8: 0.96x of plain steps'
#: cost by the curve, 0.999x at 0.75; its rewrite 2.07x -> 2.12x at batch 1, 1.15x at batch 8 either way)
AVX2_PRIOR = 0.75


@dataclass(frozen=True)
class Speculative:
    """How an engine drafts (`Engine(speculative=...)`; "ngram" is `Speculative()`, "mtp" is
    `Speculative(method="mtp", k=MTP_DEPTH)`: the model's own MTP block drafts, engine/mtp_drafter.py).

    `k`: the most drafts a step carries per sequence; `min_n` .. `max_n`: the n-gram lengths the prompt lookup
    tries, longest first. A step's price by its rows, in one-row steps (`step_cost`), is one of:
    - `costs`: a curve of (rows, cost) points, straight between them and past the last along its last segment;
    - `fixed_cost`, `row_cost`, `row_tile`: a step of more than one row costs fixed_cost + row_cost * (its rows
      rounded up to a multiple of row_tile), at least 1 (row_cost 0: rows are free, as on a GPU far from its
      compute bound). Fields left None take `VNNI_PRICES` (SmolLM2 Q4_1 on 2 AMD EPYC cores with AVX-512 VNNI, its
      steps timed by rows: 1 row 7.1 ms, 4 rows 13.0, 8 rows 19.4-20.6, 12 rows 29, 16 rows 34-36; Gemma-3 270M's
      per-row part is smaller, ~0.15, so these prices draft less than would pay there, never more);
    - neither given (the default): the engine prices steps by the kernels its multi-row steps run on
      (`for_device`): `AVX2_COSTS` on CPUs with AVX2 but no VNNI, `VNNI_PRICES` elsewhere.
    `decay`: the weight of the past in the acceptance estimate's moving average (see the module's docstring);
    `prior`: the estimate a sequence starts from (None: 1, a copy drafting fully from its first lookup that finds a
    match, or `AVX2_PRIOR` where `for_device` prices rows by `AVX2_COSTS`);
    `draft_cost`: what computing one draft token costs, in one-row steps (the MTP's layer and the head: 0 for the
    n-gram lookup; None: the engine's estimate from the model's weights, `mtp_drafter.draft_cost`). "mtp" drafts
    at most `MTP_DEPTH` tokens a step (k).
    """

    method: str = "ngram"
    k: int = 8
    min_n: int = 2
    max_n: int = 4
    fixed_cost: float | None = None
    row_cost: float | None = None
    row_tile: int | None = None
    decay: float = 0.8
    prior: float | None = None
    draft_cost: float | None = None
    costs: tuple[tuple[int, float], ...] | None = None

    @classmethod
    def of(cls, value: Any) -> Speculative | None:
        """The configuration an Engine argument names: None (no drafts), "ngram", "mtp", a mapping of a
        Speculative's fields ({"method": "mtp", "k": 2}; vLLM's "num_speculative_tokens" is read as k), or a
        Speculative."""
        if value is None:
            return None
        if value == "ngram":
            return cls()
        if value == "mtp":
            return cls(method="mtp", k=MTP_DEPTH)
        if isinstance(value, dict):
            fields = dict(value)
            if "num_speculative_tokens" in fields:
                fields["k"] = fields.pop("num_speculative_tokens")
            if fields.get("method") == "mtp":
                fields.setdefault("k", MTP_DEPTH)
            if isinstance(fields.get("costs"), list):  # JSON's pairs
                fields["costs"] = tuple(tuple(p) if isinstance(p, list) else p for p in fields["costs"])
            try:
                return cls(**fields).validate()
            except TypeError as e:
                raise InvalidArgument(f"speculative {value!r}: {e}") from e
        if isinstance(value, Speculative):
            return value.validate()
        raise InvalidArgument(f"speculative must be None, 'ngram', 'mtp', a mapping or a Speculative, got {value!r}")

    def validate(self) -> Speculative:
        if self.method not in ("ngram", "mtp"):
            raise InvalidArgument(f"unknown speculative method {self.method!r} (known: 'ngram', 'mtp')")
        for name in ("k", "min_n", "max_n", "row_tile"):
            v = getattr(self, name)
            if name == "row_tile" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"speculative {name} must be a positive integer, got {v!r}")
        if self.min_n > self.max_n:
            raise InvalidArgument(f"speculative min_n {self.min_n} is more than max_n {self.max_n}")
        for name in ("fixed_cost", "row_cost"):
            v = getattr(self, name)
            if v is not None and not _finite(v):
                raise InvalidArgument(f"speculative {name} must be a finite number >= 0, got {v!r}")
        if self.costs is not None:
            self._check_costs()
        if not (isinstance(self.decay, (int, float)) and 0.0 <= self.decay < 1.0):
            raise InvalidArgument(f"speculative decay must be in [0, 1), got {self.decay!r}")
        prior = self.prior
        if prior is not None and not (isinstance(prior, (int, float)) and not isinstance(prior, bool)
                                      and 0.0 <= prior <= 1.0):
            raise InvalidArgument(f"speculative prior must be in [0, 1], got {self.prior!r}")
        d = self.draft_cost
        if d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0.0 <= d < float("inf")):
            raise InvalidArgument(f"speculative draft_cost must be a finite number >= 0 or None, got {d!r}")
        if self.method == "mtp" and self.k > MTP_DEPTH:
            raise InvalidArgument(f"speculative mtp drafts at most {MTP_DEPTH} tokens a step (k), got {self.k}")
        return self

    def _check_costs(self) -> None:
        costs = self.costs
        pairs = isinstance(costs, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in costs)
        if not pairs or len(costs) < 2:
            raise InvalidArgument(f"speculative costs must be two or more (rows, cost) pairs, got {costs!r}")
        rows = [r for r, _ in costs]
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rows) \
                or any(a >= b for a, b in zip(rows, rows[1:])):
            raise InvalidArgument(f"speculative costs' rows must be positive integers, increasing, got {rows}")
        if not all(_finite(c) for _, c in costs):
            raise InvalidArgument(f"speculative costs must be finite numbers >= 0, got {[c for _, c in costs]}")
        if any(getattr(self, n) is not None for n in ("fixed_cost", "row_cost", "row_tile")):
            raise InvalidArgument("speculative costs replace fixed_cost, row_cost and row_tile: give one or the other")

    def for_device(self, device: Any, deterministic: bool = False) -> Speculative:
        """This configuration priced for the kernels an engine's multi-row steps run on: `AVX2_COSTS` for the
        n-gram drafts on a CPU with the AVX2 row kernels and no VNNI (default mode: deterministic mode keeps torch's
        kernel at every row count), where no price was given; else itself (the MTP's `draft_cost` is estimated
        against VNNI_PRICES' one-row step)."""
        priced = self.costs is not None or any(getattr(self, n) is not None for n in ("fixed_cost", "row_cost",
                                                                                      "row_tile"))
        if priced or self.method != "ngram":
            return self
        if getattr(device, "type", device) != "cpu" or deterministic:
            return self
        ext = cext.extension()
        if ext is None or cext.torch_kernels_forced() or ext.vnni_available() or not ext.avx2_available():
            return self
        return replace(self, costs=AVX2_COSTS, prior=AVX2_PRIOR if self.prior is None else self.prior)

    def best_k(self, p: float, room: int) -> int:
        """The draft count (0 .. min(k, room)) of a sequence decoding alone at a per-draft acceptance chance p."""
        return self.draft_counts([p], [room])[0]

    def step_cost(self, rows: int) -> float:
        """A step of `rows` rows, in one-row steps (see the class's docstring)."""
        if rows <= 1:
            return 1.0
        if self.costs is not None:
            return max(1.0, _along(self.costs, rows))
        fixed, row, tile = (d if v is None else v for v, d in zip((self.fixed_cost, self.row_cost, self.row_tile),
                                                                  VNNI_PRICES, strict=True))
        tiles = -(-rows // tile)
        return max(1.0, fixed + row * tiles * tile)  # never less than one row's

    def draft_counts(self, rates: Seq[float], rooms: Seq[int]) -> list[int]:
        """The draft counts k_i (0 .. min(k, rooms[i])) of one step's decoding sequences, at per-draft acceptance
        chances `rates`, that maximize the step's expected tokens over its cost, `step_cost(B + sum k_i)`:
        sequence i gives 1 + p_i + ... + p_i^k_i tokens. Exact: a sequence's j-th draft adds p_i^j, less than its
        (j-1)-th, so for each total D of drafts the best D are the D largest of those terms; the best total is
        then a scan over D. Each draft also costs `draft_cost` (the drafter's own work). Ties go to fewer drafts."""
        ps = [min(max(float(p), 0.0), 1.0) for p in rates]
        caps = [max(0, min(self.k, r)) for r in rooms]
        # (gain, j, i): equal gains (p = 1) spread over the sequences, first drafts first
        terms = [(p**j, j, i) for i, (p, cap) in enumerate(zip(ps, caps, strict=True)) for j in range(1, cap + 1)]
        gains = sorted(terms, key=lambda g: (-g[0], g[1]))
        b = len(ps)
        per_draft = self.draft_cost or 0.0
        best, best_d, tokens = b / self.step_cost(b), 0, float(b)
        for d, (gain, _, _) in enumerate(gains, start=1):
            tokens += gain
            value = tokens / (self.step_cost(b + d) + per_draft * d)
            if value > best * (1 + 1e-12):
                best, best_d = value, d
        counts = [0] * b
        for _, _, i in gains[:best_d]:
            counts[i] += 1
        return counts


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < float("inf")


def _along(points: tuple[tuple[int, float], ...], x: int) -> float:
    """The piecewise-linear curve through `points` (x increasing) at x: flat before the first, past the last along
    the last segment."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


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

    #: the prompt lookup (None: the MTP drafts)
    drafter: NgramDrafter | None
    #: the moving average of draft tokens kept (from Speculative.prior: 1 by default, a copy drafting fully at once)
    rate: float = 1.0
    #: a step without drafts: the lookup's first guess and the position of the token it guessed
    guess: int = -1
    guess_at: int = -1
    proposed: int = 0
    accepted: int = 0
    #: steps that carried drafts
    steps: int = 0
    #: steps since the MTP's last guess was computed while not drafting (mtp_drafter: it probes every few steps)
    idle: int = 0

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
        return seq.request.speculative is not False and seq.sampler.params.damped is None

    def propose(self, seq: Sequence) -> list[int]:
        """The drafts of seq's next decode step when it decodes alone (see `propose_all`)."""
        return self.propose_all([seq])[0]

    def propose_all(self, seqs: Seq[Sequence], work: StepWork | None = None) -> list[list[int]]:
        """The drafts of each of the next decode step's sequences (at most k each, never past a sequence's last
        token), their counts chosen together (`Speculative.draft_counts`): [] where the acceptance estimates say
        plain rows give more for their cost, or the n-grams find nothing. `work`: the step just accepted (the
        MTP drafter's input; the lookup needs only the tokens)."""
        c = self.config
        guesses: list[list[int]] = []
        rates: list[float] = []
        for seq in seqs:
            room = self.room(seq)
            if not room:
                guesses.append([])
                rates.append(0.0)
                continue
            st = self.state(seq, NgramDrafter(c.min_n, c.max_n))
            assert st.drafter is not None
            guess = st.drafter.propose(seq.tokens, room)
            if seq.grammar is not None:
                # the lookup's guess as far as the grammar allows it, else the bytes the grammar forces
                guess = guess[: seq.grammar.valid_drafts(guess)] or seq.grammar.forced_draft(room)
            guesses.append(guess)
            rates.append(st.rate)
        counts = c.draft_counts(rates, [len(g) for g in guesses])
        for seq, g, k in zip(seqs, guesses, counts, strict=True):
            if g and not k:
                seq.spec.guess, seq.spec.guess_at = g[0], len(seq.tokens)
        return [g[:k] for g, k in zip(guesses, counts, strict=True)]

    def state(self, seq: Sequence, drafter: NgramDrafter | None = None) -> SpecState:
        """seq's drafting state (made at its first proposal), once the guess of its last plain step is checked
        against the token that step gave (the free check: a guess it did not draft)."""
        st = seq.spec
        if st is None:
            prior = self.config.prior
            st = seq.spec = SpecState(drafter, rate=1.0 if prior is None else prior)
        tokens = seq.tokens
        if 0 <= st.guess_at < len(tokens):  # the plain step since the last proposal: was the guess right?
            st.learn(tokens[st.guess_at] == st.guess, self.config.decay)
        st.guess_at = -1
        return st

    def room(self, seq: Sequence) -> int:
        """The most drafts seq's next step may carry: k, never past its last token, 0 where it may not draft."""
        room = min(self.config.k, seq.max_tokens - len(seq.output) - 1)  # the step's last row gives one more token
        return room if room >= 1 and self.drafts_for(seq) else 0

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
