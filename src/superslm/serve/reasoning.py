"""A reasoning model's thinking split from its answer, as the text streams.

Qwen3, Qwen3.5, DeepSeek-R1, SmolLM3 and the other templates of their kind write the model's thinking between
`<think>` and `</think>`: the model opens the block itself, or the template's generation prompt opens it
(the answer then starts inside the thinking), or closes an empty one to turn thinking off. `ReasoningSplit`
reads the answer as it comes and hands back (thinking, content) pieces; a tag split across pieces is held
until it is whole. Without a closing tag, text after an opening is thinking to the end (the answer ran out
while thinking).
"""

from __future__ import annotations

from typing import Any

START, END = "<think>", "</think>"


def has_reasoning(template: str | None) -> bool:
    """Whether a chat template writes thinking blocks (it names both tags)."""
    return bool(template) and START in template and END in template  # type: ignore[operator]


def thinking_switch(template: str | None) -> bool:
    """Whether a chat template reads `enable_thinking` (a per-request switch)."""
    return bool(template) and "enable_thinking" in template  # type: ignore[operator]


def opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt's end leaves a thinking block open (the template's generation prompt opened it)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def prompt_thinking(prompt_text: str) -> str:
    """How a reasoning template's prompt ends: "open" (inside a thinking block the generation prompt opened),
    "closed" (right after an empty block it closed: thinking is off) or "maybe" (the model may open one)."""
    if opens_thinking(prompt_text):
        return "open"
    end = prompt_text.rfind(END)
    if end >= 0 and not prompt_text[end + len(END):].strip():
        return "closed"
    return "maybe"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag` (held back until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """One answer's text as (thinking, content) pieces. `thinking`: the prompt opened the block."""

    def __init__(self, thinking: bool = False) -> None:
        # before: the answer may still open a block (after leading whitespace); thinking; content
        self.state = "thinking" if thinking else "before"
        self.pending = ""
        self.after_end = False  # strip the whitespace that follows the closing tag

    def push(self, text: str) -> tuple[str, str]:
        """The thinking and the content that `text` (the next piece) completes."""
        text = self.pending + text
        self.pending = ""
        thought, content = "", ""
        while text:
            if self.state == "before":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    self.state, text = "thinking", stripped[len(START):]
                elif START.startswith(stripped):  # the tag may be coming (or only whitespace so far)
                    self.pending = text
                    return thought, content
                else:
                    self.state = "content"
            elif self.state == "thinking":
                at = text.find(END)
                if at < 0:
                    keep = _held(text, END)
                    thought += text[: len(text) - keep]
                    self.pending = text[len(text) - keep:]
                    return thought, content
                thought += text[:at]
                self.state, self.after_end, text = "content", True, text[at + len(END):]
            else:
                if self.after_end:
                    text = text.lstrip()
                    if not text:
                        return thought, content
                    self.after_end = False
                content += text
                text = ""
        return thought, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an open block's partial tag is thinking; leading whitespace is content."""
        held, self.pending = self.pending, ""
        if self.state == "thinking":
            return held, ""
        return "", held


def effort_switch(effort: Any) -> bool | None:
    """enable_thinking for a reasoning effort: "none" turns thinking off; any other leaves the template's default."""
    return False if effort == "none" else None
