"""Tool calls: parsing each model format back into OpenAI tool_calls, and the grammars that force
"required" and named calls (walked on SmolLM2's vocabulary, parsed back, validated)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from superslm.errors import InvalidArgument
from superslm.formats.gguf import GGUFFile
from superslm.grammar import (
    GrammarState,
    chosen_tools,
    compiler_for,
    detect_tool_format,
    parse_tool_calls,
    tool_call_constraint,
    tool_call_start,
)
from superslm.grammar.tool_grammar import _literal
from superslm.tokenizer import Tokenizer
from tests.test_grammar_corpus import random_walk

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                       "required": ["tz"], "additionalProperties": False},
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NOARGS]


def args(call: dict) -> dict:
    return json.loads(call["arguments"])


# --- parsing -------------------------------------------------------------------------------------


def test_hermes_single_and_parallel() -> None:
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "I will check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Paris"} and args(calls[1]) == {"tz": "CET"}
    assert all(isinstance(c["arguments"], str) for c in calls)


def test_hermes_edge_cases() -> None:
    # unclosed last block (the model stopped at EOS), no content
    content, calls = parse_tool_calls('<tool_call>\n{"name": "ping", "arguments": {}}', TOOLS)
    assert content is None and calls == [{"name": "ping", "arguments": "{}"}]
    # a broken block and an unknown tool stay in the content as written
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])
    text = '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, [])
    # without tools any name counts
    assert parse_tool_calls(text)[1] == [{"name": "launch_rocket", "arguments": "{}"}]
    # arguments double-encoded as a JSON string are kept as that string
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert args(parse_tool_calls(text, TOOLS)[1][0]) == {"tz": "UTC"}


def test_llama3_json() -> None:
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
                                      TOOLS)
    assert content is None and calls[0]["name"] == "get_weather"
    assert args(calls[0]) == {"city": "Oslo", "unit": "celsius"}
    text = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "ping", "parameters": {}}'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content is None and [c["name"] for c in calls] == ["get_time", "ping"]
    assert parse_tool_calls(text, TOOLS, format="llama3") == (content, calls)


def test_generic_json_fallback() -> None:
    fenced = 'Sure:\n```json\n{"name": "get_time", "arguments": {"tz": "JST"}}\n```'
    content, calls = parse_tool_calls(fenced, TOOLS)
    assert content == "Sure:" and args(calls[0]) == {"tz": "JST"}
    wrapped = '{"tool_calls": [{"function": {"name": "ping", "arguments": "{}"}}, ' \
              '{"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}'
    assert [c["name"] for c in parse_tool_calls(wrapped, TOOLS)[1]] == ["ping", "get_time"]
    listed = '[{"name": "ping", "arguments": {}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]'
    assert len(parse_tool_calls(listed, TOOLS)[1]) == 2
    embedded = 'Calling now {"name": "ping", "arguments": {}} and done.'
    assert parse_tool_calls(embedded, TOOLS) == ("Calling now  and done.", [{"name": "ping", "arguments": "{}"}])


def test_plain_answers_are_content() -> None:
    for text in ["The weather in Paris is mild.", '{"city": "Paris", "temp": 21}',
                 '{"name": "Alice", "age": 3}', "[1, 2, 3]", ""]:
        content, calls = parse_tool_calls(text, TOOLS)
        assert calls == [] and content == (text.strip() or None)
    with pytest.raises(InvalidArgument):
        parse_tool_calls("x", TOOLS, format="xml")  # type: ignore[arg-type]


def test_tool_call_start_for_streaming() -> None:
    assert tool_call_start("The answer is 4.") is None
    assert tool_call_start("Let me check.<tool_call>\n{") == len("Let me check.")
    assert tool_call_start("Let me check.<tool") == len("Let me check.")  # a tag cut by the stream
    assert tool_call_start("a < b") is None
    assert tool_call_start('  {"name": "ping"') == 2
    assert tool_call_start("<|python_tag|>{") == 0
    # everything before the start is content the parser agrees on
    text = 'Checking.<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, TOOLS)[0] == text[: tool_call_start(text)].strip()


# --- forcing a call ------------------------------------------------------------------------------


def test_chosen_tools() -> None:
    assert chosen_tools(TOOLS, "auto") is None and chosen_tools(TOOLS, "none") is None
    assert chosen_tools(TOOLS, None) is None
    assert [f["name"] for f in chosen_tools(TOOLS, "required")] == ["get_weather", "get_time", "ping"]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert [f["name"] for f in chosen_tools(TOOLS, named)] == ["get_time"]
    for bad in ({"type": "function", "function": {"name": "nope"}}, "nope", 3):
        with pytest.raises(InvalidArgument):
            chosen_tools(TOOLS, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        chosen_tools([], "required")


def test_detect_tool_format() -> None:
    assert detect_tool_format("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}") == "hermes"
    assert detect_tool_format('{"name": function name, "parameters": dictionary of argument name}') == "llama3"
    assert detect_tool_format("<|python_tag|>{{ call }}") == "llama3"
    assert detect_tool_format(None) == "json"


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)


SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


@pytest.mark.parametrize("style", ["hermes", "llama3", "json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_call_parses_and_validates(tok: Tokenizer, style: str, choice: object) -> None:
    constraint = tool_call_constraint(TOOLS, choice, style=style)  # type: ignore[arg-type]
    assert constraint is not None and tool_call_constraint(TOOLS, "auto", style=style) is None  # type: ignore[arg-type]
    grammar = compiler_for(tok).compile(constraint)
    names = set()
    for seed in range(5):
        walk = random_walk(GrammarState(grammar), tok.all_token_bytes(), random.Random(seed))
        assert walk.finished
        text = b"".join(tok.token_bytes(t) for t in walk.tokens).decode("utf-8")
        content, calls = parse_tool_calls(text, TOOLS, format=style)  # type: ignore[arg-type]
        assert calls and content is None, text
        for call in calls:
            jsonschema.validate(args(call), SCHEMAS[call["name"]])
            names.add(call["name"])
        if choice != "required":
            assert [c["name"] for c in calls] == ["get_time"]
    assert names


def test_hermes_parallel_flag(tok: Tokenizer) -> None:
    many = tool_call_constraint(TOOLS, "required", style="hermes")
    one = tool_call_constraint(TOOLS, "required", style="hermes", parallel=False)
    assert many is not None and one is not None
    two_calls = ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    for constraint, accepted in ((many, True), (one, False)):
        state = GrammarState(compiler_for(tok).compile(constraint))
        n = state.accept_many(tok.encode(two_calls, add_special_tokens=False))
        assert (n == len(tok.encode(two_calls, add_special_tokens=False)) and state.is_accepting) == accepted


def test_special_token_literal(tok: Tokenizer) -> None:
    assert _literal("<|im_start|>", tok) == f"<[{tok.token_to_id('<|im_start|>')}]>"
    assert _literal("<tool_call>", tok) == '"<tool_call>"'  # not a token of SmolLM2: plain text
    assert _literal("<tool_call>", None) == '"<tool_call>"'


LOCATED = {"type": "function", "function": {"name": "locate", "parameters": {
    "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"],
    "additionalProperties": False,
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                         "zip": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["city", "zip"], "additionalProperties": False}}}}}  # fmt: skip
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"},
                                                                         "maxItems": 2}},
    "required": ["v", "kids"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize("style", ["hermes", "json"])
def test_forced_call_with_refs_in_parameters(tok: Tokenizer, style: str) -> None:
    """Pydantic-style parameters ($defs and "#/$defs/..."), and a recursive "#": refs resolve inside the tool's
    own schema, not the call wrapper's (the $defs one was refused, the recursive one took the wrapper as "#")."""
    tools = [LOCATED, TREE]
    grammar = compiler_for(tok).compile(tool_call_constraint(tools, "required", style=style, parallel=False))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(6):
        walk = random_walk(GrammarState(grammar), tok.all_token_bytes(), random.Random(seed))
        text = b"".join(tok.token_bytes(t) for t in walk.tokens).decode("utf-8")
        _, calls = parse_tool_calls(text, tools, format=style)  # type: ignore[arg-type]
        assert len(calls) == 1, text
        jsonschema.validate(args(calls[0]), schemas[calls[0]["name"]])
    call = '{"name": "tree", "arguments": {"v": 1, "kids": [KID]}}'
    wrap = "<tool_call>\n{}\n</tool_call>" if style == "hermes" else "{}"
    for kid, ok in (('{"v": 2, "kids": []}', True), ('{"name": "tree", "arguments": {"v": 2, "kids": []}}', False)):
        ids = tok.encode(wrap.format(call.replace("KID", kid)), add_special_tokens=False)
        state = GrammarState(grammar)
        assert (state.accept_many(ids) == len(ids) and state.is_accepting) == ok, kid


