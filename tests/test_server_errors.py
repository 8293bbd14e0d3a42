"""Bad input, auth, limits and failures: each answers the right status in OpenAI's error shape, no
error echoes its input back, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch

import superslm
from superslm.errors import InvalidArgument
from tests.test_server_helpers import LiveServer, assert_error, metrics, slow_steps, tiny_folder, wait_for

CONTEXT = 64
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model() -> superslm.Model:
    return superslm.load(tiny_folder("llama")[0])


@pytest.fixture(scope="module")
def server(model):
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=CONTEXT, served_model_name="tiny", api_key=KEY, max_waiting=8,
                     max_body_bytes=20_000)
    with LiveServer(app) as s:
        yield s


def post(server: LiveServer, path: str, body: object = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = dict(AUTH if headers is None else headers)
    if raw is not None:
        return httpx.post(f"{server.url}{path}", content=raw, headers={**h, "content-type": "application/json"},
                          timeout=30)
    return httpx.post(f"{server.url}{path}", json=body, headers=h, timeout=30)


def still_serving(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

BAD_400 = [
    # (path, body or raw bytes, param or None)
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'"a string"', None),
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
    ("/v1/completions", {**COMP, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMP, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 3, "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {**COMP, "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {**COMP, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**COMP, "n": 0}, "n"),
    ("/v1/completions", {**COMP, "n": 129}, "n"),
    ("/v1/completions", {**COMP, "n": 11}, "n"),  # in OpenAI's range, beyond this server's 2 + 8
    ("/v1/completions", {**COMP, "logit_bias": {"300": 5}}, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"fox": 5}}, "logit_bias"),
    ("/v1/completions", {**COMP, "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {**COMP, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMP, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**COMP, "prompt": [5, 300]}, "prompt"),
    ("/v1/completions", {**COMP, "prompt": ""}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/completions", {**COMP, "stop": ""}, "stop"),
    # fields that would change the answer and are not implemented: refused, never silently ignored
    ("/v1/completions", {**COMP, "min_tokens": 2000}, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {**COMP, "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {**COMP, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {**COMP, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {**COMP, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "bad_words": [""]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": False}, "min_tokens"),  # a bool is not a count
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT["messages"], "continue_final_message": True}, "continue_final_message"),
    # a seed outside int64 would wrap (seed 0 == 2**64)
    ("/v1/completions", {**COMP, "seed": 2**64}, "seed"),
    ("/v1/completions", {**COMP, "seed": 2**63}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
]


NEUTRAL = {"min_tokens": 0, "prompt_logprobs": None, "truncate_prompt_tokens": None, "use_beam_search": False,
           "allowed_token_ids": None, "bad_words": [], "echo": False, "chat_template": None, "functions": [],
           "function_call": None, "continue_final_message": False, "include_stop_str_in_output": False}


def test_neutral_values_and_seed_bounds_accepted(server) -> None:
    # a client that sends a refused field at its neutral value (as vLLM's defaults) is served
    for seed in (2**63 - 1, -(2**63)):
        r = post(server, "/v1/chat/completions", {**CHAT, **NEUTRAL, "seed": seed})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", BAD_400, ids=[f"{i}-{c[0].split('/')[-1]}" for i, c in enumerate(BAD_400)])
def test_bad_input_400(server, path, body, param) -> None:
    r = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    err = assert_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_context_length_exceeded(server, model) -> None:
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 30
    assert len(model.tokenizer.encode(long_prompt)) > CONTEXT
    assert_error(post(server, "/v1/completions", {**COMP, "prompt": long_prompt}), 400, "context_length_exceeded")
    n = len(model.tokenizer.encode("hi"))
    # prompt + max_tokens one past the context is refused; exactly the context is fine
    r = post(server, "/v1/completions", {**COMP, "max_tokens": CONTEXT - n + 1})
    assert_error(r, 400, "context_length_exceeded", "max_tokens")
    ok = post(server, "/v1/completions", {**COMP, "max_tokens": CONTEXT - n, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == CONTEXT - n
    # a stream that fails before its first token is a plain HTTP error, not a broken stream
    r = post(server, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": CONTEXT})
    assert_error(r, 400, "context_length_exceeded")
    still_serving(server)


def test_errors_do_not_echo_input(server) -> None:
    secret = "Z" * 5000
    for body in ({**COMP, "temperature": secret}, {**COMP, "model": secret}, {**COMP, "logit_bias": {secret: 1}},
                 {**CHAT, "messages": [{"role": secret, "content": secret}]}, {**COMP, "stop": [secret] * 2}):
        r = post(server, "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
        assert 400 <= r.status_code < 500
        assert secret[:500] not in r.text and len(r.text) < 1000, r.text[:200]
    still_serving(server)


def test_auth(server) -> None:
    base = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        base.models.list()
    assert e.value.status_code == 401
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            assert_error(post(server, path, CHAT, headers=headers), 401, "invalid_api_key")
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 401
        assert httpx.get(f"{server.url}/health", headers=headers).status_code == 200  # public
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    still_serving(server)


def test_unknown_model_route_and_method(server) -> None:
    r = post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-9"})
    err = assert_error(r, 404, "model_not_found", "model")
    assert "gpt-9" in err["message"]
    assert_error(httpx.get(f"{server.url}/v1/models/gpt-9", headers=AUTH), 404, "model_not_found")
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    still_serving(server)


def test_oversized_body(server) -> None:
    big = {**COMP, "prompt": "x" * 30_000}
    assert_error(post(server, "/v1/completions", big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit holds on the bytes read
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"y" * 1000
        yield b'"}'

    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers)
    assert_error(r, 413, "request_too_large")
    still_serving(server)


def test_queue_full_503(model) -> None:
    from superslm.serve import create_app

    app = create_app(model, slots=1, max_waiting=1, context=512, served_model_name="tiny")
    slow_steps(app)  # the first request lasts about 5 s, unless cancelled
    with LiveServer(app) as s:
        long = {"model": "tiny", "prompt": "hold", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=long) as r1:
            assert r1.status_code == 200
            lines = r1.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # running: holds the only slot
            second: dict[str, httpx.Response] = {}
            t = threading.Thread(target=lambda: second.update(r=httpx.post(
                f"{s.url}/v1/completions", json={**COMP, "max_tokens": 3}, timeout=60)))
            t.start()
            wait_for(lambda: s.state.loop.admitted == 2)  # the second one waits: the queue is full
            r = httpx.post(f"{s.url}/v1/completions", json=COMP, timeout=30)
            assert_error(r, 503, "queue_full")
            assert r.json()["error"]["type"] == "service_unavailable_error"
            client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="tiny", messages=CHAT["messages"])
            assert e.value.status_code == 503
        # leaving the stream disconnects it: its slot goes to the waiting request
        t.join(30)
        assert second["r"].status_code == 200
        m = metrics(s.url)
        assert m['superslm_requests_total{endpoint="completions",outcome="rejected"}'] == 1
        assert m['superslm_requests_total{endpoint="chat_completions",outcome="rejected"}'] == 1
        assert m['superslm_requests_total{endpoint="completions",outcome="cancelled"}'] == 1
        assert httpx.post(f"{s.url}/v1/completions", json=COMP, timeout=30).status_code == 200


def test_disconnect_cancels_non_stream(model) -> None:
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=512, served_model_name="tiny")
    slow_steps(app)  # 480 tokens would take about 5 s
    with LiveServer(app) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={**COMP, "max_tokens": 480, "ignore_eos": True}, timeout=0.5)
        # cancelled at once: its pages are back long before 480 tokens could have been made
        wait_for(lambda: metrics(s.url)['superslm_sequences_finished_total{reason="cancelled"}'] == 1, timeout=3)
        m = metrics(s.url)
        assert m["superslm_requests_running"] == 0 and m["superslm_kv_pages_used"] == 0
        assert m["superslm_generation_tokens_total"] < 480
        assert m['superslm_requests_total{endpoint="completions",outcome="cancelled"}'] == 1
        s.state.engine.pool.check()


def test_engine_add_failure_before_first_token(model) -> None:
    """An error the engine raises after admission still reaches a stream as a plain HTTP error."""
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=CONTEXT, served_model_name="tiny")
    engine = app.state.server.engine
    real_add = engine.add

    def add(request):
        if request.sampling.seed == 666:
            raise InvalidArgument("refused by the engine")
        return real_add(request)

    engine.add = add
    with LiveServer(app) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={**COMP, "seed": 665, "n": 2, "stream": True}, timeout=30)
        assert_error(r, 400, "invalid_argument")  # choice 1 has seed 666
        wait_for(lambda: s.state.loop.admitted == 0)
        assert httpx.post(f"{s.url}/v1/completions", json=COMP, timeout=30).status_code == 200
        wait_for(lambda: metrics(s.url)["superslm_kv_pages_used"] == 0)


def test_dead_engine_loop(model) -> None:
    from superslm.serve import create_app

    app = create_app(model, slots=2, context=CONTEXT, served_model_name="tiny")
    engine = app.state.server.engine

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a lower layer")

    engine.advance = broken
    with LiveServer(app) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert_error(httpx.post(f"{s.url}/v1/completions", json=COMP, timeout=30), 500, "internal_error")
        r = httpx.get(f"{s.url}/health")
        assert_error(r, 503, "engine_stopped")
        assert_error(httpx.post(f"{s.url}/v1/completions", json=COMP, timeout=30), 500, "internal_error")
        assert metrics(s.url)["superslm_engine_alive"] == 0


def test_found_in_review_no_hang_no_500_no_silent_grammar(server) -> None:
    """A grammar that forces more than max_tokens answers (it hung, and its slot leaked); a template kwarg
    named like a renderer's parameter is not a 500; a constraint that admits no first token is a 400."""
    for _ in range(3):  # more than the server's 2 slots: a leak would leave the last ones waiting
        r = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 1, "guided_regex": "hello"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"self": 1}})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {**CHAT, "guided_regex": "[^\\s\\S]"})
    assert_error(r, 400)
    still_serving(server)


def _strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in a JSON body")

    return json.loads(text, parse_constant=refuse)


def test_nan_logits_end_the_request_with_error_and_valid_json() -> None:
    """Activations that overflow at run time (weights poisoned after the load checks): a request with logprobs
    ends "error" with no NaN in its body or stream, and the server goes on serving."""
    from superslm.serve import create_app
    from superslm.serve.output import _num

    broken = superslm.load(tiny_folder("llama")[0])
    with torch.no_grad():
        broken.net.norm_weight.fill_(float("nan"))  # the final norm: every logit NaN
    app = create_app(broken, slots=2, context=CONTEXT, served_model_name="tiny")
    with LiveServer(app) as s:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "logprobs": 2}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        out = _strict_json(r.text)
        assert out["choices"][0]["finish_reason"] == "error"
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                "logprobs": True, "top_logprobs": 2, "stream": True}) as r:
            frames = [_strict_json(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert frames[-1]["choices"][0]["finish_reason"] == "error"
        assert metrics(s.url)['superslm_sequences_finished_total{reason="not_finite"}'] == 2
    assert _num(float("-inf")) == -9999.0 and _num(-1.5) == -1.5 and _num(float("nan")) == -9999.0
