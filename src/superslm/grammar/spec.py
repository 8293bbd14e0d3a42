"""`Constraint`: what a request's output must match, as plain data.

A constraint is one of five kinds: a JSON schema, any JSON object, a regex, a Lark grammar (in
llguidance's dialect) or a choice among literal strings. It is frozen, hashable and serialises with
`to_dict()` / `from_dict()`, so it can ride on `Sampling` and in saved request state; compiling it
against a tokenizer is `GrammarCompiler.compile`'s job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from superslm.errors import GrammarError, InvalidArgument
from superslm.grammar.rewrite import for_llguidance, lark_json_bodies

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark", "choice"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark", "choice")

#: default bound on one run of JSON whitespace (between two JSON tokens): room for pretty printing a
#: few levels deep, but a model stuck on spaces or newlines must move on after this many
DEFAULT_MAX_WHITESPACE = 32
#: the largest whitespace bound accepted (a regex counted repetition; larger is pointless)
MAX_WHITESPACE_LIMIT = 1000

# JSON's four whitespace characters (RFC 8259), as a regex class
_JSON_WS = r"[\x20\x0A\x0D\x09]"
# x-guidance keys that decide whitespace
_WS_KEYS = {"whitespace_flexible", "whitespace_pattern"}


# one item of a whitespace pattern: an escape of a JSON whitespace character, a literal space, a class
# bracket, a group, an alternation or a quantifier (digits only inside {m,n})
_WS_ITEM = re.compile(r"\\[nrt]|\\x(?:20|0[aAdD9])|\\u00(?:20|0[aAdD9])| |[\[\]()|*+?]|\{\d{1,4}(?:,\d{0,4})?\}")


def check_x_guidance(options: Any) -> None:
    """A schema's own "x-guidance" options: whitespace settings only, and a pattern that can only match JSON
    whitespace (GrammarError otherwise). Its other options (separators, `lenient`, which drops the keywords
    llguidance does not know) would let a schema's output be invalid JSON or break its own schema."""
    if not isinstance(options, dict):
        raise GrammarError("x-guidance must be an object")
    other = sorted(set(options) - _WS_KEYS)
    if other:
        raise GrammarError(f"x-guidance: only whitespace_flexible and whitespace_pattern are accepted, not {other}")
    if "whitespace_flexible" in options and not isinstance(options["whitespace_flexible"], bool):
        raise GrammarError("x-guidance.whitespace_flexible must be true or false")
    pattern = options.get("whitespace_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) > 200 or _WS_ITEM.sub("", pattern):
            raise GrammarError("x-guidance.whitespace_pattern may only match JSON whitespace (spaces, \\n, \\r, "
                               "\\t in classes, groups and quantifiers)")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint (build it with the class methods, e.g. `Constraint.regex(...)`).

    Fields are plain values so the object is hashable and its `to_dict()` is JSON-ready: a JSON
    schema is kept as its compact JSON text (property order matters: llguidance generates
    properties in schema order), a choice as a tuple of strings.
    """

    kind: ConstraintKind
    """"json_schema", "json_object", "regex", "lark" or "choice"."""
    value: str | tuple[str, ...] | None = None
    """The schema's JSON text, the regex, the Lark grammar, the choices; None for json_object."""
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
    """JSON kinds only: longest run of whitespace between JSON tokens; 0 means compact JSON,
    None unbounded (llguidance's default). Always None for regex, lark and choice."""

    thinking: str = ""
    """"open": the answer starts inside a thinking block (the prompt opened `<think>`), so free text up to
    `</think>` comes before what the constraint describes; "optional": the answer may open such a block
    first; "": no thinking."""

    def __post_init__(self) -> None:
        if self.thinking not in THINKING_MODES:
            raise InvalidArgument(f"thinking must be one of {THINKING_MODES}, got {self.thinking!r}")
        if self.kind not in KINDS:
            raise InvalidArgument(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        value = self.value
        if self.kind == "json_object":
            if value is not None:
                raise InvalidArgument("a json_object constraint takes no value")
        elif self.kind == "json_schema":
            object.__setattr__(self, "value", _schema_text(value))
        elif self.kind == "choice":
            object.__setattr__(self, "value", _choices(value))
        elif not isinstance(value, str) or not value:
            raise InvalidArgument(f"a {self.kind} constraint needs a non-empty string, got {value!r}")
        if not self.is_json:
            object.__setattr__(self, "max_whitespace", None)  # JSON only: equal grammars compare equal
        ws = self.max_whitespace
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or not 0 <= ws <= MAX_WHITESPACE_LIMIT):
            raise InvalidArgument(f"max_whitespace must be None or an int in [0, {MAX_WHITESPACE_LIMIT}], got {ws!r}")

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | bool | str, *, max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
    ) -> Constraint:
        """Output must be JSON valid for `schema` (a dict, `true`, or its JSON text)."""
        return cls("json_schema", schema, max_whitespace)  # type: ignore[arg-type]

    @classmethod
    def json_object(cls, *, max_whitespace: int | None = DEFAULT_MAX_WHITESPACE) -> Constraint:
        """Output must be a JSON object (any keys and values): OpenAI's {"type": "json_object"}."""
        return cls("json_object", None, max_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output must match `pattern` in full (Rust `regex` syntax; no look-around or backrefs)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Output must be derivable from `grammar`'s `start` rule (llguidance's Lark dialect; a
        GBNF grammar, llama.cpp's `root ::= ...`, is converted when compiled)."""
        return cls("lark", grammar)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Output must be exactly one of `options`."""
        return cls("choice", options)  # type: ignore[arg-type]

    # --- views --------------------------------------------------------------------------------

    @property
    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as data (json_object: {"type": "object"}); None for other kinds."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind == "json_schema":
            return json.loads(self.value)  # type: ignore[arg-type]
        return None

    @property
    def is_json(self) -> bool:
        """True for json_schema and json_object (their output parses as JSON)."""
        return self.kind in ("json_schema", "json_object")

    def after_thinking(self, mode: str) -> Constraint:
        """This constraint after a model's thinking block (see `thinking`)."""
        return replace(self, thinking=mode)

    def grammar(self, canonical_keys: bool = True) -> str:
        """This constraint as an llguidance grammar: JSON text, or Lark text for a plain Lark grammar (see
        `_grammar`), after the thinking block its `thinking` mode allows."""
        answer = self._grammar(canonical_keys)
        return answer if not self.thinking else thinking_first(answer, self.thinking == "open")

    def _grammar(self, canonical_keys: bool = True) -> str:
        """This constraint as an llguidance grammar (its JSON text; no tokenizer involved). A JSON schema
        is rewritten first (grammar/rewrite.py: exact leap seconds and, with `canonical_keys`, additional
        keys that cannot spell a declared name with escapes).

        Raises GrammarError where the value cannot even be turned into a grammar request (a schema
        llguidance's front end rejects outright); most errors surface when compiling.
        """
        from llguidance import LLMatcher  # kept local: spec stays importable for plain-data use

        if self.is_json:
            schema = self.schema
            if schema is False:
                raise GrammarError("invalid json_schema: the schema `false` admits no value")
            if schema is True:
                schema = {}  # same meaning, and llguidance applies options to objects only
            own = schema.get("x-guidance") if isinstance(schema, dict) else None
            if own is not None:
                check_x_guidance(own)
            # a schema's own whitespace setting wins (our pattern would override its
            # whitespace_flexible, as llguidance ranks a pattern above the flag)
            ours = {} if isinstance(own, dict) and own.keys() & _WS_KEYS else self.json_options()
            try:
                text = json.dumps(for_llguidance(schema, canonical_keys))
                return LLMatcher.grammar_from_json_schema(text, defaults=ours)  # type: ignore[arg-type]
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}") from e
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)  # type: ignore[arg-type]
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(exact_json_items(_as_lark(self.value), canonical_keys))  # type: ignore[arg-type]
        return LLMatcher.grammar_from_lark(choice_lark(self.value))  # type: ignore[arg-type]

    def json_options(self) -> dict[str, Any]:
        """llguidance JSON compile options carrying the whitespace bound (a schema's own
        "x-guidance" key overrides them)."""
        if self.max_whitespace is None:
            return {}
        if self.max_whitespace == 0:
            return {"whitespace_flexible": False}
        # the pattern is matched at most once where JSON allows whitespace, so the bound holds
        return {"whitespace_pattern": f"{_JSON_WS}{{1,{self.max_whitespace}}}"}

    def key(self) -> str:
        """A string naming the content exactly (the compile cache's key)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    # --- plain data ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data: {"kind", "value", "max_whitespace"} (a choice's value as a list)."""
        value: Any = list(self.value) if isinstance(self.value, tuple) else self.value
        out = {"kind": self.kind, "value": value, "max_whitespace": self.max_whitespace}
        if self.thinking:
            out["thinking"] = self.thinking
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Constraint:
        """Rebuild from `to_dict()` output (unknown keys raise InvalidArgument)."""
        unknown = set(data) - {"kind", "value", "max_whitespace", "thinking"}
        if unknown:
            raise InvalidArgument(f"unknown constraint fields: {sorted(unknown)}")
        if "kind" not in data:
            raise InvalidArgument("a constraint needs a kind")
        return cls(data["kind"], data.get("value"), data.get("max_whitespace", DEFAULT_MAX_WHITESPACE),
                   data.get("thinking", ""))

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> Constraint | None:
        """The constraint of an OpenAI `response_format` ({"type": "text" | "json_object" |
        "json_schema", "json_schema": {"name", "schema", "strict"}}); None for text or None."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise InvalidArgument("response_format must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping):
                raise InvalidArgument("response_format.json_schema must be an object")
            # OpenAI names it "schema"; some clients send "json_schema" or nothing (any JSON)
            schema = spec.get("schema", spec.get("json_schema", {"type": "object"}))
            return cls.json_schema(schema)
        raise InvalidArgument(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


THINKING_MODES = ("", "open", "optional")
#: the tags of a thinking block (Qwen3, DeepSeek-R1 and their kind)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _escaped(c: str) -> str:
    return "\\" + c if c in "\\/^$.|?*+()[]{}-" else c


def never_containing(word: str) -> str:
    """A regex (llguidance's syntax) of every string that does not contain `word`, whose first character
    appears nowhere else in it: runs of other characters, and at each occurrence of the first one a partial
    `word` that ends where the next character breaks it (or where another first character, or the end, comes)."""
    first = word[0]
    if first in word[1:] or len(word) < 2:
        raise ValueError(f"{word!r}: its first character must not recur")

    def level(j: int) -> str:
        stop = f"[^{_escaped(word[j])}{_escaped(first)}][^{_escaped(first)}]*"
        return f"(|{stop})" if j == len(word) - 1 else f"(|{stop}|{_escaped(word[j])}{level(j + 1)})"

    return f"[^{_escaped(first)}]*({_escaped(first)}{level(1)})*"


def thinking_first(answer: str, opened: bool) -> str:
    """llguidance's grammar of a thinking block (free text without its closing tag, then the tag and a few
    spaces or newlines), required (`opened`: the prompt opened it) or optional, then the grammar `answer`."""
    top = json.loads(answer) if answer.lstrip().startswith("{") else {"grammars": [{"lark_grammar": answer}]}
    grammars = top["grammars"]
    name = grammars[0].get("name") or "answer"
    grammars[0]["name"] = name
    thought = never_containing(THINK_CLOSE) + _escaped_all(THINK_CLOSE) + "[ \\n]{0,4}"
    if opened:
        lark = f"start: THINK @{name}\nTHINK: /{thought}/"
    else:
        lark = f"start: THINK? @{name}\nTHINK: /[ \\n]{{0,4}}{_escaped_all(THINK_OPEN)}{thought}/"
    top["grammars"] = [{"name": "thinking", "lark_grammar": lark}, *grammars]
    return json.dumps(top)


def _escaped_all(text: str) -> str:
    return "".join(_escaped(c) for c in text)


def _as_lark(text: str) -> str:
    """A grammar in Lark syntax: GBNF (llama.cpp's, as vLLM's guided_grammar may carry) converted."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises plain exceptions on malformed GBNF
        raise GrammarError(f"invalid grammar: {e}") from e


