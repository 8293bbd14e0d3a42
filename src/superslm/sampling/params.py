"""The per-request sampling parameters, with OpenAI/vLLM meanings and ranges.

`Sampling()` is greedy decoding with nothing else switched on; every field is a plain value so a
request's parameters serialise with `to_dict()` / `from_dict()`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.grammar.spec import Constraint

#: temperatures below this are treated as greedy (as vLLM's _SAMPLING_EPS): dividing by a tiny
#: temperature only overflows, and the limit of the distribution is the argmax anyway
GREEDY_EPS = 1e-5
#: the largest `logprobs` (top-n alternatives) accepted, as OpenAI's chat API
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """How to choose the next token of one request (OpenAI / vLLM semantics).

    Constructed values are normalised (a single stop string becomes a 1-tuple, lists become tuples,
    `logit_bias` keys given as strings, as JSON delivers them, become ints); ranges are checked by
    `validate(vocab_size)`, which the engine calls once the model's vocabulary is known.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 (anything below 1e-5) means greedy: the argmax, no randomness."""
    top_k: int = 0
    """Keep only the k most likely tokens (ties at the k-th value are all kept); 0 switches it off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's probability."""
    seed: int | None = None
    """Seed of this request's random stream; None draws one when the request's state is created."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token that already occurs in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence of that token in the output."""
    repetition_penalty: float = 1.0
    """For tokens seen in the prompt or output: positive logits are divided by it, others multiplied."""
    # a read-only mapping is not hashable: equal Samplings still hash equal without it
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    """Added to the named tokens' logits before anything else (-100 bans, +100 forces in practice)."""
    logprobs: int | None = None
    """None: no logprobs; 0: the chosen token's logprob only; n: also the n most likely tokens'."""
    prompt_logprobs: int | None = None
    """The same for each prompt token after the first, given the tokens before it (vLLM's prompt_logprobs):
    delivered once, with the first output token's Progress. Such a prompt is computed whole (no prefix cache)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first one that appears (it is not returned)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS); the stop token is not returned as text."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token (for benchmarks and max_tokens-only runs)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled (vLLM's allowed_token_ids); None: any."""
    bad_words: tuple[str, ...] = ()
    """Words never generated (vLLM's bad_words): each word's tokens, as written and after a space; the last token
    of one is masked where the output ends with the rest of it."""
    min_tokens: int = 0
    """No end before this many output tokens (vLLM's min_tokens): EOS (unless ignore_eos) and stop_token_ids
    are masked until then, and stop strings count from that token on (one may start in the text before, as vLLM
    looks back); at most max_tokens."""
    grammar: Constraint | None = None
    """Only tokens this constraint allows (JSON schema, regex, Lark, choice); see superslm.grammar."""
    schema: str | None = None
    """A named schema shipped with the model (`Model.schemas()`), instead of `grammar`."""
    after: int | None = None
    """The constraint starts after this token id appears (a reasoning model's end of thinking)."""
    damped: DampedGreedy | None = None
    """Damped greedy decoding with an anti-LM instead of sampling (see DampedGreedy)."""

    def __post_init__(self) -> None:
        # a frozen dataclass can only be normalised through object.__setattr__
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, (str, bytes)):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        words = self.bad_words
        object.__setattr__(self, "bad_words", (words,) if isinstance(words, str) else tuple(words or ()))
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for key, value in dict(self.logit_bias).items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise InvalidArgument(f"logit_bias: key {key!r} is not a token id") from None
                if isinstance(key, float) and key != token:
                    raise InvalidArgument(f"logit_bias: key {key!r} is not a token id")
                bias[token] = value
            object.__setattr__(self, "logit_bias", MappingProxyType(bias) if bias else None)

    # --- derived flags the batch builder uses -------------------------------------------------------

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (biased, penalised) logits."""
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any of presence/frequency/repetition penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    # --- checks -------------------------------------------------------------------------------------

    def validate(self, vocab_size: int) -> Sampling:
        """Check every field against OpenAI/vLLM ranges and the vocabulary; return self.

        Raises:
            InvalidArgument: a field has the wrong type or is out of range (the message names it).
            TokenOutOfRange: a `logit_bias` key or a `stop_token_ids` entry is not in [0, vocab_size).
        """
        _number("temperature", self.temperature, lo=0.0)
        _integer("top_k", self.top_k, lo=0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _integer("seed", self.seed)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.logit_bias is not None:
            for token, value in self.logit_bias.items():
                _token("logit_bias", token, vocab_size)
                _number(f"logit_bias[{token}]", value, lo=-100.0, hi=100.0)
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise InvalidArgument(f"stop[{i}]: stop strings must be non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _token("stop_token_ids", token, vocab_size)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids:
                raise InvalidArgument("allowed_token_ids: a non-empty list of token ids")
            for token in self.allowed_token_ids:
                _token("allowed_token_ids", token, vocab_size)
        for i, word in enumerate(self.bad_words):
            if not isinstance(word, str) or not word.strip():
                raise InvalidArgument(f"bad_words[{i}]: bad words must be non-empty strings, got {word!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        _integer("min_tokens", self.min_tokens, lo=0)
        if self.grammar is not None and not isinstance(self.grammar, Constraint):
            raise InvalidArgument("grammar: expected a superslm.grammar.Constraint")
        if self.grammar is not None and self.schema is not None:
            raise InvalidArgument("grammar and schema: give one constraint, not both")
        if self.schema is not None and (not isinstance(self.schema, str) or not self.schema):
            raise InvalidArgument(f"schema: expected a schema name, got {self.schema!r}")
        if self.after is not None:
            _token("after", self.after, vocab_size)
        if self.damped is not None:
            if not isinstance(self.damped, DampedGreedy):
                raise InvalidArgument("damped: expected a DampedGreedy")
            self.damped.validate()
        return self

    # --- plain data ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready plain data (logit_bias as [[token, bias], ...], tuples as lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif f.name == "logit_bias" and value is not None:
                value = [[int(k), float(v)] for k, v in value.items()]
            elif f.name in ("grammar", "damped") and value is not None:
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sampling:
        """Rebuild from `to_dict()` output (unknown keys raise InvalidArgument)."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidArgument(f"unknown sampling fields: {sorted(unknown)}")
        kwargs = dict(data)
        bias = kwargs.get("logit_bias")
        if isinstance(bias, list):
            kwargs["logit_bias"] = {int(k): float(v) for k, v in bias}
        if isinstance(kwargs.get("grammar"), Mapping):
            kwargs["grammar"] = Constraint.from_dict(kwargs["grammar"])
        if isinstance(kwargs.get("damped"), Mapping):
            kwargs["damped"] = DampedGreedy(**kwargs["damped"])
        return cls(**kwargs)


