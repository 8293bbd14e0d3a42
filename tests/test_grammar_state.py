"""The per-request grammar state on SmolLM2's vocabulary: jump-forward (identical to masked
greedy decoding), start-after, the plain-data round trip, rollback and the batched fill."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from superslm.errors import InvalidArgument
from superslm.formats.gguf import GGUFFile
from superslm.grammar import Constraint, GrammarCompiler, GrammarState, compiler_for, fill_bitmasks
from superslm.sampling import apply_token_bitmask
from superslm.tokenizer import Tokenizer
from tests.test_grammar import PERSON, ids, mask_of, text_of
from tests.test_grammar_corpus import allowed_ids, random_walk


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return compiler_for(tok)

# --- jump-forward --------------------------------------------------------------------------------


def test_forced_tokens_are_the_only_allowed_ones(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"}},
              "required": ["temperature_celsius"], "additionalProperties": False}
    state = GrammarState(compiler.compile(Constraint.json_schema(schema, max_whitespace=0)))
    state.accept(ids(tok, "{")[0])
    peek = state.forced_tokens()
    probe = GrammarState(state.grammar)
    probe.accept(ids(tok, "{")[0])
    for t in peek:  # independent check: each is the single bit of its mask
        assert allowed_ids(mask_of(probe)).tolist() == [t]
        probe.accept(t)
    assert len(allowed_ids(mask_of(probe))) > 1
    taken = state.take_forced()
    assert taken == peek and len(taken) >= 3 and state.num_forced == len(taken)
    assert text_of(tok, ids(tok, "{") + taken).startswith('{"temperature_celsius')
    assert state.forced_tokens() == []


def fake_logits(prefix: list[int], vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(tuple(prefix[-4:])) % (2**31) + len(prefix))
    return torch.randn(1, vocab, generator=gen)


def greedy(state: GrammarState, vocab: int, stops: set[int], jump: bool, n: int = 80) -> list[int]:
    out: list[int] = []
    row = torch.zeros(1, state.grammar.compiler.bitmask_words, dtype=torch.int32)
    while len(out) < n:
        if jump:
            out += state.take_forced(n - len(out))
        state.fill_bitmask(row[0])
        logits = apply_token_bitmask(fake_logits(out, vocab), row)
        token = int(logits.argmax())
        if token in stops:
            break
        assert state.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("schema", [PERSON, {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                               "minItems": 2, "maxItems": 4}])
def test_jump_forward_matches_masked_greedy(tok: Tokenizer, compiler: GrammarCompiler, schema: dict) -> None:
    grammar = compiler.compile(Constraint.json_schema(schema))
    plain = greedy(GrammarState(grammar), tok.vocab_size, set(tok.stop_ids), jump=False)
    jumped_state = GrammarState(grammar)
    jumped = greedy(jumped_state, tok.vocab_size, set(tok.stop_ids), jump=True)
    assert jumped == plain
    assert jumped_state.num_forced > 0


# --- start-after, state round trip, batches ------------------------------------------------------


def test_start_after_token(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    end_think = ids(tok, "\n\n")[0]  # stands in for a reasoning model's </think>
    state = GrammarState(compiler.compile(Constraint.regex("(yes|no)")), after=end_think)
    row = np.zeros(compiler.bitmask_words, dtype=np.int32)
    assert not state.active and not state.fill_bitmask(row) and (row == -1).all()
    assert state.allows_stop and not state.is_accepting and state.forced_tokens() == []
    thinking = ids(tok, "Let me think. Maybe yes, maybe no")
    assert state.accept_many(thinking) == len(thinking) and not state.active
    saved = json.loads(json.dumps(state.state()))
    assert state.accept(end_think) and state.active
    assert state.fill_bitmask(row)
    assert {text_of(tok, [int(t)]) for t in allowed_ids(row)} <= {"y", "ye", "yes", "n", "no"}
    restored = GrammarState.from_state(saved, compiler)
    assert not restored.active and restored.accept(end_think) and np.array_equal(mask_of(restored), row)


def test_state_round_trip(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint.json_schema(PERSON))
    state = GrammarState(grammar, stop_ids=[1])
    walked = random_walk(GrammarState(grammar), tok.all_token_bytes(), random.Random(3))
    prefix = walked.tokens[: len(walked.tokens) // 2]
    assert state.accept_many(prefix) == len(prefix)
    state.take_forced()
    data = json.loads(json.dumps(state.state()))
    restored = GrammarState.from_state(data, compiler)
    assert restored.tokens == state.tokens and restored.num_forced == state.num_forced
    assert restored.extra_stop_ids == (1,)
    assert np.array_equal(mask_of(restored), mask_of(state))
    rest = walked.tokens[len(state.tokens):]
    assert restored.accept_many(rest) == len(rest) and restored.is_accepting
    # a dead state stays dead through the round trip
    state = GrammarState(grammar)
    assert state.accept(ids(tok, "{")[0]) and not state.accept(ids(tok, "]")[0])
    assert GrammarState.from_state(json.loads(json.dumps(state.state())), compiler).is_dead


def test_rollback(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.json_schema(PERSON)))
    state.accept_many(ids(tok, '{"name": "Al'))
    before = mask_of(state).copy()
    state.accept_many(ids(tok, 'ice"'))
    state.rollback(len(ids(tok, 'ice"')))
    assert np.array_equal(mask_of(state), before)
    with pytest.raises(InvalidArgument):
        state.rollback(99)
    # a stop token rolls back too (it never reached llguidance)
    done = GrammarState(compiler.compile(Constraint.regex("ok")))
    assert done.accept_many(ids(tok, "ok") + [tok.eos_id]) == len(ids(tok, "ok")) + 1 and done.is_finished
    done.rollback(1)
    assert done.tokens == ids(tok, "ok") and allowed_ids(mask_of(done)).tolist() == sorted(tok.stop_ids)
    # an errored matcher cannot be rolled back (llguidance keeps its error)
    assert not done.accept(ids(tok, "x")[0])
    with pytest.raises(InvalidArgument, match="errored"):
        done.rollback(1)


def test_fill_bitmasks_batch(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    grammars = [compiler.compile(c) for c in (Constraint.json_schema(PERSON), Constraint.regex("[0-9]{3}"),
                                             Constraint.choice(["left", "right"]))]
    states: list[GrammarState | None] = [GrammarState(g) for g in grammars]
    states[0].accept_many(ids(tok, '{"name":'))  # type: ignore[union-attr]
    states.insert(1, None)
    states.append(GrammarState(grammars[1], after=5))
    twins = [None if s is None else GrammarState.from_state(s.state(), compiler) for s in states]
    bitmask = torch.zeros(len(states), compiler.bitmask_words, dtype=torch.int32)
    flags = fill_bitmasks(states, bitmask)
    assert flags == [True, False, True, True, False]
    for i, twin in enumerate(twins):
        expected = np.full(compiler.bitmask_words, -1, np.int32) if twin is None else mask_of(twin)
        assert np.array_equal(bitmask[i].numpy(), expected)


# --- drafts ------------------------------------------------------------------------------------


def test_drafts_are_cut_where_the_grammar_refuses(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.json_schema(PERSON)))
    state.accept_many(ids(tok, '{"name": "Al'))
    before = list(state.tokens)
    good = ids(tok, 'ice", "age": 4')
    assert state.valid_drafts(good) == len(good)
    assert state.valid_drafts(good + ids(tok, "x")) == len(good)  # an age is digits
    assert state.valid_drafts([tok.eos_id] + good) == 0  # a draft never ends the output
    assert state.valid_drafts(ids(tok, "ice") + [10**9]) == len(ids(tok, "ice"))  # outside the vocabulary
    assert state.tokens == before and not state.is_dead
    # independent check: each kept draft is allowed by the mask of a state that accepted the ones before it
    probe = GrammarState.from_state(state.state(), compiler)
    for t in good:
        assert int(t) in allowed_ids(mask_of(probe)).tolist()
        probe.accept(t)
    waiting = GrammarState(compiler.compile(Constraint.regex("(yes|no)")), after=7)
    assert waiting.valid_drafts([3, 4, 7, 9]) == 2  # cut before the token that starts the constraint


def test_masks_along_drafts_equal_a_state_that_accepted_them(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(Constraint.json_schema(PERSON))
    walked = random_walk(GrammarState(grammar), tok.all_token_bytes(), random.Random(5))
    for cut in range(0, len(walked.tokens) - 1, 3):
        state = GrammarState(grammar)
        state.accept_many(walked.tokens[:cut])
        drafts = walked.tokens[cut : cut + 6]
        drafts = drafts[: state.valid_drafts(drafts)]
        rows = np.zeros((len(drafts) + 1, compiler.bitmask_words), dtype=np.int32)
        state.fill_bitmasks_along(drafts, rows)
        assert state.tokens == walked.tokens[:cut]  # the state did not move
        for j in range(len(drafts) + 1):
            twin = GrammarState(grammar)
            twin.accept_many(walked.tokens[: cut + j])
            assert np.array_equal(rows[j], mask_of(twin)), (cut, j)
        assert np.array_equal(rows[0], mask_of(state))
    # a draft past what the grammar allows leaves no bit in the rows from there
    state = GrammarState(grammar)
    bad = ids(tok, '{"name": 5')
    rows = np.full((len(bad) + 1, compiler.bitmask_words), 7, dtype=np.int32)
    state.fill_bitmasks_along(bad, rows)
    n = state.valid_drafts(bad)
    assert n < len(bad) and not rows[n + 1 :].any() and rows[: n + 1].any(axis=1).all()
    with pytest.raises(InvalidArgument):
        state.fill_bitmasks_along(bad, rows[:2])


def test_forced_draft_spells_what_the_grammar_forces(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"}},
              "required": ["temperature_celsius"], "additionalProperties": False}
    state = GrammarState(compiler.compile(Constraint.json_schema(schema, max_whitespace=0)))
    draft = state.forced_draft(16)
    assert draft and state.valid_drafts(draft) == len(draft) and state.tokens == []
    assert text_of(tok, draft) == '{"temperature_celsius":'  # every byte the grammar forces, the last token too
    assert len(state.forced_draft(2)) == 2
    assert GrammarState(compiler.compile(Constraint.regex("[0-9]+"))).forced_draft(8) == []


def test_one_requests_lexer_error_does_not_end_the_next_ones(tok: Tokenizer) -> None:
    """Matchers copied from a cached template share its lexer, and the lexer's state limit counts them all:
    one request that explored a regex's states to the limit ended every later request of that grammar at its
    first token. The grammar goes stale at such an error; the next compile (and any state started from the
    stale grammar) builds a new template, so the same walk gets as far again."""
    import random

    import llguidance as llg

    from superslm.grammar import GrammarCompiler

    compiler = GrammarCompiler(tok, limits=llg.LLParserLimits(max_lexer_states=20_000, verbose_errors=False))
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    constraint = Constraint.regex("(a|b)*a(a|b){24}")  # a DFA of 2**25 states, built lazily

    def walk(state: GrammarState) -> tuple[int, str | None]:
        rng = random.Random(0)
        for n in range(200_000):
            if state.is_dead or not state.accept(rng.choice([a, b])):
                return n, state.dead_reason
        return n, None

    first = compiler.compile(constraint)
    n, why = walk(GrammarState(first))
    assert why is not None and "states" in why and n > 100
    held = GrammarState(first)  # from the grammar object a queued request holds: built afresh too
    assert walk(held) == (n, why)
    again = compiler.compile(constraint)
    assert again is not first and not again.stale
    assert walk(GrammarState(again)) == (n, why)
