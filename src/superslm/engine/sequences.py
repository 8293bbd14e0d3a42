"""How a request becomes a Sequence: its prompt's ids, sampler, detokenizer, stop checker, grammar walk and
anti-LM, fresh or from a saved state. A mixin of Engine (it uses its fields)."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch

from superslm.engine import persist
from superslm.engine.masks import allowed_row, bad_word_ids
from superslm.engine.request import Request, Sequence
from superslm.errors import GrammarError, InvalidArgument, TokenOutOfRange
from superslm.sampling import SamplerState, Sampling, StopChecker

if TYPE_CHECKING:
    from superslm.engine.engine import Engine


class SequenceMixin:
    """Request checks and Sequence construction for Engine."""

    def _prompt_ids(self: Engine, prompt: object) -> list[int]:
        """Text (encoded with the tokenizer's specials) or integer ids, checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            prompt = prompt.tolist()
        try:
            items = list(prompt)  # type: ignore[call-overload]
        except TypeError:
            items = None
        if items is None or isinstance(prompt, (bytes, bytearray)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items
        ):
            raise InvalidArgument("prompt must be text or a sequence of integer token ids")
        ids = [int(t) for t in items]
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise TokenOutOfRange(f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab})")
        return ids

    def _new_sequence(self: Engine, request: Request, prompt: list[int], state: dict | None = None) -> Sequence:
        """A Sequence with its sampler, detokenizer, stop checker, grammar walk and anti-LM, fresh or
        from a saved state (everything checked before anything is taken)."""
        from superslm.sampling.damped import AntiLM
        from superslm.tokenizer import StreamDecoder

        tok = self.model.tokenizer
        if state is None:
            if request.sampling is not None and not isinstance(request.sampling, Sampling):
                raise InvalidArgument(f"Request.sampling must be a Sampling, not {type(request.sampling).__name__}")
            sampling = (request.sampling or Sampling()).validate(self.vocab)
            if sampling.min_tokens > request.max_tokens:
                raise InvalidArgument(f"min_tokens: {sampling.min_tokens} is more than max_tokens {request.max_tokens}")
            sampler = SamplerState.create(sampling, prompt, rng=self._rng)
            decoder, stops = StreamDecoder(tok), StopChecker(sampling.stop)
            max_tokens = min(request.max_tokens, self.context - len(prompt))
        else:
            sampler = SamplerState.from_state(state["sampler"])
            sampling = sampler.params.validate(self.vocab)
            if sampler.penalties is not None:
                self._prompt_ids(sorted(sampler.penalties.token_ids))  # TokenOutOfRange past the vocabulary
            decoder, stops = StreamDecoder.from_state(tok, state["decoder"]), StopChecker.from_state(state["stops"])
            max_tokens = int(state["max_tokens"])
        request.sampling = sampling
        grammar = None
        constraint = sampling.grammar
        if sampling.schema is not None:
            from superslm.grammar import named_constraint

            constraint = named_constraint(sampling.schema, self.model.schemas())
        if constraint is not None:
            from superslm.grammar import GrammarState, compiler_for

            compiler = compiler_for(tok, self.vocab)
            if state is not None and state.get("grammar") is not None:
                grammar = GrammarState.from_state(state["grammar"], compiler)
            else:
                grammar = GrammarState(compiler.compile(constraint), after=sampling.after,
                                       stop_ids=sampling.stop_token_ids)
                if grammar.active and grammar.is_dead:
                    # llguidance compiles some it cannot run (2,000+ choices, a regex of too many states)
                    raise GrammarError(f"the {constraint.kind} admits no first token: {grammar.dead_reason}")
        anti = None
        if sampling.damped is not None:
            anti = AntiLM.from_state(state["anti"]) if state is not None else AntiLM(sampling.damped.order)
        seq = Sequence(self._next_id, request, prompt, max_tokens, sampler, decoder, stops, grammar, anti)
        if sampling.bad_words:
            seq.bad_words = bad_word_ids(sampling.bad_words, tok)
        if sampling.allowed_token_ids is not None:
            seq.allowed = allowed_row(sampling.allowed_token_ids, -(-self.vocab // 32))
        if state is not None:
            seq.output = [int(t) for t in state["output"]]
            self._prompt_ids(seq.output)
            seq.cached, seq.preemptions = int(state["cached"]), int(state["preemptions"])
            seq.layers_run = int(state["layers_run"])
            seq.prompt_logprobs = persist.prompt_logprobs_from_state(state.get("prompt_logprobs"))
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) != len(prompt):
                raise ValueError("prompt_logprobs do not match the prompt")
        return seq
