"""Connections against a real uvicorn server with `superslm serve`'s options (serve/connections.py): a client
that sends no request, or its headers too slowly, is cut off; a normal client, also keeping its connection
alive between requests, is served; connections past the limit get a 503; the limit stays below the open-file
limit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from superslm.serve import connections
from superslm.serve.connections import connection_limit, uvicorn_options


async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        import asyncio

        await asyncio.sleep(1.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(**options) -> Iterator[int]:  # type: ignore[no-untyped-def]
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture()
def port() -> Iterator[int]:
    yield from serve(**uvicorn_options(header_timeout=0.6, keep_alive=3.0, connections=4))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (recv gives b"") within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False


def request(sock: socket.socket, path: str = "/") -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    sock.settimeout(10)
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(1024)
        assert chunk, data
        data += chunk
    return data


def test_a_silent_connection_is_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        t = time.monotonic()
        assert closed_within(s, 5)
        assert 0.4 < time.monotonic() - t < 3


def test_headers_sent_too_slowly_are_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        t = time.monotonic()
        for piece in (b"GET / HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n"):
            try:
                s.sendall(piece)
            except OSError:
                break
            time.sleep(0.25)  # each piece in time for uvicorn's keep-alive, the whole past the deadline
        assert closed_within(s, 5)
        assert time.monotonic() - t < 3


def test_normal_clients_and_keep_alive_are_served(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert request(s).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # idle past the header deadline, within keep-alive: the next request still runs
        assert request(s).startswith(b"HTTP/1.1 200")
        # a route that runs longer than the header deadline is not cut: the deadline covers headers only
        assert request(s, "/slow").startswith(b"HTTP/1.1 200")
        assert closed_within(s, 6)  # keep-alive's own timeout ends it


def test_connections_past_the_limit_get_503(port: int) -> None:
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            extra.settimeout(5)
            assert extra.recv(1024).startswith(b"HTTP/1.1 503")
    finally:
        for s in held:
            s.close()


def test_the_limit_leaves_room_below_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert connection_limit() == connections.DEFAULT_CONNECTIONS or connection_limit() < 512
    monkeypatch.setattr(connections.resource, "getrlimit", lambda what: (256, 4096))
    assert connection_limit() == 256 - 64
    assert connection_limit(100) == 100
    assert connection_limit(10_000) == 192


async def forever(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b'data: {"a": 1}\n\n', "more_body": True})
    await asyncio.Event().wait()


def test_requests_cut_by_the_end_of_a_drain_get_api_errors() -> None:
    from superslm.serve.app import error_payload
    from superslm.serve.connections import SHUTDOWN_MESSAGE, ShutdownCut

    cut = ShutdownCut(forever, draining=lambda: True, error=error_payload)
    config = uvicorn.Config(cut, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
                            timeout_graceful_shutdown=0.5, **uvicorn_options(10.0, 5.0, None))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    plain, stream = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
    plain.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    stream.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    time.sleep(0.3)
    server.should_exit = True  # as SIGTERM: the drain waits 0.5 s, then cancels both
    got = []
    for s in (plain, stream):
        s.settimeout(10)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        got.append(data.decode())
        s.close()
    thread.join(10)
    head, _, body = got[0].partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503") and "application/json" in head
    assert SHUTDOWN_MESSAGE in body and '"code": "server_shutdown"' in body
    assert got[1].startswith("HTTP/1.1 200") and 'data: {"a": 1}' in got[1]
    assert SHUTDOWN_MESSAGE in got[1] and got[1].index(SHUTDOWN_MESSAGE) < got[1].index("data: [DONE]")
