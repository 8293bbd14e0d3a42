"""Tool calls: parse a model's text back into OpenAI `tool_calls`.

Templates render the tools and past calls; what comes back is text in the model's own format:

- Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- Llama 3.x JSON: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
  separated by ";";
- anything else: JSON objects found in the text that name a known tool (`arguments` or
  `parameters`), also wrapped as {"function": {...}}, {"tool_calls": [...]} or in a list.

`parse_tool_calls` returns the remaining content and the calls as {"name", "arguments"} with the
arguments as JSON text (OpenAI's shape; the server adds ids and "type": "function").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from superslm.errors import InvalidArgument

ToolFormat = Literal["auto", "hermes", "llama3", "json"]
TOOL_FORMATS: tuple[str, ...] = ("auto", "hermes", "llama3", "json")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
_DECODER = json.JSONDecoder()


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The function names of OpenAI `tools` ({"type": "function", "function": {"name", ...}}, or
    the bare function objects). Raises InvalidArgument for a tool without a name."""
    names: list[str] = []
    for i, tool in enumerate(tools or ()):
        fn = function_of(tool)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"tools[{i}]: a function needs a non-empty name")
        names.append(name)
    return names


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function object of one OpenAI tool entry (the entry itself when it is bare)."""
    if not isinstance(tool, Mapping):
        raise InvalidArgument(f"a tool must be an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise InvalidArgument(f"only function tools are supported, got type {tool.get('type')!r}")
    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping):
        raise InvalidArgument("a tool's function must be an object")
    return fn


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None, *, format: ToolFormat = "auto"
) -> tuple[str | None, list[dict[str, str]]]:
    """Split model output into content and tool calls.

    Args:
        text: the generated text (special tokens like <tool_call> kept as text).
        tools: the request's OpenAI tools; when given, only calls naming one of them count (the
            rest stays content). None accepts any name.
        format: "hermes", "llama3", "json" or "auto" (Hermes blocks if the text has any, else
            Llama 3 / generic JSON).

    Returns:
        (content, calls): content is the text left once the calls are cut out, stripped, or None
        when nothing is left; calls are {"name": str, "arguments": JSON text of an object}.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
    if format not in TOOL_FORMATS:
        raise InvalidArgument(f"format must be one of {', '.join(TOOL_FORMATS)}, got {format!r}")
    known = set(tool_names(tools)) if tools else None
    if format == "hermes" or (format == "auto" and HERMES_OPEN in text):
        content, calls = _parse_hermes(text, known)
        if calls or format == "hermes":
            return content, calls
    if format == "llama3" or format == "auto":
        content, calls = _parse_llama3(text, known)
        if calls or format == "llama3":
            return content, calls
    return _parse_json(text, known)


def tool_call_start(text: str) -> int | None:
    """Where a tool call may begin in text streamed so far, or None: a server streams the content
    before this index and holds the rest until `parse_tool_calls` can decide. Covers a (partial)
    <tool_call> or <|python_tag|> tag and text that opens with JSON; a call embedded after prose
    in the generic format is only found by the final parse."""
    found = [i for i in (text.find(HERMES_OPEN), text.find(PYTHON_TAG)) if i >= 0]
    if found:
        return min(found)
    stripped = text.lstrip()
    if stripped.startswith(("{", "[", "`")):
        return len(text) - len(stripped)
    # a tag cut by the stream: "...<tool" could still become <tool_call>
    for tag in (HERMES_OPEN, PYTHON_TAG):
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                return len(text) - n
    return None


# --- the formats -------------------------------------------------------------------------------


def _parse_hermes(text: str, known: set[str] | None) -> tuple[str | None, list[dict[str, str]]]:
    calls: list[dict[str, str]] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES_BLOCK.finditer(text):
        call = _call_from_body(m.group(1), known)
        if call is None:
            continue  # not a valid call: the block stays in the content as written
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return _content("".join(kept)), calls


def _parse_llama3(text: str, known: set[str] | None) -> tuple[str | None, list[dict[str, str]]]:
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return _content(text), []
    calls: list[dict[str, str]] = []
    pos = 0
    while pos < len(body):
        try:
            value, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            break
        call = _call_from_value(value, known)
        if call is None:
            break
        calls.append(call)
        pos = end
        # Llama 3 separates parallel calls with ";" (and models add spaces or newlines)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        return _content(text), []
    return _content(body[pos:]), calls


def _parse_json(text: str, known: set[str] | None) -> tuple[str | None, list[dict[str, str]]]:
    """Every JSON object (or list of objects) in the text that is a call of a known tool."""
    calls: list[dict[str, str]] = []
    kept: list[str] = []
    pos = 0
    for start, end, value in _json_values(text):
        found = list(_calls_in(value, known))
        if not found:
            continue
        calls.extend(found)
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    content = "".join(kept)
    if calls:
        content = _FENCE.sub(lambda m: "" if not m.group(1).strip() else m.group(0), content)
        content = content.replace(PYTHON_TAG, "")
    return _content(content), calls


# --- helpers -----------------------------------------------------------------------------------


def _json_values(text: str) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) of each top-level JSON object or array that decodes, left to right."""
    pos = 0
    while True:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            return
        start = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        yield start, end, value
        pos = end


def _calls_in(value: Any, known: set[str] | None) -> Iterator[dict[str, str]]:
    if isinstance(value, list):
        calls = [_call_from_value(v, known) for v in value]
        # a list counts only when all of it is calls (else it is data that happens to match)
        if calls and all(c is not None for c in calls):
            yield from calls  # type: ignore[misc]
        return
    if isinstance(value, Mapping) and isinstance(value.get("tool_calls"), list):
        yield from _calls_in(value["tool_calls"], known)
        return
    call = _call_from_value(value, known)
    if call is not None:
        yield call


def _call_from_body(body: str, known: set[str] | None) -> dict[str, str] | None:
    body = body.strip()
    try:
        value, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        return None
    return _call_from_value(value, known)


def _call_from_value(value: Any, known: set[str] | None) -> dict[str, str] | None:
    """{"name", "arguments"} of a call object, or None when `value` is not a call of a known tool."""
    if not isinstance(value, Mapping):
        return None
    if isinstance(value.get("function"), Mapping):  # OpenAI's own shape
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or (known is not None and name not in known):
        return None
    if "arguments" in value:
        args = value["arguments"]
    elif "parameters" in value:
        args = value["parameters"]
    else:
        return None
    arguments = _arguments_text(args)
    if arguments is None:
        return None
    return {"name": name, "arguments": arguments}


def _arguments_text(args: Any) -> str | None:
    """Arguments as the JSON text of an object (OpenAI's shape); None when they are not one."""
    if args is None:
        return "{}"
    if isinstance(args, str):
        try:
            parsed = json.loads(args)  # some models double-encode the arguments
        except json.JSONDecodeError:
            return None
        return args if isinstance(parsed, dict) else None
    if isinstance(args, Mapping):
        return json.dumps(args, ensure_ascii=False)
    return None


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None
