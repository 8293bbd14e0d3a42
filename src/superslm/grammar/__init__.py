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

from superslm.grammar.compiler import CompiledGrammar, GrammarCompiler, build_ll_tokenizer, compiler_for
from superslm.grammar.matcher import DEFAULT_FORCED_LIMIT, GrammarState, fill_bitmasks
from superslm.grammar.schemas import UnknownSchema, load_schemas, named_constraint
from superslm.grammar.spec import DEFAULT_MAX_WHITESPACE, Constraint, constraint_from_request
from superslm.grammar.tool_grammar import call_schema, chosen_tools, detect_tool_format, tool_call_constraint
from superslm.grammar.tools import parse_tool_calls, tool_call_start, tool_names

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
