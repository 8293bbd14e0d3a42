"""The server under load with disconnects, draining, and SIGTERM on a real `superslm serve` process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import superslm
from tests.test_server_helpers import (
    LiveServer,
    assert_error,
    metrics,
    read_sse,
    slow_steps,
    tiny_folder,
    wait_for,
)

CLIENTS, ROUNDS, TOKENS = 32, 3, 24


@pytest.fixture(scope="module")
def model() -> superslm.Model:
    return superslm.load(tiny_folder("llama")[0])


async def _client(url: str, i: int, leave: bool) -> dict:
    """One streaming client: reads to the end, or leaves after two frames."""
    chat = i % 2 == 0
    body: dict = {"model": "tiny", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"client {i} says hello"}]
    else:
        body["prompt"] = f"client {i}: the quick brown fox"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": (await r.aread()).decode()[:200]}
        if leave:
            frames = 0
            async for line in r.aiter_lines():
                frames += line.startswith("data: ")
                if frames == 2:
                    break
            return {"status": 200, "left": True}  # leaving the block closes the connection mid-stream
        text = (await r.aread()).decode()
        return {"status": 200, "left": False, "chat": chat, "text": text}


def _check_stream(res: dict) -> None:
    """A finished stream is well formed: frames, one choice to its end, usage last, then [DONE]."""
    frames = read_sse(res["text"])[:-1]
    usage = frames[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == TOKENS
    assert all(f["usage"] is None for f in frames[:-1])
    ends = [c["finish_reason"] for f in frames[:-1] for c in f["choices"] if c["finish_reason"]]
    assert ends == ["length"]
    if res["chat"]:
        assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(f["object"] == "chat.completion.chunk" for f in frames)


def test_load_with_disconnects(model) -> None:
    from superslm.serve import create_app

    app = create_app(model, slots=8, context=128, max_waiting=64, served_model_name="tiny")
    slow_steps(app, 0.004)  # a stream lasts > 0.1 s: leaving after two frames is mid-stream
    with LiveServer(app) as s:

        async def rounds() -> list[dict]:
            out = []
            for _ in range(ROUNDS):
                out += await asyncio.gather(*(_client(s.url, i, leave=i % 3 == 0) for i in range(CLIENTS)))
            return out

        results = asyncio.run(rounds())
        assert [r for r in results if r["status"] != 200] == []
        done = [r for r in results if not r["left"]]
        left = [r for r in results if r["left"]]
        assert len(left) == ROUNDS * len(range(0, CLIENTS, 3))
        for r in done:
            _check_stream(r)

        # every request ends, and the pool holds nothing but evictable cached pages
        wait_for(lambda: s.state.loop.admitted == 0, timeout=10)
        m = metrics(s.url)
        assert m["superslm_requests_running"] == 0 and m["superslm_requests_waiting"] == 0
        assert m["superslm_kv_pages_used"] == 0
        assert m["superslm_kv_pages_cached"] + m["superslm_kv_pages_free"] == m["superslm_kv_pages_total"]
        s.state.engine.pool.check()
        req = 'superslm_requests_total{endpoint="%s",outcome="%s"}'
        success = m[req % ("completions", "success")] + m[req % ("chat_completions", "success")]
        cancelled = m[req % ("completions", "cancelled")] + m[req % ("chat_completions", "cancelled")]
        assert (success, cancelled) == (len(done), len(left))
        assert sum(v for k, v in m.items() if k.startswith("superslm_requests_total")) == len(results)
        seq = 'superslm_sequences_finished_total{reason="%s"}'
        assert (m[seq % "length"], m[seq % "cancelled"]) == (len(done), len(left))
        assert m["superslm_generation_tokens_total"] >= len(done) * TOKENS


def test_drain_refuses_new_and_finishes_in_flight(model) -> None:
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=256, served_model_name="tiny")
    slow_steps(app, 0.005)
    with LiveServer(app) as s:
        body = {"model": "tiny", "prompt": "drain", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            s.state.drain()  # what SIGTERM does first
            assert_error(httpx.get(f"{s.url}/health"), 503, "shutting_down")
            refused = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
            assert_error(refused, 503)
            rest = "\n".join(lines)
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in rest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_drains(tmp_path) -> None:
    """`superslm serve` in a process of its own: SIGTERM lets every request in flight finish, refuses new
    connections, and the process exits 0."""
    folder, _ = tiny_folder("llama")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "superslm.cli", "serve", "--model", str(folder), "--port", str(port),
           "--slots", "2", "--context", "512", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: _healthy(url), timeout=90, every=0.2)
        # served as its own name and as --model was typed (vLLM's default)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [folder.name, str(folder)]
        # 6 long streams on 2 slots: most of them still wait or run when the signal comes
        results: dict[int, list[str]] = {}
        started = threading.Event()

        def stream(i: int) -> None:
            body = {"model": folder.name, "prompt": f"stream {i}", "max_tokens": 480, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(lines)
                started.set()
                results[i] = [x for x in (first, *lines) if x]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert started.wait(60)

        def admitted() -> bool:
            m = metrics(url)
            return m["superslm_requests_running"] + m["superslm_requests_waiting"] == 6

        wait_for(admitted, timeout=30, every=0.01)  # all six are in, most of them waiting
        proc.send_signal(signal.SIGTERM)
        in_flight = 6 - len(results)
        assert in_flight >= 4  # the signal came while they ran or waited
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # the listening socket is closed
            httpx.get(f"{url}/health", timeout=5)
        for t in threads:
            t.join(120)
        t0 = time.monotonic()
        assert proc.wait(60) == 0
        exit_after_last = time.monotonic() - t0
        log = proc.stdout.read().decode()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the start-up line says what runs and where (before uvicorn's own lines, at any --log-level)
    pages = -(-512 // 16) * 2
    assert re.search(rf"superslm serve: {re.escape(folder.name)}, {re.escape(str(folder))} on cpu \(float32\), "
                     rf"context 512, slots 2, KV {pages} pages of 16 tokens \(\d+ MB\), threads \d+, "
                     rf"http://127.0.0.1:{port}/v1", log), log
    assert sorted(results) == list(range(6))
    assert exit_after_last < 10
    for lines in results.values():  # each stream ran to its end
        frames = read_sse("".join(f"{x}\n\n" for x in lines))
        assert frames[-2]["usage"]["completion_tokens"] == 480
        assert frames[-3]["choices"][0]["finish_reason"] == "length"


def test_default_served_names() -> None:
    from superslm.serve.cli import default_names

    assert default_names("SmolLM2-135M-Instruct.Q4_1.gguf", None) == ["SmolLM2-135M-Instruct.Q4_1.gguf",
                                                                     "smollm2-135m-instruct"]
    assert default_names("m.gguf", "m.gguf") == ["m.gguf"]
    assert default_names("tiny", "/x/tiny") == ["tiny", "/x/tiny"]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