@dataclass(frozen=True)
class DampedGreedy:
    """Damped greedy decoding with an anti-LM.

    Deterministic, no randomness: among the `top_k` most likely tokens, each candidate's
    log-probability is lowered by `alpha` times the log-probability that an n-gram model of the
    sequence's own output (orders 1..`order`, smoothed towards uniform, counts kept per sequence) gives it;
    the best candidate wins (lowest id on ties). It damps repetition. The arithmetic is fixed point
    (Q16), so the choice is exact on every platform for the same logits.
    """

    alpha: float = 1.0
    order: int = 2
    top_k: int = 6

    def validate(self) -> None:
        _number("damped.alpha", self.alpha, lo=0.0, hi=16.0)
        _integer("damped.order", self.order, lo=1, hi=8)
        _integer("damped.top_k", self.top_k, lo=1, hi=64)

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "order": self.order, "top_k": self.top_k}


def _number(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    # bool is an int subclass; a JSON `true` for a temperature is a client bug, not 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{name}: must be finite, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise InvalidArgument(f"{name}: must be {bound}, got {value!r}")
    if hi is not None and value > hi:
        raise InvalidArgument(f"{name}: must be <= {hi}, got {value!r}")


def _integer(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}: expected an integer, got {value!r}")
    if lo is not None and value < lo:
        raise InvalidArgument(f"{name}: must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise InvalidArgument(f"{name}: must be <= {hi}, got {value!r}")


def _token(name: str, token: object, vocab_size: int) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidArgument(f"{name}: token id {token!r} is not an integer")
    if not 0 <= token < vocab_size:
        raise TokenOutOfRange(f"{name}: token id {token} is outside the vocabulary [0, {vocab_size})")
