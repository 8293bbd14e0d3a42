"""`GrammarState`: one request's walk through its grammar, and the batched bitmask fill.

Per engine step, for a constrained row:

    forced = state.take_forced(limit)      # jump-forward: tokens the grammar allows alone
    ... run [last sampled token] + forced through the model ...
    state.fill_bitmask(bitmask[row])       # int32 [ceil(V/32)], a set bit allows the token
    ... sample with the bitmask ...
    state.accept(token)                    # False: the state is dead, end with reason "grammar"

A state created with `after=<token id>` imposes nothing until that token is accepted (a reasoning
model's end of thinking); the constraint starts with the token after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import llguidance as llg
import numpy as np

from superslm.errors import InternalError, InvalidArgument
from superslm.grammar.compiler import CompiledGrammar, GrammarCompiler
from superslm.grammar.spec import Constraint

#: default cap on one jump-forward run (the engine passes its own, e.g. tokens left to max_tokens)
DEFAULT_FORCED_LIMIT = 64


def _as_numpy(x: Any) -> Any:
    """A numpy view of a CPU torch tensor (shared memory); numpy arrays and the rest pass through."""
    if isinstance(x, np.ndarray) or not hasattr(x, "numpy"):
        return x
    try:
        return x.numpy()
    except (TypeError, RuntimeError) as e:  # a GPU tensor: the engine fills a CPU one and uploads
        raise InvalidArgument(f"a bitmask must be on the CPU: {e}") from e


def _row_view(row: Any, words: int) -> np.ndarray:
    """A writable int32 numpy view of a bitmask row (a CPU torch tensor or a numpy array)."""
    arr = _as_numpy(row)
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.shape != (words,):
        shape = getattr(row, "shape", None)
        raise InvalidArgument(f"bitmask row must be int32 [{words}], got {getattr(row, 'dtype', None)} {shape}")
    return arr


def _single_token(mask: np.ndarray) -> int | None:
    """The token id when exactly one bit of `mask` is set, else None."""
    nz = np.flatnonzero(mask)
    if len(nz) != 1:
        return None
    word = int(mask[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1


class GrammarState:
    """Where one request stands in its grammar: mask, accept, jump-forward, acceptance, dead ends.

    Args:
        grammar: the compiled constraint (`GrammarCompiler.compile`).
        after: a token id after which the constraint starts; None: it applies from the first token.
        active: override whether the constraint is already on (e.g. the prompt itself ended the
            thinking); default: on unless `after` is given.
        stop_ids: the request's extra stop token ids; like EOS they are allowed only where the
            grammar accepts.
    """

    def __init__(
        self,
        grammar: CompiledGrammar,
        *,
        after: int | None = None,
        active: bool | None = None,
        stop_ids: Iterable[int] = (),
    ) -> None:
        self.grammar = grammar
        self.after = after
        compiler = grammar.compiler
        self._words = compiler.bitmask_words
        self._eos = frozenset(compiler.eos_ids)
        self.extra_stop_ids: tuple[int, ...] = tuple(sorted(set(stop_ids) - self._eos))
        for t in self.extra_stop_ids:
            if not 0 <= t < compiler.vocab_size:
                raise InvalidArgument(f"stop token id {t} is outside the vocabulary")
        self._stops = self._eos | frozenset(self.extra_stop_ids)
        self._matcher: llg.LLMatcher | None = None
        #: tokens accepted while the constraint was on (replayed by `from_state`)
        self.tokens: list[int] = []
        #: tokens handed out by `take_forced` (the engine's `forced_tokens` count)
        self.num_forced = 0
        self._mask: np.ndarray | None = None  # the mask at the current position, once computed
        self._dead: str | None = None
        self._stopped = False  # a stop token was accepted
        if (after is None) if active is None else active:
            self._activate()

    # --- status -------------------------------------------------------------------------------

    @property
    def constraint(self) -> Constraint:
        """The constraint this state walks."""
        return self.grammar.constraint

    @property
    def active(self) -> bool:
        """True once the constraint applies (always, unless waiting for the `after` token)."""
        return self._matcher is not None

    @property
    def is_dead(self) -> bool:
        """True when no token is allowed: the engine ends the request with reason "grammar"."""
        if self._dead is None and self._matcher is not None and not self._stopped:
            self._current_mask()  # a dead end shows when the mask is computed
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the state is dead (llguidance's message), or None."""
        return self._dead

    @property
    def is_accepting(self) -> bool:
        """True when the constrained output so far is a whole sentence of the grammar (EOS and the
        stop ids are allowed exactly here). False before the constraint starts."""
        if self._matcher is None or self._dead is not None:
            return False
        return self._stopped or self._matcher.is_accepting()

    @property
    def allows_stop(self) -> bool:
        """Whether a stop (token or string) may end the output here: no constraint yet, or accepting."""
        return self._matcher is None or self.is_accepting

    @property
    def is_finished(self) -> bool:
        """True when the grammar is complete: a stop token was accepted, or only stop tokens remain."""
        if self._matcher is None or self._dead is not None:
            return False
        return self._stopped or (self._matcher.is_stopped() and not self._matcher.is_error())

    # --- the per-step operations --------------------------------------------------------------

    def fill_bitmask(self, row: Any) -> bool:
        """Write the allowed tokens into `row` (int32 [ceil(V/32)], CPU), a set bit = allowed.

        Returns False, with every bit set, while the constraint has not started (the engine may
        then skip masking this row); True otherwise. A dead state gets no bit set.
        """
        view = _row_view(row, self._words)
        if self._matcher is None:
            view.fill(-1)
            return False
        mask = self._current_mask() if not self._stopped and self._dead is None else None
        if mask is None or self._dead is not None:
            view.fill(0)  # finished or dead: nothing may follow (the engine ends the request)
            return True
        view[:] = mask
        return True

    def accept(self, token: int) -> bool:
        """Advance past a sampled (or forced) token. Returns False when the grammar refuses it;
        the state is then dead. Before the constraint starts every token is accepted."""
        token = int(token)
        if self._matcher is None:
            if token == self.after:
                self._activate()
            return True
        if self._dead is not None or self._stopped:
            self._dead = self._dead or f"token {token} after the grammar finished"
            return False
        if not 0 <= token < self.grammar.compiler.vocab_size:
            self._dead = f"token id {token} is outside the vocabulary"
            return False
        if token in self._stops:
            if not self._matcher.is_accepting():
                self._dead = f"stop token {token} where the grammar does not accept"
                return False
            self._stopped = True
            self.tokens.append(token)
            self._mask = None
            return True
        if not self._matcher.consume_token(token):
            self._dead = _short(self._matcher.get_error()) or f"token {token} is not allowed here"
            if self._matcher.is_error():
                self.grammar.mark_stale()
            return False
        self.tokens.append(token)
        self._mask = None
        return True

    def accept_many(self, tokens: Iterable[int]) -> int:
        """`accept` each token in turn; returns how many were accepted (stops at the first refused)."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def forced_tokens(self, limit: int = DEFAULT_FORCED_LIMIT) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (at most `limit`),
        without advancing. Each is the single token its mask allows, so masked decoding (greedy or
        not) would pick exactly these: jump-forward over them changes no output."""
        if self._matcher is None or self._dead is not None or self._stopped or limit <= 0:
            return []
        first = _single_token(self._current_mask())
        if first is None or first in self._stops:
            return []
        probe = self._matcher.deep_copy()
        out = [first]
        probe.consume_token(first)
        while len(out) < limit:
            mask = self._compute(probe)
            token = _single_token(mask) if mask is not None else None
            if token is None or token in self._stops or not probe.consume_token(token):
                break
            out.append(token)
        return out

    def take_forced(self, limit: int = DEFAULT_FORCED_LIMIT) -> list[int]:
        """`forced_tokens(limit)`, accepted: the engine must append all of them to the output.
        The mask after them is computed on the way and kept for the next `fill_bitmask`."""
        out: list[int] = []
        while len(out) < limit and self._matcher is not None and self._dead is None and not self._stopped:
            token = _single_token(self._current_mask())
            if token is None or token in self._stops:
                break
            if not self.accept(token):
                break  # llguidance refused its own mask's token: the state is dead, never a crash
            out.append(token)
        self.num_forced += len(out)
        return out

    # --- drafts: tokens proposed ahead, checked and masked without being accepted ----------------

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, from here in order, the grammar allows: up to the first it refuses, a stop token
        (a draft never ends the output), or, while the constraint waits for its `after` token, that token (the
        masks after it would be the constraint's). The state does not move."""
        if self._dead is not None or self._stopped:
            return 0
        if self._matcher is None:
            return next((i for i, t in enumerate(drafts) if t == self.after), len(drafts))
        vocab = self.grammar.compiler.vocab_size
        n = next((i for i, t in enumerate(drafts) if t in self._stops or not 0 <= t < vocab), len(drafts))
        return self._matcher.validate_tokens([int(t) for t in drafts[:n]]) if n else 0

    def forced_draft(self, limit: int) -> list[int]:
        """The bytes the grammar forces from here (all of them, the last token included, which llguidance's own
        fast-forward leaves out because the text after it may merge into it), tokenized as the tokenizer writes
        them and cut to what the grammar allows: a guess at the next tokens where the grammar leaves other
        spellings, for the model to verify (`valid_drafts`). [] where nothing is forced."""
        if self._matcher is None or self._dead is not None or self._stopped or limit <= 0:
            return []
        forced = self._matcher.compute_ff_bytes()
        if not forced:
            return []
        tokens = self.grammar.compiler.ll_tokenizer.tokenize_bytes(forced)[:limit]
        return tokens[: self.valid_drafts(tokens)]

    def fill_bitmasks_along(self, drafts: Sequence[int], rows: Any) -> None:
        """Row j of `rows` (int32 [len(drafts) + 1, W], CPU) gets the mask after drafts[:j], as `fill_bitmask`
        would write it once they were accepted (no bit where they lead to a dead end or past the grammar's
        end). The state does not move: a copy of the matcher walks the drafts."""
        arr = _as_numpy(rows)
        if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.shape != (len(drafts) + 1, self._words):
            raise InvalidArgument(f"bitmask rows must be int32 [{len(drafts) + 1}, {self._words}]")
        self.fill_bitmask(arr[0])
        if not drafts:
            return
        if self._matcher is None:
            if self.after in drafts:
                raise InvalidArgument("drafts may not start the constraint (valid_drafts cuts them before it)")
            arr[1:].fill(-1)
            return
        probe = self._matcher.deep_copy() if self._dead is None and not self._stopped else None
        for j, token in enumerate(drafts, start=1):
            ok = probe is not None and int(token) not in self._stops and probe.consume_token(int(token))
            mask = self._compute(probe) if ok else None
            if mask is None:
                arr[j:].fill(0)  # a refused draft: the rows after it are never taken (verification stops there)
                return
            arr[j] = mask

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens of the constrained part (speculative drafts)."""
        if n < 0 or n > len(self.tokens):
            raise InvalidArgument(f"cannot roll back {n} of {len(self.tokens)} tokens")
        if n == 0 or self._matcher is None:
            return
        if self._matcher.is_error():
            # llguidance never leaves its error state: check drafts against the mask instead
            raise InvalidArgument(f"cannot roll back a grammar state that errored: {self._dead}")
        undone = self.tokens[-n:]
        del self.tokens[-n:]
        if self._stopped:
            self._stopped = False
            undone = undone[:-1]  # the stop token never reached llguidance
        if undone and not self._matcher.rollback(len(undone)):
            raise InternalError(f"llguidance refused to roll back {len(undone)} tokens")
        self._dead = None
        self._mask = None

    # --- plain data ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """This state as JSON-ready plain data (the constraint, `after`, and the tokens to replay)."""
        return {
            "constraint": self.constraint.to_dict(),
            "after": self.after,
            "active": self.active,
            "stop_ids": list(self.extra_stop_ids),
            "tokens": list(self.tokens),
            "num_forced": self.num_forced,
            "dead": self._dead,
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any], compiler: GrammarCompiler) -> GrammarState:
        """Rebuild a state from `state()` output: recompile (usually a cache hit) and replay."""
        try:
            constraint = Constraint.from_dict(data["constraint"])
            st = cls(
                compiler.compile(constraint),
                after=data.get("after"),
                active=bool(data["active"]),
                stop_ids=data.get("stop_ids", ()),
            )
            tokens: Sequence[int] = data.get("tokens", ())
        except (KeyError, TypeError) as e:
            raise InvalidArgument(f"malformed grammar state: {e}") from e
        if st.active:
            st.accept_many(tokens)
        if data.get("dead"):
            st._dead = st._dead or str(data["dead"])  # the refused token itself is not replayed
        st.num_forced = int(data.get("num_forced", 0))
        return st

    # --- internals ----------------------------------------------------------------------------

    def _activate(self) -> None:
        self._matcher = self.grammar.new_matcher()

    def _current_mask(self) -> np.ndarray:
        if self._mask is None:
            assert self._matcher is not None
            self._keep_mask(self._compute(self._matcher))
        assert self._mask is not None
        return self._mask

    def _keep_mask(self, mask: np.ndarray | None) -> None:
        """Cache the current position's mask (None: llguidance errored); an empty one is a dead end."""
        if mask is None:
            assert self._matcher is not None
            self._dead = self._dead or _short(self._matcher.get_error()) or "grammar error"
            self.grammar.mark_stale()  # its lexer, shared with the template, may be what failed
            mask = np.zeros(self._words, dtype=np.int32)
        elif not mask.any():
            self._dead = self._dead or "no token is allowed here"
        self._mask = mask

    def _compute(self, matcher: llg.LLMatcher) -> np.ndarray | None:
        """The mask of `matcher` with the extra stop ids where it accepts; None on a grammar error."""
        mask = np.empty(self._words, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return self._finish_mask(matcher, mask)

    def _finish_mask(self, matcher: llg.LLMatcher, mask: np.ndarray) -> np.ndarray | None:
        # llguidance leaves EOS allowed after an error: an error is a dead end, not a finish
        if matcher.is_error():
            return None
        if self.extra_stop_ids and matcher.is_accepting():
            ids = np.asarray(self.extra_stop_ids)
            np.bitwise_or.at(mask.view(np.uint32), ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return mask


def _short(message: str) -> str:
    """An llguidance error without the parser-state dump (or its placeholder) it may carry."""
    return message.split("\n<state>", 1)[0].replace("<non-verbose/>", "").strip()


_EXECUTOR: llg.LLExecutor | None = None


def fill_bitmasks(states: Sequence[GrammarState | None], bitmask: Any) -> list[bool]:
    """Fill every row of `bitmask` (int32 [len(states), W], CPU, contiguous) for a batch.

    Row i gets `states[i]`'s mask; None or a state still waiting for its `after` token gets every
    bit set. Masks not computed yet are computed in parallel (llguidance's executor, GIL
    released). Returns, per row, whether it constrains anything (False rows may skip masking).
    """
    global _EXECUTOR
    arr = _as_numpy(bitmask)
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.ndim != 2 or arr.shape[0] != len(states):
        raise InvalidArgument(f"bitmask must be int32 [{len(states)}, words] on the CPU")
    if not arr.flags["C_CONTIGUOUS"]:
        raise InvalidArgument("bitmask must be contiguous")
    pending = [
        (s, i) for i, s in enumerate(states)
        if s is not None and s.active and s._mask is None and s._dead is None and not s._stopped
    ]
    if len(pending) > 1:
        words = pending[0][0]._words
        if any(s._words != words for s, _ in pending) or arr.shape[1] != words:
            raise InvalidArgument("every grammar in a batch must have the bitmask's width")
        if _EXECUTOR is None:
            _EXECUTOR = llg.LLExecutor()
        jobs = [(s._matcher, i) for s, i in pending]
        _EXECUTOR.unsafe_compute_mask_ptr(jobs, arr.ctypes.data, words * 4, len(states))
        for s, i in pending:
            s._keep_mask(s._finish_mask(s._matcher, arr[i].copy()))  # type: ignore[arg-type]
    out: list[bool] = []
    for i, s in enumerate(states):
        if s is None:
            arr[i].fill(-1)
            out.append(False)
        else:
            out.append(s.fill_bitmask(arr[i]))
    return out
