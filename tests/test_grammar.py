"""The grammar layer on SmolLM2's real vocabulary: constraints, compiling and its cache, the
per-request state (masks, EOS only where accepting, dead ends, bounded whitespace, jump-forward,
start-after, state round trip) and named schemas."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance as llg
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from superslm.errors import FormatError, GrammarError, InvalidArgument
from superslm.formats.gguf import GGUFFile
from superslm.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarState,
    UnknownSchema,
    compiler_for,
    fill_bitmasks,
    load_schemas,
    named_constraint,
)
from superslm.sampling import apply_token_bitmask
from superslm.tokenizer import Tokenizer
from tests.test_grammar_corpus import allowed_ids, random_walk

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return compiler_for(tok)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def mask_of(state: GrammarState) -> np.ndarray:
    row = np.zeros(state.grammar.compiler.bitmask_words, dtype=np.int32)
    state.fill_bitmask(row)
    return row


def text_of(tok: Tokenizer, tokens: list[int]) -> str:
    return b"".join(tok.token_bytes(t) for t in tokens).decode("utf-8")


# --- Constraint ----------------------------------------------------------------------------------


def test_constraint_is_plain_data() -> None:
    a = Constraint.json_schema(PERSON)
    b = Constraint.json_schema(json.dumps(PERSON))
    assert a == b and hash(a) == hash(b)
    assert list(a.schema["properties"]) == ["name", "age"]  # order kept: llguidance follows it
    for c in (a, Constraint.json_object(), Constraint.regex("[a-z]+"), Constraint.lark("start: /x/"),
              Constraint.choice(["yes", "no"])):
        data = json.loads(json.dumps(c.to_dict()))
        assert Constraint.from_dict(data) == c
    assert Constraint.json_schema(PERSON, max_whitespace=4) != a


@pytest.mark.parametrize(
    "make",
    [
        lambda: Constraint("xml", "x"),
        lambda: Constraint.regex(""),
        lambda: Constraint.choice([]),
        lambda: Constraint.choice("yes"),
        lambda: Constraint.choice(["a", 1]),
        lambda: Constraint.json_schema(PERSON, max_whitespace=-1),
        lambda: Constraint.from_dict({"kind": "regex", "value": "a", "extra": 1}),
        lambda: Constraint.from_response_format({"type": "yaml"}),
    ],
)
def test_constraint_rejects_malformed(make) -> None:
    with pytest.raises(InvalidArgument):
        make()


def test_from_response_format() -> None:
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert Constraint.from_response_format(rf) == Constraint.json_schema(PERSON)


# --- compiling -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint.regex("a(b"),
        Constraint.regex("(?=a)b"),
        Constraint.lark("start: undefined_rule"),
        Constraint.lark('start: "a" ('),
        Constraint.json_schema({"type": "strnig"}),
        Constraint.json_schema({"$ref": "#/$defs/missing"}),
        Constraint.json_schema(False),
    ],
)
def test_invalid_inputs_raise_grammar_error(compiler: GrammarCompiler, constraint: Constraint) -> None:
    with pytest.raises(GrammarError):
        compiler.compile(constraint)


def test_schema_text_must_be_json() -> None:
    with pytest.raises(GrammarError):
        Constraint.json_schema("{not json")


def test_compile_cache_by_content(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    assert compiler_for(tok) is compiler  # one compiler (and cache) per tokenizer and width
    first = compiler.compile(Constraint.json_schema(PERSON))
    hits = compiler.hits
    again = compiler.compile(Constraint.json_schema(json.dumps(PERSON)))
    assert again is first and compiler.hits == hits + 1
    other = compiler.compile(Constraint.json_schema(PERSON, max_whitespace=3))
    assert other is not first
    # requests get their own matchers
    a, b = GrammarState(first), GrammarState(first)
    a.accept_many(ids(tok, '{"name'))
    assert not np.array_equal(mask_of(a), mask_of(b))


def test_compile_limits_and_timeout(tok: Tokenizer) -> None:
    tight = GrammarCompiler(tok, limits=llg.LLParserLimits(max_grammar_size=10))
    with pytest.raises(GrammarError, match="too big"):
        tight.compile(Constraint.json_schema(PERSON))
    slow = GrammarCompiler(tok, timeout_s=1e-4)
    big = Constraint.json_schema({"enum": [f"value-{i}-{i * 7919 % 10007}" for i in range(20000)]})
    with pytest.raises(GrammarError, match="did not compile within"):
        slow.compile(big)


def test_padded_vocabulary(tok: Tokenizer) -> None:
    wide = GrammarCompiler(tok, vocab_size=tok.vocab_size + 70)
    assert wide.bitmask_words == (tok.vocab_size + 70 + 31) // 32
    state = GrammarState(wide.compile(Constraint.json_schema(PERSON)))
    for _ in range(6):
        allowed = allowed_ids(mask_of(state))
        assert 0 < allowed.max() < tok.vocab_size  # padding rows are never allowed
        state.accept(int(allowed[0]))


# --- masks, acceptance, dead ends ----------------------------------------------------------------


def test_mask_matches_grammar_and_bitmask_op(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.regex("(cat|dog)s?")))
    row = torch.zeros(compiler.bitmask_words, dtype=torch.int32)
    assert state.fill_bitmask(row)
    allowed = set(allowed_ids(row.numpy()).tolist())
    # independent check: a token is allowed iff its bytes start a sentence of the regex
    expected = {i for i, b in enumerate(tok.all_token_bytes()) if b and any(
        (w.encode()).startswith(b) for w in ("cat", "cats", "dog", "dogs")) and i not in tok.special_ids}
    assert allowed == expected
    logits = torch.randn(1, tok.vocab_size)
    apply_token_bitmask(logits, row[None])
    assert int(logits.argmax()) in allowed and torch.isinf(logits).sum() == tok.vocab_size - len(allowed)


def test_eos_only_where_accepting(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.regex("ab{2,3}")), stop_ids=[1])
    stops = set(tok.stop_ids) | {1}
    seen = []
    for piece in ["a", "b", "b", "b"]:
        allowed = set(allowed_ids(mask_of(state)).tolist())
        seen.append((state.is_accepting, bool(allowed & stops)))
        assert state.accept(ids(tok, piece)[0])
    allowed = set(allowed_ids(mask_of(state)).tolist())
    assert allowed == stops and state.is_finished  # "abbb": only a stop may follow
    assert seen == [(False, False), (False, False), (False, False), (True, True)]
    assert state.accept(tok.eos_id) and state.is_finished and not state.is_dead


def test_stop_token_before_acceptance_is_a_dead_end(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.regex("ab")))
    assert not state.accept(tok.eos_id)
    assert state.is_dead and not mask_of(state).any()


def test_refused_token_is_a_dead_end(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.compile(Constraint.json_schema(PERSON)))
    assert not state.accept(ids(tok, "[")[0])
    assert state.is_dead and state.dead_reason
    assert not mask_of(state).any()  # the engine ends the request with reason "grammar"
    assert not state.accept(ids(tok, "{")[0])


def test_dead_end_when_no_token_fits() -> None:
    backend = Backend(models.WordLevel(vocab={"a": 0, "b": 1, "ab": 2}, unk_token="a"))
    backend.add_special_tokens(["</s>"])
    tiny = Tokenizer(backend, eos_id=3)
    comp = GrammarCompiler(tiny)
    live = GrammarState(comp.compile(Constraint.regex("(a|b)+")))
    assert not live.is_dead and set(allowed_ids(mask_of(live)).tolist()) == {0, 1, 2}
    dead = GrammarState(comp.compile(Constraint.regex("(x|y)z")))  # no token of this vocab fits
    assert dead.is_dead and not mask_of(dead).any()


def test_dead_end_when_the_grammar_gets_too_complex(tok: Tokenizer) -> None:
    comp = GrammarCompiler(tok, limits=llg.LLParserLimits(max_items_in_row=3))
    state = GrammarState(comp.compile(Constraint.json_schema({"type": "object", "properties": {
        f"k{i}": {"type": "string"} for i in range(40)}})))
    state.accept_many(ids(tok, '{"'))
    assert state.is_dead and "max is 3" in state.dead_reason


# --- whitespace ----------------------------------------------------------------------------------


def spaces_accepted(tok: Tokenizer, compiler: GrammarCompiler, constraint: Constraint, cap: int = 300) -> int:
    state = GrammarState(compiler.compile(constraint))
    assert state.accept_many(ids(tok, '{"name":')) == len(ids(tok, '{"name":'))
    space = ids(tok, " ")
    assert len(space) == 1
    n = 0
    while n < cap and space[0] in set(allowed_ids(mask_of(state)).tolist()):
        assert state.accept(space[0])
        n += 1
    return n


def test_whitespace_is_bounded(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    assert spaces_accepted(tok, compiler, Constraint.json_schema(PERSON, max_whitespace=8)) == 8
    assert spaces_accepted(tok, compiler, Constraint.json_schema(PERSON)) == 32
    assert spaces_accepted(tok, compiler, Constraint.json_object(max_whitespace=5)) == 5
    assert spaces_accepted(tok, compiler, Constraint.json_schema(PERSON, max_whitespace=0)) == 0
    assert spaces_accepted(tok, compiler, Constraint.json_schema(PERSON, max_whitespace=None)) == 300
    # a schema's own x-guidance whitespace setting wins
    compact = {"x-guidance": {"whitespace_flexible": False}, **PERSON}
    assert spaces_accepted(tok, compiler, Constraint.json_schema(compact)) == 0


def test_whitespace_cannot_eat_the_token_budget(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    # a "model" that always prefers whitespace still finishes: the walk takes whitespace-only
    # tokens whenever allowed, and the bound forces it on
    state = GrammarState(compiler.compile(Constraint.json_schema({"type": "array", "items": {"type": "integer"},
                                                                   "maxItems": 2})))
    tb = tok.all_token_bytes()
    out: list[int] = []
    for _ in range(400):
        allowed = [int(t) for t in allowed_ids(mask_of(state)) if int(t) not in tok.stop_ids]
        if not allowed:
            break
        ws = [t for t in allowed if tb[t].strip() == b""]
        pick = max(ws, key=lambda t: len(tb[t])) if ws else min(allowed, key=lambda t: (tb[t] != b"]", t))
        assert state.accept(pick)
        out.append(pick)
    assert state.is_accepting
    text = text_of(tok, out)
    assert json.loads(text) == [] and len(text) < 400


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
    state.accept(ids(tok, "]")[0])
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


def test_choice_and_lark(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    options = ["naïve", 'say "hi"', "日本", "x"]
    for seed in range(6):
        state = GrammarState(compiler.compile(Constraint.choice(options)))
        walk = random_walk(state, tok.all_token_bytes(), random.Random(seed))
        assert text_of(tok, walk.tokens) in options
    lark = 'start: "ticket-" NUM ("," NUM)*\nNUM: /[0-9]{2}/'
    state = GrammarState(compiler.compile(Constraint.lark(lark)))
    walk = random_walk(state, tok.all_token_bytes(), random.Random(1))
    import re

    assert re.fullmatch(r"ticket-[0-9]{2}(,[0-9]{2})*", text_of(tok, walk.tokens))


def test_sentencepiece_vocabulary(gemma3_gguf: Path) -> None:
    gemma = Tokenizer.from_gguf(GGUFFile(gemma3_gguf).metadata)
    comp = GrammarCompiler(gemma)
    for seed in range(2):
        state = GrammarState(comp.compile(Constraint.json_schema(PERSON)))
        walk = random_walk(state, gemma.all_token_bytes(), random.Random(seed))
        value = json.loads(text_of(gemma, walk.tokens))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


# --- named schemas -------------------------------------------------------------------------------


def test_load_schemas(tmp_path: Path) -> None:
    assert load_schemas(tmp_path) == {}
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "person.json").write_text(json.dumps(PERSON))
    (tmp_path / "schemas" / "anything.json").write_text("true")
    (tmp_path / "schemas" / "notes.txt").write_text("ignored")
    schemas = load_schemas(tmp_path)
    assert list(schemas) == ["anything", "person"] and schemas["person"] == PERSON
    assert named_constraint("person", schemas) == Constraint.json_schema(PERSON)
    with pytest.raises(UnknownSchema, match="anything, person") as info:
        named_constraint("invoice", schemas)
    assert isinstance(info.value, InvalidArgument) and info.value.code == "unknown_schema"
    (tmp_path / "schemas" / "broken.json").write_text("{")
    with pytest.raises(FormatError):
        load_schemas(tmp_path)
    (tmp_path / "schemas" / "broken.json").write_text("[1, 2]")
    with pytest.raises(FormatError):
        load_schemas(tmp_path)
