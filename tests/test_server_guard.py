"""What a web page can make the local server do: a rebinding DNS name, a cross-site page and a body a browser
sends without asking (text/plain, a form) are refused before any route runs; CORS answers only the origins
given. httpx sends the headers a browser would; the rules themselves are checked without a server too."""

from __future__ import annotations

import httpx
import pytest

import superslm
from superslm.serve.guard import HostRules, host_name, is_loopback
from tests.test_server_helpers import LiveServer, tiny_folder

BODY = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def model() -> superslm.Model:
    folder, _ = tiny_folder("llama")
    return superslm.load(folder)


@pytest.fixture(scope="module")
def server(model):
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=64, served_model_name="tiny", cors_origins=["https://app.example"])
    with LiveServer(app) as s:
        yield s


def _code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


def test_a_rebinding_host_is_refused_before_any_route(server) -> None:
    """A page whose DNS name now points at 127.0.0.1 sends its own name as Host: it reads nothing."""
    for path in ("/v1/models", "/health", "/no-such-route"):
        r = httpx.get(f"{server.url}{path}", headers={"host": "evil.example"})
        assert r.status_code == 403 and _code(r) == "host_not_allowed", (path, r.text)
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={"host": "evil.example:8000"})
    assert r.status_code == 403
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "[::1]", "app.localhost"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 200, host


def test_a_cross_site_page_is_refused_and_a_listed_one_gets_cors(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and _code(r) == "origin_not_allowed"
    assert httpx.get(f"{server.url}/v1/models", headers={"origin": "null"}).status_code == 403
    ok = httpx.post(f"{server.url}/v1/completions", json=BODY, headers={"origin": "https://app.example"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    pre = httpx.options(f"{server.url}/v1/completions", headers={
        "origin": "https://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
    # the server's own origin (a page it would serve) is same-site
    assert httpx.get(f"{server.url}/v1/models", headers={"origin": server.url}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_bodies_a_browser_sends_unasked_are_refused(server, content_type) -> None:
    """A cross-site form or fetch with these types needs no preflight: the body must not run."""
    import json

    headers = {} if content_type is None else {"content-type": content_type}
    before = dict(server.state.metrics.requests)
    r = httpx.post(f"{server.url}/v1/completions", content=json.dumps(BODY).encode(), headers=headers)
    assert r.status_code == 415 and _code(r) == "unsupported_media_type", r.text
    assert server.state.metrics.requests == before  # no route ran
    ok = httpx.post(f"{server.url}/v1/completions", content=json.dumps(BODY).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_the_rules_alone() -> None:
    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM.:80") == "example.com"
    assert host_name("a:b") is None and host_name("[::1]x") is None and host_name("") is None
    default = HostRules()
    assert default.host_ok("127.0.0.1") and default.host_ok("::1") and default.host_ok("x.localhost")
    assert not default.host_ok("127.0.0.1.nip.io") and not default.host_ok(None)
    assert not default.host_ok("localhost.evil.example")
    sub = HostRules([".example.com"])
    assert sub.host_ok("example.com") and sub.host_ok("api.example.com") and not sub.host_ok("badexample.com")
    assert HostRules(["*"]).host_ok("anything")
    assert default.origin_ok("http://localhost:3000") and not default.origin_ok("file://")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


def test_the_cli_default_follows_the_bind_address() -> None:
    from superslm.cli import build_parser

    ns = build_parser().parse_args(["serve", "--allowed-hosts", "box.lan", "--cors-origins", "https://a.b"])
    assert ns.allowed_hosts == ["box.lan"] and ns.cors_origins == ["https://a.b"]


def test_a_hostile_chat_template_cannot_wedge_the_server(tmp_path) -> None:
    """A model file's template with nested loops rendered for minutes; eight abandoned requests held every
    worker thread and later requests hung. Each render now ends within its budget with a 400."""
    import concurrent.futures
    import time

    from superslm.serve import create_app
    from superslm.tokenizer import ChatTemplate

    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    if model.tokenizer.chat_template is None:
        pytest.skip("the tiny model has no chat template to replace")
    model._template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                   "{% endfor %}")
    with LiveServer(create_app(model, slots=2, context=64, served_model_name="tiny")) as s:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def abandoned(_: int) -> None:
            try:
                httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=0.5)
            except httpx.TimeoutException:
                pass

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            list(pool.map(abandoned, range(12)))
        start = time.monotonic()
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and "budget" in r.json()["error"]["message"]
        ok = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=60)
        assert ok.status_code == 200 and time.monotonic() - start < 40
