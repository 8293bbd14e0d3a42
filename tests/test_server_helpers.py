"""Shared pieces of the server tests (no tests here): a tiny model, a live uvicorn server in a thread,
a Prometheus text parser and an SSE reader."""

from __future__ import annotations

import json
import math
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

_TINY: dict[str, tuple[Path, Any]] = {}


def tiny_folder(family: str = "llama") -> tuple[Path, Any]:
    """A tiny random-weight HF folder (built once per process) and its transformers model."""
    if family not in _TINY:
        from tests.tiny_models import build_hf_model

        folder = Path(tempfile.mkdtemp(prefix=f"superslm-serve-{family}-"))
        hf = build_hf_model(family, folder)
        _TINY[family] = (folder, hf)
    return _TINY[family]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        # bind first and hand the socket over: no race for the port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @property
    def state(self) -> Any:
        return self.app.state.server

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET /metrics parsed: {'name{labels}': value} (labels as written)."""
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = math.inf if value == "+Inf" else float(value)
    return out


def wait_for(check: Callable[[], bool], timeout: float = 10.0, every: float = 0.02) -> None:
    """Poll until `check()` is true, or fail."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(every)


def read_sse(text: str) -> list[Any]:
    """The frames of an SSE body, each `data: <json>\\n\\n`; [DONE] must be the last one and comes back as None."""
    assert text.endswith("\n\n"), text[-80:]
    frames = text[:-2].split("\n\n")
    out: list[Any] = []
    for i, frame in enumerate(frames):
        assert frame.startswith("data: "), frame[:80]
        data = frame[len("data: "):]
        if data == "[DONE]":
            assert i == len(frames) - 1, "[DONE] is not the last frame"
            out.append(None)
        else:
            out.append(json.loads(data))
    assert out and out[-1] is None, "the stream does not end with [DONE]"
    return out


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is an OpenAI-shaped error with that status (and code, param when given)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and isinstance(err["code"], str)
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def slow_steps(app, seconds: float = 0.01) -> None:
    """Make each engine step take at least `seconds`, so that a request lasts long enough to act on."""
    engine = app.state.server.engine
    advance = engine.advance

    def slow_advance(*args, **kwargs):
        time.sleep(seconds)
        return advance(*args, **kwargs)

    engine.advance = slow_advance
