"""Structured output and tools for the server: a request's constraint, compiled before it is queued.

- `request_constraint`: the one constraint a body asks for: OpenAI `response_format`, vLLM's
  `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` or their newer spelling
  `structured_outputs`, or the grammar that forces `tool_choice` "required" or a named function.
  Two at once is a 400.
- `compile_constraint`: compiles it with the model's shared `GrammarCompiler` off the event loop and
  within the compiler's time bound, so an invalid schema, regex or grammar is the caller's 400 and
  never reaches the engine thread (which then finds the compiled grammar in the cache).
- `tool_setup` / `prompt_inputs`: the tools as the chat template sees them. A template that renders
  `tools` gets them as they are; one that does not (SmolLM2's ChatML) gets a system message that
  lists them and the JSON format of a call, as llama.cpp's generic tool format does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from superslm.errors import GrammarError, InvalidArgument, SuperSLMError
from superslm.grammar import (
    Constraint,
    chosen_tools,
    compiler_for,
    constraint_from_request,
    detect_tool_format,
    named_constraint,
    tool_call_constraint,
    tool_names,
)
from superslm.grammar.tool_grammar import CallStyle
from superslm.grammar.tools import function_of
from superslm.serve.protocol import bad

if TYPE_CHECKING:
    from superslm.model import Model
    from superslm.serve.app import ServerState
    from superslm.serve.protocol import ChatRequest, _Generate

#: the body fields that ask for a constraint, in the order a 400 names them
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                     "structured_outputs")
#: vLLM's structured_outputs keys, as the guided_* argument each one is
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
                      "choice": "guided_choice", "json_object": "response_format"}
#: what OpenAI allows as a function name or a json_schema response_format's name
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: most tools per request (OpenAI's limit)
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolSetup:
    """The tools a chat request offers the model, and whether a call is forced."""

    tools: list[dict[str, Any]]
    """The tools in OpenAI's shape {"type": "function", "function": {...}}."""
    choice: str | Mapping[str, Any]
    """"auto", "required" or {"type": "function", "function": {"name": N}}."""
    style: CallStyle
    """The model's call format (`detect_tool_format` of its chat template)."""

    @property
    def forced(self) -> bool:
        """True when a grammar forces a call ("required" or a named function)."""
        return self.choice != "auto"


def tool_setup(req: ChatRequest, model: Model) -> ToolSetup | None:
    """The request's tools, checked; None when the model is offered none (no tools, or
    tool_choice "none": the tools are then left out of the prompt). Raises InvalidArgument."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "tool_choice: forces a tool call, but the request has no tools")
        return None
    if len(req.tools) > MAX_TOOLS:
        raise bad("tools", f"tools: at most {MAX_TOOLS} tools")
    try:
        names = tool_names(req.tools)
        tools = [_wrapped(function_of(t)) for t in req.tools]
    except InvalidArgument as e:
        raise bad("tools", f"tools: {e}") from None
    for name in names:
        if not NAME.fullmatch(name):
            raise bad("tools", "tools: function names must be 1 to 64 letters, digits, underscores or dashes")
    if len(set(names)) != len(names):
        raise bad("tools", "tools: function names must be unique")
    for t in tools:
        params = t["function"].get("parameters")
        if params is not None and not isinstance(params, (Mapping, bool)):
            raise bad("tools", f"tools: {t['function']['name']!r}: parameters must be a JSON schema object")
    if choice is None:
        choice = "auto"  # OpenAI's default once tools are given
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad("tool_choice", "tool_choice: must be none, auto, required or a named function")
    try:
        chosen_tools(req.tools, choice)
    except InvalidArgument as e:
        raise bad("tool_choice", f"tool_choice: {e}") from None
    if choice == "none":
        return None
    return ToolSetup(tools, choice, detect_tool_format(model.chat_template))


def _wrapped(fn: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": dict(fn)}


def request_constraint(
    req: _Generate, model: Model, tools: ToolSetup | None = None
) -> tuple[Constraint | None, str | None]:
    """(the constraint the body asks for, the field to name in a 400), or (None, None).

    A `json_schema` response_format without a `schema` whose `name` is a schema shipped with the
    model (`Model.schemas()`) binds that schema.
    """
    given = [f for f in CONSTRAINT_FIELDS if getattr(req, f, None) is not None]
    rf = req.response_format
    if rf is not None:
        _check_response_format(rf)
        if rf["type"] == "text":
            given.remove("response_format")  # plain text: no constraint, and no conflict
            rf = None
    if len(given) > 1:
        raise bad(given[1], f"{given[1]}: only one of {', '.join(given)} may be given")
    param = given[0] if given else None
    args: dict[str, Any] = {"response_format": rf, "guided_json": req.guided_json, "guided_regex": req.guided_regex,
                            "guided_grammar": req.guided_grammar, "guided_choice": req.guided_choice}
    if req.structured_outputs is not None:
        args |= _structured_outputs(req.structured_outputs)
    try:
        constraint = _named(rf, model) or constraint_from_request(**args)
    except SuperSLMError as e:
        e.param = param  # type: ignore[attr-defined]
        raise
    if tools is None or not tools.forced:
        return constraint, param
    if constraint is not None:
        raise bad("tool_choice", f"tool_choice: a forced tool call cannot be combined with {param}")
    try:
        constraint = tool_call_constraint(
            tools.tools, tools.choice, style=tools.style, tokenizer=model.tokenizer,
            parallel=getattr(req, "parallel_tool_calls", None) is not False,
        )
    except SuperSLMError as e:
        e.param = "tools"  # type: ignore[attr-defined]
        raise
    return constraint, "tools"


def _check_response_format(rf: Mapping[str, Any]) -> None:
    """OpenAI's 400s: a response_format needs its type, a json_schema one a valid name."""
    kind = rf.get("type")
    if kind is None:
        raise bad("response_format", "response_format.type: missing (text, json_object or json_schema)")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad("response_format", "response_format.json_schema.name: required, 1 to 64 letters, digits, "
                      "underscores or dashes")


