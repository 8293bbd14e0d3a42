"""grammar layer: structured output with llguidance (JSON schema, regex, Lark, choice) and tool calls.

Public API:

- `Constraint`: what an output must match, as frozen plain data (`Constraint.json_schema(...)`,
  `.json_object()`, `.regex(...)`, `.lark(...)`, `.choice([...])`, `.from_response_format(...)`);
  `constraint_from_request(response_format=..., guided_json=..., guided_regex=..., ...)`.
- `GrammarCompiler` / `compiler_for(tokenizer, vocab_size)`: compile constraints against a
  tokenizer, cached by content; `CompiledGrammar` is the shared result. Errors: GrammarError.
- `GrammarState`: one request's walk (fill_bitmask, accept, take_forced, is_accepting, is_dead,
  `after`, state()/from_state()); `fill_bitmasks` fills a batch's bitmask.
- `load_schemas(folder)`, `named_constraint(name, schemas)`, `UnknownSchema`: schemas shipped
  in a model folder's `schemas/NAME.json`.
- `parse_tool_calls(text, tools)`: model text -> (content, [{"name", "arguments"}]);
  `tool_call_start(text)`: where a streamed tool call may begin (hold back from there);
  `tool_call_constraint(tools, tool_choice, style=...)`, `detect_tool_format(chat_template)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use (PEP 562): plain generation never imports llguidance (its native library is ~2 MB
# of RSS and the import ~10 ms), only a request with a constraint does.
_WHERE = {
    "CompiledGrammar": "compiler", "GrammarCompiler": "compiler", "build_ll_tokenizer": "compiler",
    "compiler_for": "compiler", "DEFAULT_FORCED_LIMIT": "matcher", "GrammarState": "matcher",
    "fill_bitmasks": "matcher", "UnknownSchema": "schemas", "load_schemas": "schemas",
    "named_constraint": "schemas", "DEFAULT_MAX_WHITESPACE": "spec", "Constraint": "spec",
    "constraint_from_request": "spec", "call_schema": "tool_grammar", "chosen_tools": "tool_grammar",
    "detect_tool_format": "tool_grammar", "tool_call_constraint": "tool_grammar", "parse_tool_calls": "tools",
    "tool_call_start": "tools", "tool_names": "tools",
}  # fmt: skip

if TYPE_CHECKING:
    from superslm.grammar.compiler import CompiledGrammar, GrammarCompiler, build_ll_tokenizer, compiler_for
    from superslm.grammar.matcher import DEFAULT_FORCED_LIMIT, GrammarState, fill_bitmasks
    from superslm.grammar.schemas import UnknownSchema, load_schemas, named_constraint
    from superslm.grammar.spec import DEFAULT_MAX_WHITESPACE, Constraint, constraint_from_request
    from superslm.grammar.tool_grammar import call_schema, chosen_tools, detect_tool_format, tool_call_constraint
    from superslm.grammar.tools import parse_tool_calls, tool_call_start, tool_names


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'superslm.grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"superslm.grammar.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_FORCED_LIMIT",
    "DEFAULT_MAX_WHITESPACE",
    "CompiledGrammar",
    "Constraint",
    "GrammarCompiler",
    "GrammarState",
    "UnknownSchema",
    "build_ll_tokenizer",
    "call_schema",
    "chosen_tools",
    "compiler_for",
    "constraint_from_request",
    "detect_tool_format",
    "fill_bitmasks",
    "load_schemas",
    "named_constraint",
    "parse_tool_calls",
    "tool_call_constraint",
    "tool_call_start",
    "tool_names",
]
