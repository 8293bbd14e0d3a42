"""Compile `Constraint`s with llguidance against one of our tokenizers, with a content cache.

llguidance needs the raw bytes of every token (`Tokenizer.all_token_bytes`), which tokens are
special (they never match text, only `<[id]>` in a Lark grammar) and the EOS ids (allowed exactly
where the grammar accepts). Building that token trie costs ~0.4 s for a 49k vocabulary, so one
`GrammarCompiler` is kept per (tokenizer, vocab_size) by `compiler_for`. Compiling a grammar builds
an llguidance matcher; the compiled template is cached by content and each request gets a deep copy
(microseconds).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import llguidance as llg
import numpy as np

from superslm.errors import GrammarError, InvalidArgument, TokenizerError
from superslm.grammar.rewrite import merged_patterns
from superslm.grammar.spec import Constraint
from superslm.tokenizer import Tokenizer

#: wall-clock bound on compiling one grammar; llguidance's fuel limits bound the work itself,
#: this bounds what a caller waits (the compile runs in a worker thread, llguidance drops the GIL)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
#: compiled grammars kept per compiler (least recently used dropped first)
DEFAULT_CACHE_SIZE = 128


def default_limits() -> llg.LLParserLimits:
    """llguidance's resource limits as SuperSLM sets them: its defaults (a 4 MB schema compiles
    in well under a second), with error messages that do not echo the parser state."""
    return llg.LLParserLimits(verbose_errors=False)


class _EncodeAdapter:
    """The duck-typed tokenizer llguidance's TokenizerWrapper reads: token bytes, ids and encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int) -> None:
        tokens = list(tokenizer.all_token_bytes())
        # rows past the tokenizer (a model's padded vocabulary) are empty: never allowed
        tokens.extend(b"" for _ in range(vocab_size - len(tokens)))
        self.tokens = tokens
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        # llguidance only uses this for forced-token tokenization; undecodable tails are rare
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llg.LLTokenizer:
    """An llguidance tokenizer for `tokenizer`, `vocab_size` wide (default: the tokenizer's size;
    a model whose logits are wider passes their width). Stop ids act as EOS."""
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if size < tokenizer.vocab_size:
        raise InvalidArgument(f"vocab_size {size} is below the tokenizer's {tokenizer.vocab_size}")
    eos = sorted(tokenizer.stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if not eos:
        raise TokenizerError("a grammar needs an EOS token, and this tokenizer has none")
    primary = tokenizer.eos_id if tokenizer.eos_id in eos else eos[0]
    try:
        return llg.LLTokenizer(llg.TokenizerWrapper(_EncodeAdapter(tokenizer, size, primary)), eos_token=eos)
    except Exception as e:  # the Rust side raises plain exceptions
        raise TokenizerError(f"llguidance cannot use this tokenizer: {e}") from e


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one compiler's vocabulary: immutable, shared by requests."""

    constraint: Constraint
    compiler: GrammarCompiler
    compile_s: float
    """Seconds the compile took (0 reading from the cache is not recorded here)."""
    _template: llg.LLMatcher
    #: the llguidance grammar the template was built from (a fresh build reads the same)
    _grammar: str = ""
    #: set once a matcher of this grammar failed (llguidance's error, e.g. its lexer's state limit): the
    #: copies share the template's lexer and its state count, so later matchers are built afresh
    _stale: threading.Event = field(default_factory=threading.Event, repr=False)

    def new_matcher(self) -> llg.LLMatcher:
        """A fresh llguidance matcher at the grammar's start: a deep copy of the template, or a new build once
        the template is stale (one request's lexer error must not end every later request of the grammar)."""
        if self._stale.is_set():
            return self.compiler._build(self._grammar or self.constraint.grammar())
        return self._template.deep_copy()

    def mark_stale(self) -> None:
        """A matcher of this grammar failed: the compiler's next `compile` of it builds a new template."""
        self._stale.set()

    @property
    def stale(self) -> bool:
        return self._stale.is_set()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary width, caching them by content.

    Thread-safe: the engine and server may compile from different threads.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        limits: llg.LLParserLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size)
        self.vocab_size: int = self.ll_tokenizer.vocab_size
        #: int32 words in one bitmask row: ceil(vocab_size / 32)
        self.bitmask_words: int = (self.vocab_size + 31) // 32
        self.eos_ids: tuple[int, ...] = tuple(self.ll_tokenizer.eos_tokens)
        self.timeout_s = timeout_s
        self.limits = limits if limits is not None else default_limits()
        self._cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of `constraint` (from the cache when compiled before).

        Raises:
            GrammarError: the schema, regex or grammar is invalid, exceeds llguidance's limits, or
                did not compile within `timeout_s` (the message says which).
        """
        if not isinstance(constraint, Constraint):
            raise InvalidArgument(f"expected a Constraint, got {type(constraint).__name__}")
        key = constraint.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit.stale:
                del self._cache[key]
                hit = None
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._compile(constraint)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cached(self, constraint: Constraint) -> bool:
        """True when `constraint` is in the cache (compiling it would not recompile)."""
        with self._lock:
            return constraint.key() in self._cache

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        grammar = constraint.grammar()
        matcher = self._build_within(constraint, grammar, start)
        error = matcher.get_error()
        if error and (constraint.is_json or constraint.kind == "lark") and merged_patterns(error):
            grammar = constraint.grammar(canonical_keys=False)
            matcher = self._build_within(constraint, grammar, start)
            error = matcher.get_error()
        if error:
            raise GrammarError(f"invalid {constraint.kind}: {_first_lines(error)}")
        return CompiledGrammar(constraint, self, time.perf_counter() - start, matcher, grammar)

    def _build_within(self, constraint: Constraint, grammar: str, start: float) -> llg.LLMatcher:
        """The matcher of `grammar`, built in a worker thread within what is left of `timeout_s`."""
        future = _pool().submit(self._build, grammar)
        try:
            return future.result(timeout=max(self.timeout_s - (time.perf_counter() - start), 0.01))
        except FutureTimeout:
            # the worker finishes on its own (its work is bounded by the fuel limits)
            raise GrammarError(f"{constraint.kind} did not compile within {self.timeout_s:g} s") from None

    def _build(self, grammar: str) -> llg.LLMatcher:
        # log_level 0: errors are read back with get_error(), not printed to stderr
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if not matcher.get_error():
            # the first token's mask, on a copy: a grammar built lazily past the lexer's limits (a{100} nested three
            # deep) fails here, as a compile error, instead of ending its first request with nothing
            # twice, on two copies: their lexer shares what it built with the template, so a grammar at the limit
            # passes once and fails from then on (each request's state is such a copy)
            mask = np.zeros((self.ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)
            for _ in range(2):
                probe = matcher.deep_copy()
                probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # as GrammarState computes its masks
                if probe.is_error() and "lexer error" in probe.get_error():
                    return probe
        return matcher

    def __repr__(self) -> str:
        return f"GrammarCompiler(vocab_size={self.vocab_size}, cached={len(self._cache)})"


def _first_lines(message: str, n: int = 6) -> str:
    """An llguidance error without its trailing parser-state dump."""
    head = message.split("\n<state>", 1)[0].replace("<non-verbose/>", "").strip()
    return "\n".join(head.splitlines()[:n])


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="superslm-grammar")
        return _POOL


_COMPILERS: weakref.WeakKeyDictionary[Tokenizer, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int | None = None) -> GrammarCompiler:
    """The shared `GrammarCompiler` of `tokenizer` at `vocab_size` (built once, kept while the
    tokenizer lives): engines and the server use this so they share one compile cache."""
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    with _COMPILERS_LOCK:
        per = _COMPILERS.setdefault(tokenizer, {})
        compiler = per.get(size)
        if compiler is None:
            compiler = per[size] = GrammarCompiler(tokenizer, vocab_size=size)
        return compiler