def exact_json_items(lark: str, canonical_keys: bool = True) -> str:
    """`lark` with each `%json` schema checked and rewritten as a json_schema constraint's is: its own
    "x-guidance" limited to whitespace settings (GrammarError otherwise), its keys matched by decoded text
    and its times exact (grammar/rewrite.py)."""
    parts, last = [], 0
    for start, end, schema in lark_json_bodies(lark):
        own = schema.get("x-guidance") if isinstance(schema, dict) else None
        if own is not None:
            check_x_guidance(own)
        parts += [lark[last:start], json.dumps(for_llguidance(schema, canonical_keys), ensure_ascii=False)]
        last = end
    return "".join(parts) + lark[last:]


def choice_lark(options: Sequence[str]) -> str:
    """A Lark grammar matching exactly one of `options` (JSON string escapes are Lark's too; DEL and the C1
    controls, which JSON leaves raw and llguidance's lexer refuses, escaped as \\uXXXX)."""
    def literal(o: str) -> str:
        return "".join(f"\\u{ord(c):04x}" if 0x7F <= ord(c) <= 0x9F else c for c in json.dumps(o, ensure_ascii=False))

    return "start: " + " | ".join(literal(o) for o in options)


def constraint_from_request(
    *,
    response_format: Mapping[str, Any] | None = None,
    guided_json: Mapping[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_grammar: str | None = None,
    guided_choice: Sequence[str] | None = None,
) -> Constraint | None:
    """The one constraint an OpenAI / vLLM request body asks for, or None.

    `response_format` as OpenAI has it; `guided_*` as vLLM's extra body fields (`guided_grammar`
    is Lark or GBNF). Raises InvalidArgument when more than one is given.
    """
    given = {
        "response_format": Constraint.from_response_format(response_format),
        "guided_json": None if guided_json is None else Constraint.json_schema(guided_json),
        "guided_regex": None if guided_regex is None else Constraint.regex(guided_regex),
        "guided_grammar": None if guided_grammar is None else Constraint.lark(guided_grammar),
        "guided_choice": None if guided_choice is None else Constraint.choice(guided_choice),
    }
    chosen = {k: v for k, v in given.items() if v is not None}
    if len(chosen) > 1:
        raise InvalidArgument(f"only one structured-output option may be given, got {', '.join(chosen)}")
    return next(iter(chosen.values()), None)


def _schema_text(value: object) -> str:
    """A schema (dict, bool or JSON text) as compact JSON text, key order kept."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e}") from e
    if not isinstance(value, (Mapping, bool)):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"JSON schema is not plain JSON data: {e}") from e


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"choice needs a list of strings, got {value!r}")
    options = tuple(value)
    if not options:
        raise InvalidArgument("choice needs at least one option")
    for o in options:
        if not isinstance(o, str):
            raise InvalidArgument(f"choice options must be strings, got {o!r}")
    return options
