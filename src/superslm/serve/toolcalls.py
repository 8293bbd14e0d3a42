"""One choice's answer when tools are offered: content streamed as it comes, calls parsed at the end.

Text that may be the start of a tool call (a `<tool_call>` or `<|python_tag|>` tag, JSON, a code
fence) is held back; the rest streams as content. At the end `parse_tool_calls` splits the whole
text into content and calls, so the streamed content plus the final content delta is the
non-streamed message's content, and the calls are the same in both. Content is stripped of
surrounding whitespace (as `parse_tool_calls` returns it), so leading whitespace is skipped and
trailing whitespace held until more text follows.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from superslm.grammar import parse_tool_calls, tool_call_start

#: where the generic JSON format may start a call that `tool_call_start` leaves to the final parse
_JSON_STARTS = ("{", "[", "```")


def hold_from(text: str) -> int:
    """The index from which `text` may hold a tool call (len(text): none can start in it)."""
    found = [i for i in (text.find(s) for s in _JSON_STARTS) if i >= 0]
    start = tool_call_start(text)
    if start is not None:
        found.append(start)
    return min(found, default=len(text))


class ToolStream:
    """The text of one choice that may call tools (`forced`: the grammar forces a call, so nothing
    is content until the final parse says so)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], forced: bool = False) -> None:
        self.tools = list(tools)
        self.forced = forced
        self.raw = ""
        #: content sent so far: a prefix of the final content
        self.sent = ""
        #: set by `finish`: the message content (None: nothing but calls) and the OpenAI tool_calls
        self.content: str | None = None
        self.calls: list[dict[str, Any]] = []

    def push(self, text: str) -> str:
        """Take the next piece of text; returns the content that can be sent now."""
        self.raw += text
        if self.forced or not text:
            return ""
        safe = self.raw[: hold_from(self.raw)].strip()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self) -> str:
        """Parse the whole text; returns the content not sent yet (sets `content` and `calls`)."""
        content, calls = parse_tool_calls(self.raw, self.tools)
        if not calls:
            content = self.raw.strip()
        self.calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
        self.content = content if content or not calls else None
        final = self.content or ""
        # a call after prose in an unknown shape was streamed as content already: it cannot be taken back
        if not final.startswith(self.sent):
            return ""
        delta, self.sent = final[len(self.sent) :], final
        return delta

    def call_deltas(self) -> list[dict[str, Any]]:
        """The calls as OpenAI streams them: per call, its id, type and name with empty
        arguments, then the arguments (one piece each: the call is parsed whole)."""
        out: list[dict[str, Any]] = []
        for i, call in enumerate(self.calls):
            fn = call["function"]
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        return out
