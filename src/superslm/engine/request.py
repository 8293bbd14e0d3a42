"""What a caller hands the engine (Request) and gets back (Progress), and the engine's own record of a
sequence (Sequence): its tokens and how many of them are computed. Prefill chunks and decode tokens
both come from that one number (num_computed_tokens)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from superslm.sampling import Sampling

#: why a request ended ("not_finite": its logits were NaN, the model's activations overflowed: no token to trust)
END_STOP, END_LENGTH, END_CANCELLED, END_GRAMMAR = "stop", "length", "cancelled", "grammar"
END_NOT_FINITE = "not_finite"


@dataclass
class Request:
    """A prompt to continue: at most `max_tokens` new tokens, chosen as `sampling` says.

    `prompt` is token ids, or text that the model's tokenizer encodes (with its bos where it adds one).
    `salt` separates this request's prefix-cache entries from other callers' (as vLLM's cache_salt).
    `prefix`: a handle from `Engine.prefix(tokens)`: the request continues after its tokens, which
    are never computed again (`prompt` is what follows them).
    `adapter`: a LoRA adapter from `Model.adapter(folder)`, applied to this request's rows only.
    `speculative`: False keeps drafts out of this request's steps on an engine that drafts (`Engine(speculative=)`);
    its tokens are the same either way, only the steps' cost differs.
    """

    prompt: Seq[int] | str
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    salt: str | None = None
    prefix: Any = None
    adapter: Any = None
    speculative: bool = True


@dataclass
class Logprob:
    """A chosen token's log probability, and the most likely tokens with theirs (of the raw logits)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Progress:
    """What a step gave a request (Engine.advance).

    `tokens`: its new tokens (a stop token is not included); `text`: their text, held back while it may
    still start a stop string or end inside a UTF-8 sequence; `cached`: prompt tokens read from the
    prefix cache instead of computed; `end`: "" while it goes on, else "stop" (a stop token or string),
    "length" (max_tokens, the context's end, or a KV pool too small for it alone), "cancelled", or
    "grammar" (its constraint admits no token); `forced_tokens`: tokens its grammar forced (at the end).
    """

    id: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    end: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    #: the stop string or stop token id that ended it, if any
    stop_reason: str | int | None = None
    forced_tokens: int = 0
    #: Sampling.prompt_logprobs: per prompt position, the logprobs of its token (None for the first), once
    prompt_logprobs: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return bool(self.end)


class Sequence:
    """The engine's record of one request: prompt + output tokens, computed count and KV pages."""

    def __init__(self, seq_id: int, request: Request, prompt: list[int], max_tokens: int, sampler: Any,
                 decoder: Any, stops: Any, grammar: Any = None, anti: Any = None) -> None:
        self.id = seq_id
        self.request = request
        self.prompt = prompt
        self.output: list[int] = []
        self.max_tokens = max_tokens
        #: tokens whose K/V are in this sequence's pages
        self.num_computed_tokens = 0
        #: tokens proposed to follow `tokens`, not verified yet (vLLM's spec_token_ids): the scheduler schedules
        #: them as more rows of the sequence's next decode step, and the step's verification keeps those the
        #: sequence's own choices agree with (engine/speculative.py)
        self.drafts: list[int] = []
        #: the drafter's state for this sequence (speculative.SpecState), made at its first proposal
        self.spec: Any = None
        #: positions whose MTP rows are in the MTP's KV layer (an engine drafting with the MTP, mtp_drafter.py)
        self.mtp_rows = 0
        #: the body's normed hidden state at position mtp_rows, whose MTP row waits for the token after it (a
        #: prefix handle's last position, `Prefix.hidden`); None: none waits
        self.mtp_hidden: Any = None
        #: the row of the recurrent states this sequence reads and writes while it runs (delta-rule models)
        self.state_slot: int | None = None
        self.block_table: list[int] = []
        #: full pages already offered to the prefix cache, and the chain's last hash
        self.num_hashed_pages = 0
        self.last_hash: bytes | None = None
        #: prompt tokens taken from the prefix cache at the first admission
        self.cached = 0
        self.sampler = sampler
        self.decoder = decoder
        self.stops = stops
        #: the grammar walk (superslm.grammar.GrammarState) and the damped-greedy anti-LM, if any
        self.grammar = grammar
        self.anti = anti
        self.end = ""
        self.stop_reason: str | int | None = None
        self.preemptions = 0
        #: layers of forward work this sequence's rows have been through (Engine.stats)
        self.layers_run = 0
        #: the final normed hidden state of the last prompt position (Engine.prefill_hidden)
        self.prefill_hidden: Any = None
        #: Sampling.bad_words as token sequences, and Sampling.allowed_token_ids as a bitmask row (engine/masks.py)
        self.bad_words: tuple[tuple[int, ...], ...] = ()
        self.allowed: Any = None
        #: Sampling.prompt_logprobs: one entry per prompt position (TokenLogprobs; None for the first), filled
        #: by the prompt's chunks; None once delivered (or never asked for)
        self.prompt_logprobs: list[Any] | None = None
        if sampler is not None and sampler.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while the prompt's logprobs are still to compute or deliver: its prompt is computed whole."""
        return self.prompt_logprobs is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        """True while more than the newest token remains to compute (a prompt, or a resume)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def salt(self) -> str | bytes | None:
        """The prefix-cache key: the request's salt (str) and its adapter (pages are never shared across them).
        With an adapter, bytes (which the page hash tells from any str): its content fingerprint (64 hex digits,
        so nothing a salt holds can pose as another adapter, and an id() Python reuses names nothing), then a
        tag for no salt or the salt's utf-8."""
        adapter = self.request.adapter
        if adapter is None:
            return self.request.salt
        salt = self.request.salt
        return b"lora:" + adapter.fingerprint.encode() + (b"\0" if salt is None else b"\1" + salt.encode())
