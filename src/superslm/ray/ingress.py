"""The ingress: Ray Serve's HTTP entry, carrying each request to an engine replica and its answer back.

It reads the request whole (bounded by max_body_bytes), hands it to the engine deployment through a streaming
handle (the deployment's request router picks the replica: routers.py), and holds the response's start until
the first body bytes come. So a replica that dies before it has streamed anything costs the client nothing:
the request is sent again, to another replica (Ray drops the dead one from routing), up to `retries` times.
One that dies after its first bytes cannot be retried (the client has part of an answer): a stream gets an
error event in its API's shape and its end, any other body is cut. GET /metrics answers the stats board's
merged scrape (stats.py) instead of one replica's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray import serve

from superslm.errors import SuperSLMError
from superslm.ray.bridge import Carried, Start, carry
from superslm.ray.stats import board, merge
from superslm.serve.anthropic import AnthropicErrors
from superslm.serve.anthropic import error_body as anthropic_error
from superslm.serve.anthropic import event as anthropic_event
from superslm.serve.app import KEY_MESSAGE, error_payload, key_ok
from superslm.serve.generate import sse

log = logging.getLogger("superslm.ray")

#: what Ray raises on a call whose replica died or cannot be reached
REPLICA_GONE: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ReplicaLost(SuperSLMError):
    """The replica serving a request died (after its retries, or after part of the answer was sent)."""

    code = "replica_lost"
    http_status = 503


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


def stream_error(path: str, err: SuperSLMError) -> bytes:
    """The frames that end a stream cut by `err`, in the route's API shape."""
    body = error_payload(err.http_status, str(err), err.code)
    if path == "/v1/messages":
        return anthropic_event("error", anthropic_error(err.http_status, body["message"])).encode()
    if path == "/v1/responses":
        return f"event: error\n{sse({'type': 'error', **body})}".encode()
    return (sse({"error": body}) + "data: [DONE]\n\n").encode()


async def _json(send: Send, status: int, payload: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


async def _error(send: Send, err: SuperSLMError) -> None:
    await _json(send, err.http_status, {"error": error_payload(err.http_status, str(err), err.code)})


class Ingress:
    """A Serve deployment class (superslm.ray.app binds it): `engine` is the engine deployment's handle."""

    def __init__(self, engine: Any, board_name: str, api_key: str | None = None, max_body_bytes: int = 4 << 20,
                 retries: int = 2) -> None:
        self.engine = engine.options(stream=True)
        self.board = board(board_name)
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.retries = retries

    def __serve_build_asgi_app__(self) -> Any:
        """The ASGI app Ray Serve's proxy calls (Anthropic's routes get their errors in their shape)."""
        return AnthropicErrors(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/metrics":
            await self._metrics(scope, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await _json(send, 413, {"error": error_payload(
                    413, f"the body is larger than {self.max_body_bytes} bytes", "request_too_large")})
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        req = carry(method, path, scope.get("query_string", b""), [(bytes(k), bytes(v)) for k, v in scope["headers"]],
                    b"".join(chunks))
        await self._forward(req, send)

    async def _metrics(self, scope: dict[str, Any], send: Send) -> None:
        headers = {bytes(k).lower(): bytes(v).decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and not key_ok(headers, self.api_key):
            await _json(send, 401, {"error": error_payload(401, KEY_MESSAGE, "invalid_api_key")},
                        [(b"www-authenticate", b"Bearer")])
            return
        text = merge(await self.board.all.remote()).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                                (b"content-length", str(len(text)).encode())]})
        await send({"type": "http.response.body", "body": text})

    def _call(self, req: Carried) -> Any:
        # the routers read the routing text from the first positional argument; other calls carry none
        return self.engine.handle.remote(req) if req.routing_text else self.engine.handle.remote(carried=req)

    async def _forward(self, req: Carried, send: Send) -> None:
        for attempt in range(self.retries + 1):
            gen = self._call(req)
            start: Start | None = None
            first: bytes | None = None
            try:
                async for part in gen:
                    if isinstance(part, Start):
                        start = part
                        continue
                    first = part
                    break
            except REPLICA_GONE as e:
                log.warning("a replica died before answering %s %s (try %d): %s", req.method, req.path,
                            attempt + 1, type(e).__name__)
                continue  # nothing reached the client: send it again
            except BaseException:
                gen.cancel()
                raise
            break
        else:
            await _error(send, ReplicaLost(f"the replicas serving this request died ({self.retries + 1} tries)"))
            return
        if start is None:
            gen.cancel()
            await _error(send, ReplicaLost("the replica answered nothing"))
            return
        streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
        done = first is None
        try:
            if first is not None:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                try:
                    async for part in gen:
                        if isinstance(part, bytes):
                            await send({"type": "http.response.body", "body": part, "more_body": True})
                except REPLICA_GONE as e:
                    log.warning("a replica died while answering %s %s: %s", req.method, req.path, type(e).__name__)
                    cut = ReplicaLost("the replica serving this request died; the answer is incomplete")
                    if streaming:
                        await send({"type": "http.response.body", "body": stream_error(req.path, cut),
                                    "more_body": True})
                done = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            if not done:  # the client went away (or sending failed): stop the replica's work
                gen.cancel()


def deployment_class() -> Any:
    """Ingress as a Serve deployment (options are set by superslm.ray.app)."""
    return serve.deployment(serve.ingress()(Ingress), name="SuperSLMIngress")
