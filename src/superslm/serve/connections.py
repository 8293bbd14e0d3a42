"""What a connection may hold: uvicorn's HTTP protocol with a header deadline, and the connection limit.

uvicorn closes a connection idle between requests after `timeout_keep_alive`, but waits for a request's
headers forever: a client that connects and sends nothing, or a header a byte a minute (slowloris), holds a
socket and a file descriptor for as long as it likes, and a few hundred of them exhaust the process's
descriptors. `HeaderTimedH11` closes a connection whose request line and headers are not complete within
`header_timeout` seconds of its first byte (or of the connection); `connection_limit` picks uvicorn's
`limit_concurrency` (connections and tasks beyond it get a 503) below the descriptors this process may open.

A drain that outlives `--drain-timeout` cancels the requests still running; uvicorn then answers a plain-text
500 and logs a traceback. `ShutdownCut` answers them as the API does: a JSON 503 where nothing was sent yet,
an error event and `[DONE]` in a stream.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: seconds a client has to send a request's line and headers
DEFAULT_HEADER_TIMEOUT = 10.0
#: connections served at once by default (each holds a descriptor; streams are long-lived connections)
DEFAULT_CONNECTIONS = 512
#: descriptors kept for everything else: the model's files, the listening socket, logs, pipes
_RESERVED_FDS = 64


class HeaderTimedH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not in within `header_timeout`."""

    header_timeout = DEFAULT_HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()  # a new request begins: its headers have until the deadline
        super().data_received(data)
        if not self._between_requests():
            self._disarm()  # its headers are in: the route runs for as long as it needs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # the next request may already be buffered (pipelining); else keep-alive's own timer runs
        if self._between_requests():
            self._disarm()

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.logger.info("closed a connection whose request headers took over %g s", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def with_header_timeout(seconds: float) -> type[HeaderTimedH11]:
    """The protocol class for uvicorn's `http=` with a header deadline of `seconds`."""
    return type("HeaderTimedH11", (HeaderTimedH11,), {"header_timeout": float(seconds)})


def connection_limit(wanted: int | None = None) -> int:
    """`wanted` connections (default DEFAULT_CONNECTIONS), at most what the descriptor limit leaves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - _RESERVED_FDS if soft != resource.RLIM_INFINITY else 1 << 20
    return max(1, min(DEFAULT_CONNECTIONS if wanted is None else wanted, room))


def uvicorn_options(header_timeout: float, keep_alive: float, connections: int | None) -> dict[str, Any]:
    """uvicorn.Config keywords for these limits."""
    return {"http": with_header_timeout(header_timeout), "timeout_keep_alive": keep_alive,
            "limit_concurrency": connection_limit(connections)}


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

#: what a request cut by the end of a drain is told
SHUTDOWN_MESSAGE = "the server shut down before this request finished"


class ShutdownCut:
    """ASGI middleware: a request cancelled while the server shuts down (`draining()` true) ends with an
    OpenAI-shaped error (`error(status, message, code)` gives its body) instead of uvicorn's plain 500."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool], error: Callable[[int, str, str], dict]) -> None:
        self.app, self.draining, self.error = app, draining, error

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:  # fmt: skip
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: dict[str, Any] = {}

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                started["stream"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                        for k, v in message.get("headers", []))  # fmt: skip
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                started["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if not self.draining() or started.get("done"):
                raise
            body = {"error": self.error(503, SHUTDOWN_MESSAGE, "server_shutdown")}
            if not started:
                data = json.dumps(body).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(data)).encode())]})  # fmt: skip
                await send({"type": "http.response.body", "body": data})
            elif started.get("stream"):
                text = f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": text.encode()})
            else:
                await send({"type": "http.response.body", "body": b""})
            # the request is answered: the task ends here rather than as uvicorn's cancelled 500
