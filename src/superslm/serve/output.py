"""What a generation request gives back: its choices as they grow, in OpenAI's JSON shapes.

A `Job` gathers the engine's Progress per choice and writes the non-streaming body, the streaming
chunks and the usage, for /v1/completions (`chat=False`) and /v1/chat/completions (`chat=True`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from superslm.engine import Progress
from superslm.sampling import TokenLogprobs
from superslm.serve.loop import sampled_tokens
from superslm.tokenizer import Tokenizer

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


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
    #: characters of text so far in token strings (the legacy logprobs' text_offset)
    offset: int = 0


class Job:
    """The choices of one request: `n` per prompt, choice index = prompt index * n + i."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, chat: bool, n: int, prompt_lens: list[int],
                 logprobs: int | None, include_usage: bool) -> None:
        self.tokenizer, self.model_name, self.chat = tokenizer, model_name, chat
        self.n, self.prompt_lens = n, prompt_lens
        self.logprobs, self.include_usage = logprobs, include_usage
        self.choices = [Choice() for _ in range(n * len(prompt_lens))]
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    @property
    def done(self) -> bool:
        return all(c.end for c in self.choices)

    # --- taking Progress --------------------------------------------------------------------------

    def absorb(self, index: int, p: Progress) -> dict[str, Any] | None:
        """Add a Progress to choice `index`; returns its streaming chunk choice (None: nothing to say)."""
        c = self.choices[index]
        if c.cached is None:
            c.cached = p.cached
        c.sampled += sampled_tokens(p)
        c.tokens += len(p.tokens)
        # a stop token's logprob comes without a token: keep logprobs aligned with returned tokens
        lps = p.logprobs[: len(p.tokens)] if self.logprobs is not None else []
        c.logprobs.extend(lps)
        c.text.append(p.text)
        if p.end:
            c.end, c.stop_reason = p.end, p.stop_reason
        if not (p.text or lps or p.end):
            return None
        finish = FINISH_REASONS[p.end] if p.end else None
        lp = self._logprobs(c, lps) if self.logprobs is not None else None
        out: dict[str, Any] = {"index": index}
        if self.chat:
            out["delta"] = {"content": p.text} if p.text else {}
        else:
            out["text"] = p.text
        out.update(logprobs=lp, finish_reason=finish)
        if p.end:
            out["stop_reason"] = p.stop_reason
        return out

    # --- logprobs ---------------------------------------------------------------------------------

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def _logprobs(self, c: Choice, lps: list[TokenLogprobs]) -> dict[str, Any]:
        if self.chat:
            content = []
            for lp in lps:
                text, raw = self._token(lp.token)
                top = []
                for tid, v in lp.top:
                    t, r = self._token(tid)
                    top.append({"token": t, "logprob": v, "bytes": list(r)})
                content.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
            return {"content": content}
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self._token(lp.token)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({self._token(tid)[0]: v for tid, v in lp.top})
            offsets.append(c.offset)
            c.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    # --- bodies -----------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        completion = sum(c.sampled for c in self.choices)
        prompt = sum(self.prompt_lens)
        cached = sum(self.choices[k * self.n].cached or 0 for k in range(len(self.prompt_lens)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def response(self) -> dict[str, Any]:
        """The non-streaming body."""
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp = None
            if self.logprobs is not None:
                c.offset = 0
                lp = self._logprobs(c, c.logprobs)
            item: dict[str, Any] = {"index": i}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            item.update(logprobs=lp, finish_reason=FINISH_REASONS.get(c.end, c.end), stop_reason=c.stop_reason)
            choices.append(item)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": self.usage()}

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
