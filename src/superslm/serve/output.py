"""What a generation request gives back: its choices as they grow, in OpenAI's JSON shapes.

A `Job` gathers the engine's Progress per choice and writes the non-streaming body, the streaming
chunks and the usage, for /v1/completions (`chat=False`) and /v1/chat/completions (`chat=True`).
A chat request that offers tools reads each choice through a `ToolStream` (tool_calls, finish
reason "tool_calls"). A choice whose grammar died (engine end "grammar": an llguidance error or no token
allowed) finishes with "error": its text is cut short, which "stop" would hide.
"""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from superslm.engine import Progress
from superslm.sampling import TokenLogprobs
from superslm.serve.loop import sampled_tokens
from superslm.serve.reasoning import ReasoningSplit
from superslm.serve.toolcalls import ToolStream
from superslm.tokenizer import Tokenizer

# a dead grammar is a failed request, vLLM's "error" (the metrics count it under reason="grammar")
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "grammar": "error", "not_finite": "error"}
#: what a logprob of -inf (a token the model gives no chance, forced by a grammar) is written as: JSON has no
#: infinity, and OpenAI and vLLM write -9999.0 for it
NO_CHANCE = -9999.0


def _num(v: float) -> float:
    return v if v > NO_CHANCE else NO_CHANCE


@dataclass
class Choice:
    """One choice's answer so far."""

    text: list[str] = field(default_factory=list)
    #: tokens returned (a stop token is not), and tokens sampled (it is)
    tokens: int = 0
    sampled: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached: int | None = None
    end: str = ""
    stop_reason: str | int | None = None
    #: characters of text returned so far
    shown: int = 0
    #: characters of the tokens' text so far, complete characters only (the legacy logprobs' text_offset),
    #: and the decoder holding a character's bytes until the token that completes it
    offset: int = 0
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    #: tokens its grammar forced (jump-forward), known at the end
    forced: int = 0
    #: set when the request offers tools: holds back what may be a call, parses calls at the end
    tools: ToolStream | None = None
    #: echo: (the prompt's text, its ids), until the first report puts them before the answer; then the text
    echo: tuple[str, list[int]] | None = None
    echoed: str = ""
    #: the prompt's ids and logprobs once they came (echo's logprobs and vLLM's prompt_logprobs)
    prompt: tuple[list[int], list[TokenLogprobs | None]] | None = None
    #: set for a reasoning template: splits thinking (kept in `thought`) from the content (kept in `text`)
    reasoning: ReasoningSplit | None = None
    thought: list[str] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        if self.tools is not None and self.tools.calls and self.end in ("stop", "grammar"):
            return "tool_calls"
        return FINISH_REASONS.get(self.end, self.end)


