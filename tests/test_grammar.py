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
    constraint_from_request,
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
    assert Constraint("regex", "x", 4) == Constraint.regex("x")  # the bound is JSON's only


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


def test_constraint_from_request() -> None:
    assert constraint_from_request() is None
    assert constraint_from_request(guided_regex="[0-9]+") == Constraint.regex("[0-9]+")
    assert constraint_from_request(guided_choice=["a", "b"]) == Constraint.choice(["a", "b"])
    assert constraint_from_request(guided_json=PERSON) == Constraint.json_schema(PERSON)
    assert constraint_from_request(guided_grammar="start: /x/") == Constraint.lark("start: /x/")
    assert constraint_from_request(response_format={"type": "text"}, guided_regex="x") == Constraint.regex("x")
    with pytest.raises(InvalidArgument, match="only one"):
        constraint_from_request(guided_regex="x", guided_choice=["x"])


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
    for bad in (-1, tok.vocab_size):  # an engine bug must not crash the grammar either
        fresh = GrammarState(state.grammar)
        assert not fresh.accept(bad) and fresh.is_dead


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


def test_choice_and_lark(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    options = ["naïve", 'say "hi"', "日本", "x", "del\x7f", "c1\x85"]  # DEL and C1 were a lexer error
    for seed in range(6):
        state = GrammarState(compiler.compile(Constraint.choice(options)))
        walk = random_walk(state, tok.all_token_bytes(), random.Random(seed))
        assert text_of(tok, walk.tokens) in options
    lark = 'start: "ticket-" NUM ("," NUM)*\nNUM: /[0-9]{2}/'
    state = GrammarState(compiler.compile(Constraint.lark(lark)))
    walk = random_walk(state, tok.all_token_bytes(), random.Random(1))
    import re

    assert re.fullmatch(r"ticket-[0-9]{2}(,[0-9]{2})*", text_of(tok, walk.tokens))


def test_gbnf_grammar_is_converted(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no"'
    for seed in range(4):
        walk = random_walk(GrammarState(compiler.compile(Constraint.lark(gbnf))), tok.all_token_bytes(),
                           random.Random(seed))
        assert text_of(tok, walk.tokens) in ("yes.", "no.")
    with pytest.raises(GrammarError):
        compiler.compile(Constraint.lark('root ::= "a" | ('))


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
