"""Damped greedy decoding with an anti-LM, in Q16 fixed point.

Among the top_k candidates by log-probability, a candidate's score is its log-probability minus
alpha times the log-probability an n-gram model of the sequence's own output gives it. The n-gram
model has orders 1..n, each P(c | context) = (count(context, c) + 1/V) / (count(context) + 1),
averaged over the orders: a continuation already seen after the same context scores about ln V
higher, so it is damped. The model is pure counting, and every quantity is rounded to an integer in
units of 2^-16 before it is compared, so the choice is exact for the same logits on every platform;
ties go to the lowest token id.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from superslm.sampling.params import DampedGreedy
from superslm.sampling.shaping import ranked_top

Q = 1 << 16


def _ln_q(numerator: int, denominator: int) -> int:
    """round(ln(numerator / denominator) * 2^16) for positive integers."""
    return round((math.log(numerator) - math.log(denominator)) * Q)


class AntiLM:
    """Counts of the n-grams of one sequence's output (orders 1..order); plain-data state."""

    def __init__(self, order: int) -> None:
        self.order = order
        #: (context tuple, token) -> count, and context tuple -> count, for contexts of 0..order-1 tokens
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.totals: dict[tuple[int, ...], int] = {}
        self.history: list[int] = []

    def append(self, token: int) -> None:
        for k in range(self.order):
            if k > len(self.history):
                break
            ctx = tuple(self.history[len(self.history) - k :]) if k else ()
            row = self.counts.setdefault(ctx, {})
            row[token] = row.get(token, 0) + 1
            self.totals[ctx] = self.totals.get(ctx, 0) + 1
        self.history.append(token)

    def logprob_q(self, token: int, vocab: int) -> int:
        """Q16 log-probability of `token` next, averaged over the orders with a full context."""
        total, orders = 0, 0
        for k in range(self.order):
            if k > len(self.history):
                break
            ctx = tuple(self.history[len(self.history) - k :]) if k else ()
            count = self.counts.get(ctx, {}).get(token, 0)
            # (count + 1/V) / (seen + 1), as integers: (count * V + 1) / ((seen + 1) * V)
            total += _ln_q(count * vocab + 1, (self.totals.get(ctx, 0) + 1) * vocab)
            orders += 1
        return total // orders if orders else _ln_q(1, vocab)

    def state(self) -> dict[str, Any]:
        return {"order": self.order, "history": list(self.history)}

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> AntiLM:
        order, history = data["order"], data["history"]
        if type(order) is not int or not 1 <= order <= 8 or not isinstance(history, list) or not all(
                type(t) is int and t >= 0 for t in history):
            raise ValueError("malformed AntiLM state")
        anti = cls(order)
        for t in history:
            anti.append(t)
        return anti


def damped_choice(logprobs: torch.Tensor, anti: AntiLM, params: DampedGreedy) -> int:
    """The damped-greedy token of one row of log-probabilities [V] (float32, -inf where masked)."""
    vocab = logprobs.shape[-1]
    k = min(params.top_k, vocab)
    # top-k by value, ties to the lowest id
    values, ids = ranked_top(logprobs.float().reshape(1, vocab), k)
    cands = list(zip(values[0].tolist(), ids[0].tolist()))
    alpha_q = round(params.alpha * Q)
    best: tuple[int, int] | None = None
    for value, token in cands:
        if value == float("-inf"):
            continue
        score = round(value * Q) - (alpha_q * anti.logprob_q(token, vocab)) // Q
        if best is None or score > best[0] or (score == best[0] and token < best[1]):
            best = (score, token)
    return cands[0][1] if best is None else best[1]


def repeated_ngrams(tokens: Sequence[int], n: int = 3) -> int:
    """How many n-grams of `tokens` repeat an earlier one (a repetition measure for tests and docs)."""
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i : i + n])
        repeats += g in seen
        seen.add(g)
    return repeats
