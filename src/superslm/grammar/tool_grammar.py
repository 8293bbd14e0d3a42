"""Grammars that force a valid tool call: OpenAI `tool_choice` "required" and a named function.

The call is forced in the model's own format (the one `parse_tool_calls` reads back), with the
arguments valid for the tool's `parameters` schema:

- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (a Lark grammar with
  an inline JSON schema; with `parallel`, "required" allows several blocks, one per line);
- "llama3": `{"name": ..., "parameters": {...}}` (a JSON schema);
- "json": `{"name": ..., "arguments": {...}}` (a JSON schema).

"auto" and "none" need no grammar (None): the model may answer in text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from superslm.errors import InvalidArgument
from superslm.grammar.spec import DEFAULT_MAX_WHITESPACE, Constraint
from superslm.grammar.tools import HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG, function_of, tool_names
from superslm.tokenizer import Tokenizer

CallStyle = Literal["hermes", "llama3", "json"]


def detect_tool_format(chat_template: str | None) -> CallStyle:
    """The tool-call format a chat template teaches its model: "hermes" when it mentions
    <tool_call>, "llama3" when it speaks of <|python_tag|> or "parameters", else "json"."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template or "'parameters'" in template:
        return "llama3"
    return "json"


def chosen_tools(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
) -> list[Mapping[str, Any]] | None:
    """The functions a call must use under `tool_choice`, or None when no call is forced.

    "none", "auto" and None (with tools: OpenAI's default "auto") force nothing; "required" forces
    a call of any tool; {"type": "function", "function": {"name": N}} (or just N) forces N.
    Raises InvalidArgument for an unknown choice or name, or a forced call without tools.
    """
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = [function_of(t) for t in tools or ()]
    names = tool_names(tools)
    if not functions:
        raise InvalidArgument("tool_choice forces a call, but the request has no tools")
    if tool_choice == "required":
        return functions
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    elif isinstance(tool_choice, str):
        name = tool_choice
    else:
        raise InvalidArgument(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")
    if not isinstance(name, str) or name not in names:
        raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
    return [functions[names.index(name)]]


def call_schema(functions: Sequence[Mapping[str, Any]], *, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object {"name": N, args_key: {...}} of any of `functions`.

    Each tool's parameters go under the wrapper's `$defs` as `tool<i>`, their local `$ref`s ("#", "#/$defs/X")
    rewritten to point there: inside the wrapper "#" would be the call object itself."""
    variants, defs = [], {}
    for i, fn in enumerate(functions):
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, (Mapping, bool)):
            raise InvalidArgument(f"tool {fn.get('name')!r}: parameters must be a JSON schema object")
        if isinstance(params, Mapping) and "$id" in params:
            args = params  # a resource of its own: its refs resolve against its $id wherever it sits
        else:
            defs[f"tool{i}"] = _rebased(params, f"#/$defs/tool{i}")
            args = {"$ref": f"#/$defs/tool{i}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: args},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": defs} if defs else schema


#: keywords whose values are data, not schemas: a "$ref" key inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with every local "$ref" ("#...") moved under `root` (a JSON pointer "#/..." to where it now sits)."""
    if isinstance(schema, list):
        return [_rebased(x, root) for x in schema]
    if not isinstance(schema, Mapping) or "$id" in schema:
        return schema  # a nested resource ($id): its local refs are its own
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            # maps of names to schemas: a property named "$ref" or "const" is a name here
            out[key] = {k: _rebased(v, root) for k, v in value.items()} if isinstance(value, Mapping) else value
        else:
            out[key] = _rebased(value, root)
    return out


def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    *,
    style: CallStyle = "hermes",
    tokenizer: Tokenizer | None = None,
    parallel: bool = True,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
) -> Constraint | None:
    """The constraint that forces `tool_choice`'s call in `style`, or None when none is forced.

    Args:
        tools, tool_choice: as the OpenAI request has them.
        style: the model's format (`detect_tool_format` of its chat template).
        tokenizer: the model's tokenizer; where <tool_call> is a special token there, the grammar
            names the token (text could not produce it).
        parallel: "required" in the hermes style may make several calls (OpenAI's
            parallel_tool_calls); a named function is always called once.
        max_whitespace: the whitespace bound inside the JSON (see `Constraint`).
    """
    functions = chosen_tools(tools, tool_choice)
    if functions is None:
        return None
    if style in ("llama3", "json"):
        key = "parameters" if style == "llama3" else "arguments"
        return Constraint.json_schema(call_schema(functions, args_key=key), max_whitespace=max_whitespace)
    if style != "hermes":
        raise InvalidArgument(f"style must be hermes, llama3 or json, got {style!r}")
    schema = call_schema(functions)
    options = Constraint.json_schema(schema, max_whitespace=max_whitespace).json_options()
    if options:
        # x-guidance is read at the top of an inline %json schema, as of a whole one
        schema = {"x-guidance": options, **schema}
    many = parallel and tool_choice == "required"
    lark = "\n".join(
        [
            'start: call ("\\n" call)*' if many else "start: call",
            f'call: {_literal(HERMES_OPEN, tokenizer)} "\\n" body "\\n" {_literal(HERMES_CLOSE, tokenizer)}',
            f"body: %json {json.dumps(schema, ensure_ascii=False)}",
        ]
    )
    return Constraint.lark(lark)


def _literal(text: str, tokenizer: Tokenizer | None) -> str:
    """`text` as a Lark item: the special token's id where the tokenizer has it as one."""
    if tokenizer is not None:
        token = tokenizer.token_to_id(text)
        if token is not None and token in tokenizer.special_ids:
            return f"<[{token}]>"
    return json.dumps(text, ensure_ascii=False)