class Job:
    """The choices of one request: `n` per prompt, choice index = prompt index * n + i."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, chat: bool, n: int, prompt_lens: list[int],
                 logprobs: int | None, include_usage: bool, tools: list[dict[str, Any]] | None = None,
                 forced_call: bool = False, include_stop: tuple[int, ...] | None = None,
                 echo: list[tuple[str, list[int]]] | None = None, prompt_logprobs: int | None = None,
                 reasoning: bool | None = None) -> None:
        """`tools`: the tools a chat request offers (None: no tool calls are parsed);
        `forced_call`: a grammar forces a call, so no text streams as content before the end;
        `include_stop`: vLLM's include_stop_str_in_output, holding the request's stop_token_ids
        (None: off): the stop string, or such a stop token's text, that ends a choice ends its text;
        `echo`: per prompt, its text and ids, put before each of its choices' answers (completions' echo);
        `prompt_logprobs`: vLLM's, returned as its `prompt_logprobs` lists (None: not asked for);
        `reasoning`: a chat answer's thinking is split from its content (serve/reasoning.py) and returned as
        `reasoning_content` (None: not split; True: the prompt opened the thinking block)."""
        self.tokenizer, self.model_name, self.chat = tokenizer, model_name, chat
        self.include_stop = include_stop
        self.n, self.prompt_lens = n, prompt_lens
        self.logprobs, self.include_usage = logprobs, include_usage
        self.choices = [Choice() for _ in range(n * len(prompt_lens))]
        self.echo, self.prompt_logprobs = echo is not None, prompt_logprobs
        for i, c in enumerate(self.choices):
            c.echo = echo[i // n] if echo is not None else None
        if tools is not None:
            for c in self.choices:
                c.tools = ToolStream(tools, forced_call)
        self.reasoning = reasoning is not None and chat
        if self.reasoning:
            for c in self.choices:
                c.reasoning = ReasoningSplit(thinking=bool(reasoning))
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    @property
    def done(self) -> bool:
        return all(c.end for c in self.choices)

    # --- taking Progress --------------------------------------------------------------------------

    def absorb(self, index: int, p: Progress) -> list[dict[str, Any]]:
        """Add a Progress to choice `index`; returns its streaming chunk choices, one per chunk
        (none: nothing to say; tool calls at the end take several chunks, as OpenAI streams them)."""
        c = self.choices[index]
        if c.cached is None:
            c.cached = p.cached
        c.sampled += sampled_tokens(p)
        c.tokens += len(p.tokens)
        # a stop token's logprob comes without a token: keep logprobs aligned with returned tokens
        lps = p.logprobs[: len(p.tokens)] if self.logprobs is not None else []
        c.logprobs.extend(lps)
        text = p.text + self._stop_text(p)
        thought = ""
        if c.reasoning is not None:  # the thinking goes apart; only the content is text (and may be a call)
            thought, text = c.reasoning.push(text)
            if p.end:
                more, rest = c.reasoning.finish()
                thought, text = thought + more, text + rest
            c.thought.append(thought)
        prompt, head = None, ""
        if c.echo is not None:  # the first report: the prompt's text first, with its logprobs if asked for
            prompt = (c.echo[1], p.prompt_logprobs or [None] * len(c.echo[1]))
            head, c.echoed, c.echo = c.echo[0], c.echo[0], None
        if p.prompt_logprobs is not None and c.prompt is None:
            c.prompt = (prompt[0] if prompt else [], p.prompt_logprobs)
        c.text.append(head + text)
        c.shown += len(head + text)
        if p.end:
            c.end, c.stop_reason, c.forced = p.end, p.stop_reason, p.forced_tokens
        if c.tools is not None:  # the echoed message is the client's: never read as a call
            text = c.tools.push(text) + (c.tools.finish() if p.end else "")
        text = head + text
        prompt_lps = self.prompt_logprobs is not None and p.prompt_logprobs is not None
        if not (text or thought or lps or p.end or prompt_lps):
            return []
        finish = c.finish_reason if p.end else None
        lp = self._logprobs(c, lps, c.shown, prompt if self.echo else None) if self.logprobs is not None else None
        out: dict[str, Any] = {"index": index}
        if self.chat:
            out["delta"] = {"content": text} if text else {}
            if thought:
                out["delta"] = {"reasoning_content": thought, **out["delta"]}
        else:
            out["text"] = text
        out.update(logprobs=lp, finish_reason=finish)
        if self.prompt_logprobs is not None and p.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(p.prompt_logprobs)
        if p.end:
            out["stop_reason"] = p.stop_reason
        if c.tools is None or not c.tools.calls:
            return [out]
        # content (and logprobs) first, then each call, then the finish reason on an empty delta
        head = ([{k: v for k, v in out.items() if k != "stop_reason"} | {"finish_reason": None}]
                if text or thought or lps else [])
        calls = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in c.tools.call_deltas()]
        tail = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": p.stop_reason}
        return [*head, *calls, tail]

    def _stop_text(self, p: Progress) -> str:
        """What include_stop_str_in_output appends at the end: the stop string, or the text of a
        stop_token_ids token (special tokens, EOS among them, have none, as vLLM skips them)."""
        if self.include_stop is None or p.end != "stop":
            return ""
        if isinstance(p.stop_reason, str):
            return p.stop_reason
        if isinstance(p.stop_reason, int) and p.stop_reason in self.include_stop:
            return self.tokenizer.decode([p.stop_reason], skip_special_tokens=True)
        return ""

    # --- logprobs ---------------------------------------------------------------------------------

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def _legacy_token(self, token: int) -> str:
        """A token's text for /v1/completions logprobs; bytes that are not UTF-8 alone (a part of a
        character) are written "bytes:\\xNN..." as OpenAI does, so distinct tokens stay distinct keys."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _prompt_logprobs(self, lps: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}} for the prompt's token and the top N."""
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token): {"logprob": _num(lp.logprob), "rank": lp.rank,
                                     "decoded_token": self.tokenizer.decode([lp.token])}}
            for r, (tid, v) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": _num(v), "rank": r,
                                            "decoded_token": self.tokenizer.decode([tid])})
            out.append(entry)
        return out

    def _logprobs(self, c: Choice, lps: list[TokenLogprobs], shown: int,
                  prompt: tuple[list[int], list[TokenLogprobs | None]] | None = None) -> dict[str, Any]:
        """The logprobs of `lps`, next in choice `c`; `shown`: characters of text returned so far
        (a text_offset never goes past it, even where a stop string cut the text short); `prompt`: echo's
        prompt ids and logprobs, whose entries come first (the first token's logprob is None, as OpenAI's)."""
        if self.chat:
            content = []
            for lp in lps:
                text, raw = self._token(lp.token)
                top = []
                for tid, v in lp.top:
                    t, r = self._token(tid)
                    top.append({"token": t, "logprob": _num(v), "bytes": list(r)})
                content.append({"token": text, "logprob": _num(lp.logprob), "bytes": list(raw),
                                "top_logprobs": top})
            return {"content": content}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        entries: list[tuple[int, TokenLogprobs | None]] = [(lp.token, lp) for lp in lps]
        if prompt is not None:
            entries = [*zip(prompt[0], prompt[1], strict=True), *entries]
        for token, lp in entries:
            tokens.append(self._legacy_token(token))
            values.append(None if lp is None else _num(lp.logprob))
            tops.append(None if lp is None else {self._legacy_token(tid): _num(v) for tid, v in lp.top})
            # where the token's text starts: a token inside a character gets that character's offset
            offsets.append(min(c.offset, shown))
            c.offset += len(c.utf8.decode(self.tokenizer.token_bytes(token)))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # --- bodies -----------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; `completion_tokens_details.forced_tokens` counts the completion tokens
        a grammar forced (jump-forward: appended without sampling), a part of `completion_tokens`."""
        completion = sum(c.sampled for c in self.choices)
        prompt = sum(self.prompt_lens)
        cached = sum(self.choices[k * self.n].cached or 0 for k in range(len(self.prompt_lens)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"forced_tokens": sum(c.forced for c in self.choices)},
        }

    def response(self) -> dict[str, Any]:
        """The non-streaming body."""
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp = None
            if self.logprobs is not None:
                c.offset = 0
                c.utf8.reset()
                echoed = c.prompt if self.echo and c.prompt is not None and c.prompt[0] else None
                lp = self._logprobs(c, c.logprobs, len(text), echoed)
            item: dict[str, Any] = {"index": i}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                if c.tools is not None:
                    content = c.tools.content
                    item["message"]["content"] = c.echoed + (content or "") if c.echoed else content
                    if c.tools.calls:
                        item["message"]["tool_calls"] = c.tools.calls
                if c.reasoning is not None:
                    item["message"]["reasoning_content"] = "".join(c.thought) or None
            else:
                item["text"] = text
            item.update(logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if self.prompt_logprobs is not None and not self.chat:
                item["prompt_logprobs"] = self._prompt_logprobs(c.prompt[1]) if c.prompt else None
            choices.append(item)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": self.usage()}
        if self.prompt_logprobs is not None and self.chat:  # vLLM: one list beside the choices of a chat
            first = self.choices[0].prompt
            body["prompt_logprobs"] = self._prompt_logprobs(first[1]) if first else None
        return body

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """One streaming chunk (`usage` is null on every chunk but the last when usage is asked for)."""
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = usage
        return out

    def role_chunk(self) -> dict[str, Any]:
        """The chat stream's first chunk: every choice's role."""
        return self.chunk([
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(self.choices))
        ])
