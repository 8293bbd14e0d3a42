"""The schema rewrite before llguidance (grammar/rewrite.py), on SmolLM2's real vocabulary: a key spelled
with escapes cannot take a declared name's place, leap seconds only at 23:59:60 UTC, and everything else
a schema admits still admitted. `jsonschema` (with the corpus test's date and time checks) is the judge."""

from __future__ import annotations

import datetime
import json
import random
from pathlib import Path

import jsonschema
import pytest

from superslm.errors import GrammarError
from superslm.formats.gguf import GGUFFile
from superslm.grammar import Constraint, GrammarCompiler
from superslm.grammar.rewrite import for_llguidance, not_in
from superslm.tokenizer import Tokenizer
from tests.test_grammar_corpus import FORMATS, valid_time


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok)


def accepts(tok: Tokenizer, compiler: GrammarCompiler, schema: dict, text: str) -> bool:
    """Whether the compiled grammar takes `text` whole (tokenized as the tokenizer would)."""
    m = compiler.compile(Constraint.json_schema(schema)).new_matcher()
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and not m.is_error() and m.is_accepting()


def valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
    except jsonschema.ValidationError:
        return False
    return True


NUMBER_A = {"type": "object", "properties": {"a": {"type": "number"}}}
SCHEMAS = {
    "open": NUMBER_A,
    "open_required": {**NUMBER_A, "required": ["a"]},
    "additional_schema": {**NUMBER_A, "additionalProperties": {"type": "string"}},
    "required_undeclared": {"type": "object", "required": ["a"], "additionalProperties": {"type": "number"}},
    "nested": {"type": "object", "properties": {"o": NUMBER_A}, "required": ["o"]},
    "all_of": {"allOf": [NUMBER_A, {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    "any_of_beside_keywords": {"type": "object", "properties": {"a": {"type": "number"}},
                               "anyOf": [{"properties": {"b": {"type": "integer"}}}, {"required": ["c"]}]},
    "pattern_properties": {**NUMBER_A, "patternProperties": {"^x": {"type": "boolean"}}},
    "defs": {"$defs": {"n": NUMBER_A}, "type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}},
    # no regex for other keys beside own patterns: these compile with one spelling per string
    "pattern_additional_schema": {**NUMBER_A, "patternProperties": {"^x": {"type": "boolean"}},
                                  "additionalProperties": {"type": "string"}},
    "all_of_patterns": {"allOf": [{**NUMBER_A, "required": ["a"]},
                                  {"type": "object", "patternProperties": {"^x": {"type": "boolean"}}}]},
    "ref_outside_keywords": {"$ref": "#/components/a", "components": {"a": NUMBER_A}},
    "control_name_beside_pattern": {"type": "object", "properties": {"b\n": {"type": "integer"}},
                                    "patternProperties": {"^b": {"type": "string"}}, "additionalProperties": False},
}
TEXTS = [
    '{"a":1}', '{"a":"x"}', '{"\\u0061":"x"}', '{"\\u0061":1}', '{"\\u0041":"x"}', '{"b":"x"}', '{"b":2}',
    '{"b\\n":"x"}', '{"\\u0062":2}', '{"a":1,"\\u0061":"x"}', '{"x1":true}', '{"x1":"x"}', '{"c":1}',
    '{"o":{"a":1}}', '{"o":{"\\u0061":"x"}}', '{"o":{"b":"x"}}', '{"n":{"\\u0061":"x"}}', '{"n":{"a":2}}',
    '{"a":1,"b":2}', '{"a":1,"b":"\\u0061"}', '{"\\u0078":"x"}', '{"x\\u0031":"x"}', '{"b\\u000a":"x"}',
    '{"b\\u000A":"x"}', '{"b\\n":"x"}', '{"b\\n":2}', '{"\\u0063omponents":1}', '{"\\ud83d\\ude00":"x"}',
    '{"\\/":"x"}', '{"a":1,"x":true}',
]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_no_escaped_key_passes_a_declared_names_schema(tok: Tokenizer, compiler: GrammarCompiler, name: str) -> None:
    schema = SCHEMAS[name]
    before = json.dumps(schema)
    taken = [t for t in TEXTS if accepts(tok, compiler, schema, t)]
    assert json.dumps(schema) == before, "the caller's schema is not changed"
    wrong = [t for t in taken if not valid(schema, t)]
    assert not wrong, f"accepted but invalid for {name}: {wrong}"
    # what the rewrite takes away is only non-canonical spellings of keys: every text that is valid and
    # writes its keys as json.dumps would is still accepted
    canonical = [t for t in TEXTS if valid(schema, t) and "\\u00" not in t.split(":")[0]
                 and all(json.dumps(k) in t for k in json.loads(t))]
    refused = [t for t in canonical if t not in taken and "\\u" not in t]
    assert not refused, f"valid texts refused for {name}: {refused}"


def test_the_escaped_declared_name_is_refused(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    # the exact bypass: before the rewrite llguidance took it
    assert not accepts(tok, compiler, NUMBER_A, '{"\\u0061":"x"}')
    assert accepts(tok, compiler, NUMBER_A, '{"b":"x"}')
    assert accepts(tok, compiler, NUMBER_A, '{"a":1.5,"zz":[1,{"q":null}]}')


def test_not_in_matches_every_other_string(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    names = frozenset({"a", "ab", "id", "", "é", "x.y", "\n"})
    constraint = Constraint.regex(not_in(names))  # Rust regex syntax: llguidance's own engine judges it
    rng = random.Random(0)
    alphabet = "abidxy.é\n\""
    texts = set(names) | {"b", "aa", "abc", "i", "x", "x.", "x.yz", "éé"}
    texts |= {"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(60)}
    for text in sorted(texts - {""}):
        m = compiler.compile(constraint).new_matcher()
        ok = bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()
        assert ok == (text not in names), repr(text)
    m = compiler.compile(constraint).new_matcher()
    assert not m.is_accepting(), "the empty name is one of the names"


@pytest.mark.parametrize("fmt", ["time", "date-time"])
def test_leap_seconds_only_at_2359_utc(tok: Tokenizer, compiler: GrammarCompiler, fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    rng = random.Random(1)
    cases = ["23:59:60Z", "23:59:60+00:00", "23:59:60.25-00:00", "15:59:60-08:00", "01:29:60+01:30",
             "23:29:60+23:30", "12:00:60Z", "22:59:60Z", "23:58:60Z", "23:59:60+01:00", "00:59:60+01:00",
             "23:59:61Z", "23:59:59Z", "00:00:00z", "24:00:00Z", "12:00:00+24:00"]
    for _ in range(40):  # random offsets, and the one local time each makes a leap second
        off = rng.randrange(-1439, 1440)
        local = (23 * 60 + 59 + off) % 1440
        sign = "+" if off >= 0 else "-"
        hm = f"{abs(off) // 60:02d}:{abs(off) % 60:02d}"
        cases.append(f"{local // 60:02d}:{local % 60:02d}:60{sign}{hm}")
        cases.append(f"{(local + 1) % 1440 // 60:02d}:{(local + 1) % 60:02d}:60{sign}{hm}")
    prefix = "2016-12-31T" if fmt == "date-time" else ""
    for c in cases:
        text = json.dumps(prefix + c)
        assert accepts(tok, compiler, schema, text) == valid_time(c), c
        assert valid_time(c) == valid(schema, text), c


@pytest.mark.parametrize("fmt", ["date", "date-time"])
def test_dates_by_the_calendar(tok: Tokenizer, compiler: GrammarCompiler, fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    for date in ["2024-02-29", "2000-02-29", "1900-02-29", "2023-02-29", "2023-04-31", "2023-12-31", "0000-01-01",
                 "0001-01-01", "9999-12-31", "2023-13-01", "2023-00-10"]:
        try:
            ok = datetime.date.fromisoformat(date) is not None
        except ValueError:
            ok = False
        text = date if fmt == "date" else date + "T10:00:00Z"
        assert accepts(tok, compiler, schema, json.dumps(text)) == ok, date
        assert valid(schema, json.dumps(text)) == ok, date


def test_format_beside_a_pattern_is_both(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    schema = {"type": "string", "format": "time", "pattern": "^1"}
    assert accepts(tok, compiler, schema, '"12:00:00Z"')
    assert not accepts(tok, compiler, schema, '"22:00:00Z"')
    assert not accepts(tok, compiler, schema, '"12:00:60Z"')


def test_overlapping_patterns_fall_back(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    # the same property in two allOf branches, each an object with names: llguidance merges the two and
    # refuses overlapping pattern properties, so this schema compiles without the key rewrite
    schema = {"allOf": [{"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {}}}}},
                        {"type": "object", "properties": {"p": {"type": "object", "properties": {"y": {}}}}}]}
    assert accepts(tok, compiler, schema, '{"p":{"x":1,"y":2}}')
    rewritten = for_llguidance(schema)
    assert "patternProperties" in json.dumps(rewritten)
    assert "patternProperties" not in json.dumps(for_llguidance(schema, keys=False))


def _candidates(rng: random.Random, n: int) -> list[str]:
    """Object texts whose keys are spelled every way JSON allows: raw, \\u escapes of either case, \\/,
    surrogate pairs, short escapes; values of every type the schemas below care about."""
    spellings = {"a": ["a", "\\u0061", "\\u0041"], "x": ["x", "\\u0078", "\\u0058"], "1": ["1", "\\u0031"],
                 "b": ["b", "\\u0062"], "\n": ["\\n", "\\u000a", "\\u000A"], "/": ["/", "\\/", "\\u002f"],
                 "😀": ["😀", "\\ud83d\\ude00"], "é": ["é", "\\u00e9"], "o": ["o", "\\u006f"]}
    values = ["1", "2.5", '"s"', "true", "null", '{"a":1}', '{"a":"s"}', '{"\\u0061":"s"}', "[]"]
    names = ["a", "x", "x1", "b", "b\n", "o", "/", "😀", "é", "ab"]
    out = []
    for _ in range(n):
        pairs = []
        for _ in range(rng.randrange(0, 3)):
            key = "".join(rng.choice(spellings[c]) for c in rng.choice(names))
            pairs.append(f'"{key}":{rng.choice(values)}')
        out.append("{" + ",".join(pairs) + "}")
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_texts_the_grammar_takes_are_valid(tok: Tokenizer, compiler: GrammarCompiler, name: str) -> None:
    # accepted => valid, judged by jsonschema on the decoded object, over keys spelled every way
    schema = SCHEMAS[name]
    texts = _candidates(random.Random(name), 120)
    wrong = [t for t in texts if accepts(tok, compiler, schema, t) and not valid(schema, t)]
    assert not wrong, f"accepted but invalid for {name}: {wrong[:5]}"


def test_one_spelling_only_where_no_pattern_can_be_written() -> None:
    # the common shapes keep \\u escapes in values; the others lose them everywhere (rewrite.py's doc)
    assert "x-guidance" not in for_llguidance(SCHEMAS["open"])
    assert "x-guidance" not in for_llguidance(SCHEMAS["all_of"])
    for name in ("pattern_properties", "pattern_additional_schema", "ref_outside_keywords"):
        assert for_llguidance(SCHEMAS[name])["x-guidance"] == {"json_allowed_escapes": 'nrbtf\\"'}
    own = {**SCHEMAS["pattern_properties"], "x-guidance": {"whitespace_flexible": False}}
    assert for_llguidance(own)["x-guidance"] == {"whitespace_flexible": False, "json_allowed_escapes": 'nrbtf\\"'}
    assert "x-guidance" in for_llguidance(NUMBER_A, keys=False)


def test_property_names_is_refused(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    # llguidance does not implement propertyNames: such a schema is an error, never a looser grammar
    with pytest.raises(GrammarError, match="propertyNames"):
        compiler.compile(Constraint.json_schema({"type": "object", "propertyNames": {"pattern": "^a"}}))


def test_lark_json_items_are_exact_too(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    """A Lark grammar's `%json` schemas get the same rewrite (escaped keys meet the declared name's schema) and the
    same x-guidance check as a json_schema constraint; `%json` inside a literal, a regex or a comment is text."""
    lark = 'start: "x=" obj | "%json {}" | /z%json 1/ // %json {"type": "string"}\nobj: %json ' + json.dumps(NUMBER_A)
    grammar = compiler.compile(Constraint.lark(lark))
    for text in ('x={"a": 1}', 'x={"\\u0061": "s"}', 'x={"b": "s"}', "%json {}", "z%json 1"):
        m = grammar.new_matcher()
        ok = bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()
        want = not text.startswith("x=") or valid(NUMBER_A, text[2:])
        assert ok == want, text
    with pytest.raises(GrammarError, match="x-guidance"):
        compiler.compile(Constraint.lark('start: %json {"x-guidance": {"lenient": true}, "type": "object"}'))


@pytest.mark.parametrize("name", ["open", "all_of", "all_of_patterns", "pattern_additional_schema", "defs"])
def test_no_escaped_key_passes_through_lark_json(tok: Tokenizer, compiler: GrammarCompiler, name: str) -> None:
    """The same schemas embedded in a Lark grammar (as tool calls are): what is admitted is valid, merged
    patterns included (compiled without the key rewrite, as a json_schema constraint is)."""
    grammar = compiler.compile(Constraint.lark("start: %json " + json.dumps(SCHEMAS[name])))
    for text in TEXTS:
        m = grammar.new_matcher()
        ok = bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()
        assert not ok or valid(SCHEMAS[name], text), (name, text)