def test_forced_call_with_an_id_keeps_its_refs(tok: Tokenizer) -> None:
    """Parameters with an $id are a resource of their own: their "#/$defs/..." resolve against it wherever they sit
    (rebasing them under the wrapper's $defs made llguidance look for a path that is not there)."""
    params = {"$id": "urn:args", "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
              "additionalProperties": False, "$defs": {"A": {"type": "integer", "maximum": 5}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}, LOCATED]
    grammar = compiler_for(tok).compile(tool_call_constraint(tools, "required", style="json"))
    for text, ok in (('{"name": "f", "arguments": {"a": 3}}', True), ('{"name": "f", "arguments": {"a": "x"}}', False)):
        ids = tok.encode(text, add_special_tokens=False)
        state = GrammarState(grammar)
        assert (state.accept_many(ids) == len(ids) and state.is_accepting) == ok, text


OPEN_ARGS = {"type": "function", "function": {"name": "put", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}}, "required": ["b"]}}}  # fmt: skip


@pytest.mark.parametrize("style", ["hermes", "llama3", "json"])
def test_escaped_keys_cannot_dodge_a_parameter_schema(tok: Tokenizer, style: str) -> None:
    """Arguments whose other keys are open: a key spelled `\\u0061` decodes to "a" and must meet a's schema, in
    every call format (the Lark one embeds the schema with %json); jsonschema on the decoded arguments judges."""
    grammar = compiler_for(tok).compile(tool_call_constraint([OPEN_ARGS], "required", style=style, parallel=False))
    params = OPEN_ARGS["function"]["parameters"]
    key = "parameters" if style == "llama3" else "arguments"
    wrap = "<tool_call>\n{}\n</tool_call>" if style == "hermes" else "{}"
    # escaped keys narrow to one spelling (never wrongly admitted); canonical valid arguments all pass
    for arguments in ('{"b": 1, "\\u0061": "x"}', '{"b": "\\u0061", "a": 2.5}', '{"b": 1, "c": "x"}',
                      '{"b": 1, "a": "x"}', '{"a": 1}', '{"b": [], "c": {"a": "x"}}'):
        call = f'{{"name": "put", "{key}": {arguments}}}'
        ids = tok.encode(wrap.format(call), add_special_tokens=False)
        state = GrammarState(grammar)
        accepted = state.accept_many(ids) == len(ids) and state.is_accepting
        try:
            jsonschema.validate(json.loads(arguments), params)
            valid = True
        except jsonschema.ValidationError:
            valid = False
        # escapes may narrow to fewer spellings, never admit what the schema refuses
        assert accepted == valid if "\\" not in arguments else accepted <= valid, (style, arguments)