def _structured_outputs(so: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs as the one guided_* (or json_object response_format) argument it means."""
    # vLLM's options beyond the constraint (disable_any_whitespace, whitespace_pattern, ...) change the
    # answer too: refused unless off
    for key, value in so.items():
        if key not in STRUCTURED_OUTPUTS and value is not None and value is not False:
            raise bad("structured_outputs", f"structured_outputs.{key}: not supported")
    chosen = {k: v for k, v in so.items() if k in STRUCTURED_OUTPUTS and v is not None and v is not False}
    if len(chosen) != 1:
        raise bad("structured_outputs", f"structured_outputs: give exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    key, value = next(iter(chosen.items()))
    if key == "json_object":
        if value is not True:
            raise bad("structured_outputs", "structured_outputs.json_object: must be true")
        return {"response_format": {"type": "json_object"}}
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise bad("structured_outputs", f"structured_outputs.{key}: must be a string")
    return {STRUCTURED_OUTPUTS[key]: value}


def _named(response_format: Mapping[str, Any] | None, model: Model) -> Constraint | None:
    """The model's shipped schema a schema-less json_schema response_format names, if any."""
    if response_format is None or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" in spec or "json_schema" in spec:
        return None
    name = spec.get("name")
    schemas = model.schemas()
    if not isinstance(name, str) or name not in schemas:
        return None
    return named_constraint(name, schemas)


async def compile_constraint(state: ServerState, constraint: Constraint, param: str | None) -> None:
    """Compile `constraint` for the served model (cached by content), off the event loop.

    Raises GrammarError (400, naming `param`) for an invalid schema, regex or grammar, or one that
    did not compile within the compiler's bound (`GrammarCompiler.timeout_s`, 10 s by default).
    """
    tokenizer, vocab = state.model.tokenizer, state.engine.vocab
    try:
        compiler = await asyncio.to_thread(compiler_for, tokenizer, vocab)
        await asyncio.to_thread(compiler.compile, constraint)
    except SuperSLMError as e:
        e.param = param  # type: ignore[attr-defined]
        raise
    except Exception as e:  # llguidance's front end raising something of its own: still the input's fault
        err = GrammarError(f"invalid {constraint.kind}: {type(e).__name__}: {e}")
        err.param = param  # type: ignore[attr-defined]
        raise err from None


# --- the prompt ----------------------------------------------------------------------------------


def template_knows_tools(template: str | None) -> bool:
    """True when a chat template renders the `tools` variable itself."""
    return template is not None and "tools" in template


def prompt_inputs(
    messages: list[dict[str, Any]], setup: ToolSetup | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template.

    A template that renders tools gets them, and earlier assistant calls with their arguments as
    objects (as transformers' templates expect). For one that does not, the tools and the call
    format go in the system message, earlier calls become the JSON the model is asked to write, and
    tool results become user turns (templates without tools often refuse other roles).
    """
    if template_knows_tools(template):
        return [_arguments_as_objects(m) for m in messages], (setup.tools if setup else None)
    out = [_inline_message(m, setup.style if setup else "json") for m in messages]
    if setup is None:
        return out, None
    text = tools_system_text(setup.tools, setup.style)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def tools_system_text(tools: Sequence[Mapping[str, Any]], style: CallStyle) -> str:
    """The system text that teaches a template-less model the tools and the call format."""
    key = "parameters" if style == "llama3" else "arguments"
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call the following tools:\n"
        f"{listed}\n\n"
        f'To call a tool, answer with only a JSON object {{"name": <tool name>, "{key}": <object of arguments>}}.'
        " Otherwise answer the user in plain text."
    )


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass  # left as the client sent it
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _inline_message(message: dict[str, Any], style: CallStyle) -> dict[str, Any]:
    role = message.get("role")
    if role == "tool":
        name = message.get("name") or message.get("tool_call_id") or "the tool"
        return {"role": "user", "content": f"Result of {name}: {message.get('content', '')}"}
    calls = message.get("tool_calls")
    if role != "assistant" or not isinstance(calls, list) or not calls:
        return message
    key = "parameters" if style == "llama3" else "arguments"
    lines = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise bad("messages", "messages: an assistant tool call needs a function object")
        args: Any = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise bad("messages", "messages: tool call arguments must be JSON") from None
        lines.append(json.dumps({"name": fn.get("name"), key: args}, ensure_ascii=False))
    content = "\n".join(filter(None, [message.get("content") or "", *lines]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
