"""One HTTP request carried from the ingress to a replica and run there through the server's own ASGI app.

The ingress reads the whole request (the server's bodies are JSON, bounded by max_body_bytes) into a
`Carried`; the replica calls `answer(app, carried)`, which runs the same FastAPI app `superslm serve` runs and
yields its response as parts: first `Start(status, headers)`, then the body's chunks as bytes. So every route,
error shape, key check and metric is the server's, not a copy. `Carried.messages` / `.prompt` hold the text
Ray's PrefixCacheAffinityRouter matches on (it reads those attributes of a call's first argument).

This module needs neither Ray nor a web framework.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: the routes whose bodies carry a prompt the routers can match on
TEXT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


@dataclass
class Start:
    """The response's status and headers (raw ASGI pairs)."""

    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass
class Carried:
    """An HTTP request, whole, as plain data (it crosses processes)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    #: the prompt text the prefix-aware router matches (a chat's messages, or a completion's prompt)
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None

    @property
    def routing_text(self) -> str:
        """The text a prefix router matches: every message's text in order, or the prompt."""
        if self.prompt:
            return self.prompt
        return "".join(m["content"] for m in self.messages or ())


def _text(content: Any) -> str:
    """A message's content as text (a list of parts keeps its text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def carry(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Carried:
    """The request as a Carried, its routing text read from a generation route's JSON body (a body that is
    not JSON routes without text, and the replica's app gives it the server's own 400)."""
    out = Carried(method, path, query, headers, body)
    if method != "POST" or path not in TEXT_ROUTES:
        return out
    try:
        data = json.loads(body)
    except ValueError:
        return out
    if not isinstance(data, dict):
        return out
    if path == "/v1/completions":
        prompt = data.get("prompt")
        out.prompt = prompt if isinstance(prompt, str) and prompt else None
        return out
    # a chat's messages; Anthropic's `system` and the Responses API's `instructions` / `input` come first as they do
    # in the prompt the template builds
    parts: list[dict[str, Any]] = []
    for key in ("system", "instructions"):
        if data.get(key):
            parts.append({"role": "system", "content": _text(data[key])})
    messages = data.get("messages", data.get("input"))
    if isinstance(messages, str):
        parts.append({"role": "user", "content": messages})
    elif isinstance(messages, list):
        parts += [{"role": str(m.get("role", "")), "content": _text(m.get("content"))}
                  for m in messages if isinstance(m, dict)]
    if any(p["content"] for p in parts):
        out.messages = parts
    return out


ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


async def answer(app: ASGIApp, req: Carried,
                 client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[Start | bytes]:
    """Run `req` through the ASGI `app` and yield its response: a Start, then body chunks. Closing the
    generator early (the client went away) tells the app the client disconnected, as uvicorn would."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
             "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "query_string": req.query,
             "root_path": "", "headers": req.headers, "client": client, "server": ("127.0.0.1", 80)}
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()  # the app's disconnect watchers wait here until the client goes away
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield Start(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task  # the app's own exception, if it raised one after answering nothing
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5.0)  # the disconnect cancels its submission; let it finish that
            except (asyncio.TimeoutError, Exception):
                task.cancel()
