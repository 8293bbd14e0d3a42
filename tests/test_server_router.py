"""Several models behind one server (serve/router.py), live on 127.0.0.1, driven by the official openai and
anthropic clients: each request reaches the model it names (its answer is that model's own), models load at
their first request, the least recently used idle one unloads past models_max, idle ones unload on their own,
and /v1/models, /metrics (parsed by prometheus_client) and /health speak for all of them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import superslm
from superslm import Request, Sampling
from superslm.serve.router import ModelSpec, Router
from tests.test_server_helpers import LiveServer, slow_steps, tiny_folder, wait_for

ASK = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def folders():
    return {"a": tiny_folder("llama")[0], "b": tiny_folder("qwen3")[0]}


def specs(folders, **options) -> list[ModelSpec]:
    return [ModelSpec(name, str(folder), {"slots": 2, "context": 256, **options}) for name, folder in folders.items()]


def status(url: str, **kw) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", **kw).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def library_answer(folder, n: int) -> str:
    model = superslm.load(folder)
    engine = model.engine(slots=1, context=256)
    (done,) = engine.generate([Request(model.chat_tokens(ASK), n, Sampling(temperature=0, ignore_eos=True))])
    return model.tokenizer.decode(done.tokens)


def test_requests_reach_their_model_and_lru_unloads(folders) -> None:
    with LiveServer(Router(specs(folders), models_max=1)) as s:
        assert status(s.url) == {"a": "unloaded", "b": "unloaded"}
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = oai.chat.completions.create(model="a", messages=ASK, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert r.model == "a" and r.choices[0].message.content == library_answer(folders["a"], 6)
        assert status(s.url) == {"a": "loaded", "b": "unloaded"}
        claude = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        m = claude.messages.create(model="b", messages=ASK, max_tokens=6,
                                   extra_body={"temperature": 0, "ignore_eos": True})
        assert m.model == "b" and m.content[0].text == library_answer(folders["b"], 6)
        # one model at most: loading b unloaded a, the least recently used
        assert status(s.url) == {"a": "unloaded", "b": "loaded"}
        card = httpx.get(f"{s.url}/v1/models/b").json()
        assert card["max_model_len"] == 256
        # a stored response is read back through the router from the model that stored it
        stored = oai.responses.create(model="b", input="hi", max_output_tokens=2)
        assert oai.responses.retrieve(stored.id).id == stored.id
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="c", messages=ASK, max_tokens=2)
        with pytest.raises(anthropic.NotFoundError) as e:
            claude.messages.create(model="c", messages=ASK, max_tokens=2)
        assert e.value.body["type"] == "error"
        # no model named: the first one (as one model's server answers a request without `model`)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "a"
        assert status(s.url) == {"a": "loaded", "b": "unloaded"}

        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{s.url}/metrics").text)}
        assert [x.value for x in families["superslm_models_loaded"].samples] == [1]
        running = [x for x in families["superslm_requests_running"].samples]
        assert [x.labels for x in running] == [{"model": "a"}]
        assert [x.labels for x in families["vllm:num_requests_running"].samples] == [{"model_name": "a"}]
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        assert httpx.get(s.url + "/").status_code == 200  # the chat page lists every model


def test_busy_models_are_not_unloaded(folders) -> None:
    def slow_loader(spec: ModelSpec):
        from superslm.serve.router import load_spec

        app = load_spec(spec, {})
        slow_steps(app, 0.02)
        return app

    with LiveServer(Router(specs(folders), models_max=1, loader=slow_loader)) as s:
        done = threading.Event()

        def long_stream() -> None:
            body = {"model": "a", "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
            done.set()

        t = threading.Thread(target=long_stream)
        t.start()
        wait_for(lambda: status(s.url)["a"] == "loaded", timeout=60)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
        assert not done.is_set()  # the stream on a went on
        t.join(120)
        assert done.is_set()
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and status(s.url) == {"a": "unloaded", "b": "loaded"}


def test_idle_models_unload_on_their_own(folders) -> None:
    # 1.5 s: a one-token request to b takes well under it even on a loaded 2-core machine (at 0.6 s, load 11 let b
    # idle out between two of them)
    with LiveServer(Router(specs(folders), idle_unload=1.5)) as s:
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        oai.completions.create(model="a", prompt="hi", max_tokens=2)
        oai.completions.create(model="b", prompt="hi", max_tokens=2)
        assert status(s.url) == {"a": "loaded", "b": "loaded"}  # no limit: both stay while used
        # b kept busy, a left alone: the idle rule unloads a only
        deadline = time.monotonic() + 10
        while status(s.url)["a"] == "loaded" and time.monotonic() < deadline:
            oai.completions.create(model="b", prompt="hi", max_tokens=1)
            time.sleep(0.1)
        assert status(s.url) == {"a": "unloaded", "b": "loaded"}
        wait_for(lambda: status(s.url)["b"] == "unloaded", timeout=10)
        # and a request loads it again
        assert oai.completions.create(model="a", prompt="hi", max_tokens=2).model == "a"


def test_an_encoder_beside_a_language_model(folders, tmp_path) -> None:
    from tests.test_encoders import build_bert_family

    enc = tmp_path / "enc"
    build_bert_family(enc, "bert")
    router = Router([ModelSpec("chat", str(folders["a"]), {"context": 256}), ModelSpec("embed", str(enc))])
    with LiveServer(router) as s:
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        vectors = oai.embeddings.create(model="embed", input=["a cat", "a dog"]).data
        assert len(vectors) == 2 and len(vectors[0].embedding) > 0
        assert oai.chat.completions.create(model="chat", messages=ASK, max_tokens=2).model == "chat"
        assert status(s.url) == {"chat": "loaded", "embed": "loaded"}


def test_a_request_without_the_key_loads_nothing(folders) -> None:
    with LiveServer(Router(specs(folders), api_key="sekrit")) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 401
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        key = {"headers": {"Authorization": "Bearer sekrit"}}
        assert status(s.url, **key) == {"a": "unloaded", "b": "unloaded"}
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}, timeout=120,
                       **key)
        assert r.status_code == 200 and status(s.url, **key)["a"] == "loaded"


def test_bad_model_files_are_clear_errors(folders, tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 20)
    with LiveServer(Router([ModelSpec("a", str(folders["a"])), ModelSpec("bad", str(broken))])) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "bad", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
        assert status(s.url) == {"a": "unloaded", "bad": "unloaded"}
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200


def test_serve_several_from_the_command_line(folders, tmp_path) -> None:
    from tests.test_server_load import _free_port, _healthy

    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "one", "model": str(folders["a"]), "context": 128},
                                             {"name": "two", "model": str(folders["b"]), "slots": 1}],
                                  "models_max": 1}))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "superslm.cli", "serve", "--config", str(config), f"three={folders['a']}",
           "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _healthy(url), timeout=90, every=0.2)
        assert status(url) == {"one": "unloaded", "two": "unloaded", "three": "unloaded"}
        r = httpx.post(f"{url}/v1/completions", json={"model": "one", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200
        assert httpx.get(f"{url}/v1/models/one").json()["max_model_len"] == 128
        proc.terminate()
        assert proc.wait(60) == 0
        log = proc.stdout.read().decode()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "3 models (one, two, three), each loaded at its first request, at most 1 loaded" in log, log
    bad = tmp_path / "bad.json"
    bad.write_text('{"models": [{"name": "x"}]}')
    out = subprocess.run([sys.executable, "-m", "superslm.cli", "serve", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and 'models[0] needs "model"' in out.stderr


def test_the_official_clients_through_a_router(folders) -> None:
    """Chat, the Responses API (streamed, with a forced function call) and the Messages API (streamed, with a
    forced tool_use) through one router serving two models, then one of them unloaded by the idle rule."""
    from tests.test_server_anthropic import WEATHER, WEATHER_SCHEMA
    from tests.test_server_responses import WEATHER as RESPONSES_WEATHER

    grammar_ends = {"temperature": 1.0, "seed": 7}  # seeded: greedy fills every whitespace gap JSON allows
    with LiveServer(Router(specs(folders, context=2048), idle_unload=4.0)) as s:
        oai = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
        claude = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        chat = oai.chat.completions.create(model="b", messages=ASK, max_tokens=4, temperature=0)
        assert chat.model == "b"
        events = list(oai.responses.create(model="a", input="Weather in Paris?", tools=[RESPONSES_WEATHER],
                                           tool_choice="required", max_output_tokens=400, stream=True,
                                           extra_body=grammar_ends))
        calls = [i for i in events[-1].response.output if i.type == "function_call"]
        assert calls, events[-1].response
        call = calls[0]
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
        with claude.messages.stream(model="a", messages=ASK, max_tokens=400, tools=[WEATHER],
                                    tool_choice={"type": "any"}, extra_body=grammar_ends) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.model == "a"
        jsonschema.validate(final.content[-1].input, WEATHER_SCHEMA)
        claude.messages.create(model="b", messages=ASK, max_tokens=2)  # b used again: both are fresh
        assert status(s.url) == {"a": "loaded", "b": "loaded"}
        deadline = time.monotonic() + 15
        while status(s.url)["b"] == "loaded" and time.monotonic() < deadline:
            oai.completions.create(model="a", prompt="hi", max_tokens=1)
            time.sleep(0.2)
        assert status(s.url) == {"a": "loaded", "b": "unloaded"}


def test_a_memory_budget_unloads_to_fit(folders) -> None:
    from superslm.serve.router import _Hosted, _weight_bytes

    sizes = {name: _weight_bytes(_Hosted(ModelSpec(name, str(f)))) for name, f in folders.items()}
    assert all(n > 0 for n in sizes.values())
    # room for either model, not both: loading b unloads a
    with LiveServer(Router(specs(folders), memory_budget=max(sizes.values()) + 1)) as s:
        for name in ("a", "b"):
            r = httpx.post(f"{s.url}/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}, timeout=120)
            assert r.status_code == 200
        assert status(s.url) == {"a": "unloaded", "b": "loaded"}
    # room for both: both stay
    with LiveServer(Router(specs(folders), memory_budget=sum(sizes.values()) + 1)) as s:
        for name in ("a", "b"):
            httpx.post(f"{s.url}/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}, timeout=120)
        assert status(s.url) == {"a": "loaded", "b": "loaded"}
