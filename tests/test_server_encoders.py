"""The encoder endpoints, live on 127.0.0.1: /v1/embeddings through the official openai client against
sentence-transformers' SentenceTransformer (all-MiniLM-L6-v2), /v1/rerank against its CrossEncoder (a tiny
random-weight BERT classifier), decoder embeddings against transformers, and the wrong-kind refusals."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

import superslm
from superslm.encoders import CrossEncoder, Encoder
from tests.test_encoders import build_bert_family
from tests.test_encoders_cross import DOCS, QUERY
from tests.test_server_helpers import LiveServer, assert_error, metrics, tiny_folder, wait_for

TEXTS = [
    "A man is eating food.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "東京は日本の首都です。",
    "   spaces   around   ",
    "Emoji 🚀 and accents: café, naïve, Ελληνικά, русский.",
    "x",
]
LONG = "The quick brown fox jumps over the lazy dog. " * 60  # about 600 tokens, past 256


def cosines(got: Any, want: Any) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(np.asarray(got, dtype=np.float32)),
                                                 torch.as_tensor(np.asarray(want, dtype=np.float32)), dim=-1)


@pytest.fixture(scope="module")
def st_model(minilm_folder: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder), device="cpu")


@pytest.fixture(scope="module")
def embed_server(minilm_folder: Path):
    from superslm.serve import create_app

    with LiveServer(create_app(Encoder.load(minilm_folder, device="cpu"), served_model_name="minilm")) as s:
        yield s


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _vectors(r: Any) -> np.ndarray:
    assert [d.index for d in r.data] == list(range(len(r.data)))
    assert all(d.object == "embedding" for d in r.data)
    return np.array([d.embedding for d in r.data], dtype=np.float32)


def test_models_and_health(client, embed_server, st_model) -> None:
    assert [m.id for m in client.models.list().data] == ["minilm"]
    card = httpx.get(f"{embed_server.url}/v1/models/minilm").json()
    assert card["max_model_len"] == st_model.max_seq_length == 256
    assert httpx.get(f"{embed_server.url}/health").json() == {"status": "ok"}


def test_string_and_list_match_sentence_transformers(client, st_model) -> None:
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == "minilm" and len(one.data) == 1
    want = st_model.encode([TEXTS[0]], convert_to_numpy=True)
    assert cosines(_vectors(one), want).min().item() >= 0.99999
    n_tokens = len(st_model.tokenizer(TEXTS[0])["input_ids"])
    assert one.usage.prompt_tokens == one.usage.total_tokens == n_tokens

    many = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    got, want = _vectors(many), st_model.encode(TEXTS, convert_to_numpy=True)
    assert got.shape == want.shape == (len(TEXTS), 384)
    assert cosines(got, want).min().item() >= 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the model normalizes
    assert many.usage.prompt_tokens == sum(len(x) for x in st_model.tokenizer(TEXTS)["input_ids"])


def test_base64_is_the_float_vectors(client, embed_server) -> None:
    # the openai client asks for base64 by default and decodes it itself
    default = _vectors(client.embeddings.create(model="minilm", input=TEXTS))
    floats = _vectors(client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float"))
    assert np.array_equal(default, floats)
    r = httpx.post(f"{embed_server.url}/v1/embeddings", timeout=60,
                   json={"model": "minilm", "input": TEXTS, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    assert np.array_equal(decoded, floats)


def test_token_ids(client, st_model) -> None:
    ids = st_model.tokenizer(TEXTS[:3])["input_ids"]  # with [CLS] ... [SEP]: the whole model input
    want = st_model.encode(TEXTS[:3], convert_to_numpy=True)
    single = client.embeddings.create(model="minilm", input=ids[1], encoding_format="float")
    assert cosines(_vectors(single), want[1:2]).min().item() >= 0.99999
    assert single.usage.prompt_tokens == len(ids[1])
    batch = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert cosines(_vectors(batch), want).min().item() >= 0.99999
    assert batch.usage.prompt_tokens == sum(map(len, ids))


def test_dimensions(client, st_model, minilm_folder) -> None:
    from sentence_transformers import SentenceTransformer

    st64 = SentenceTransformer(str(minilm_folder), device="cpu", truncate_dim=64)
    want = st64.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    for fmt in ({}, {"encoding_format": "float"}):  # the client's default: base64, decoded by the client
        got = _vectors(client.embeddings.create(model="minilm", input=TEXTS, dimensions=64, **fmt))
        assert got.shape == (len(TEXTS), 64)
        assert cosines(got, want).min().item() >= 0.99999
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized again after the cut
    full = _vectors(client.embeddings.create(model="minilm", input=TEXTS, dimensions=384, encoding_format="float"))
    assert cosines(full, st_model.encode(TEXTS, convert_to_numpy=True)).min().item() >= 0.99999


def test_truncation_is_opt_in(client, embed_server, st_model) -> None:
    url = f"{embed_server.url}/v1/embeddings"
    assert_error(httpx.post(url, json={"model": "minilm", "input": ["short", LONG]}, timeout=60), 400,
                 "context_length_exceeded", "input")
    want = st_model.encode([LONG], convert_to_numpy=True)  # sentence-transformers cuts at 256
    for extra in ({"truncate": True}, {"truncate_prompt_tokens": -1}):
        r = client.embeddings.create(model="minilm", input=LONG, encoding_format="float", extra_body=extra)
        assert cosines(_vectors(r), want).min().item() >= 0.99999
        assert r.usage.prompt_tokens == 256
    assert_error(httpx.post(url, json={"model": "minilm", "input": LONG, "truncate_prompt_tokens": 10}, timeout=60),
                 400, "invalid_argument", "truncate_prompt_tokens")
    ids = st_model.tokenizer(LONG, truncation=False)["input_ids"]
    assert_error(httpx.post(url, json={"model": "minilm", "input": [ids]}, timeout=60), 400,
                 "context_length_exceeded", "input")


@pytest.mark.parametrize("body,code,param", [
    ({"input": []}, "invalid_argument", "input"),
    ({"input": ""}, "invalid_argument", "input"),
    ({"input": ["fine", ""]}, "invalid_argument", "input"),
    ({"input": [[101, 102], []]}, "invalid_argument", "input"),
    ({}, "invalid_argument", "input"),
    ({"input": [1.5, 2]}, "invalid_argument", "input"),
    ({"input": "x", "dimensions": 0}, "invalid_argument", "dimensions"),
    ({"input": "x", "dimensions": 385}, "invalid_argument", "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "invalid_argument", "encoding_format"),
    ({"input": [[101, 10 ** 6, 102]]}, "token_out_of_range", "input"),
    ({"input": "x", "model": "nope"}, "model_not_found", "model"),
])
def test_bad_embedding_requests(embed_server, body: dict[str, Any], code: str, param: str) -> None:
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"model": "minilm", **body}, timeout=30)
    assert_error(r, 404 if code == "model_not_found" else 400, code, param)
    assert httpx.get(f"{embed_server.url}/health").json() == {"status": "ok"}


def test_wrong_model_kind_on_an_embedding_server(client, embed_server, st_model) -> None:
    url = embed_server.url
    before = metrics(url)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "wrong model kind" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="minilm", prompt="hi")
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        err = assert_error(httpx.post(f"{url}{route}", json={"model": "minilm", "query": "q", "documents": ["d"]}),
                           400, "unsupported_model", "model")
        assert "cross-encoder" in err["message"]
    assert_error(httpx.post(f"{url}/tokenize", json={"prompt": "hi"}), 400, "unsupported_model")
    # still serving, and the counters saw it all
    r = client.embeddings.create(model="minilm", input=TEXTS[:2], encoding_format="float")
    assert cosines(_vectors(r), st_model.encode(TEXTS[:2], convert_to_numpy=True)).min().item() >= 0.99999
    m = metrics(url)
    req = 'superslm_requests_total{endpoint="%s",outcome="%s"}'
    delta = {k: m[k] - before.get(k, 0) for k in m if k.startswith(("superslm_requests_total", "superslm_encoder_"))}
    assert delta[req % ("chat_completions", "invalid")] == delta[req % ("completions", "invalid")] == 1
    assert delta[req % ("rerank", "invalid")] == 3
    assert delta[req % ("embeddings", "success")] == 1
    assert delta['superslm_encoder_inputs_total{endpoint="embeddings"}'] == 2
    assert delta['superslm_encoder_tokens_total{endpoint="embeddings"}'] == r.usage.prompt_tokens
    assert m["superslm_engine_alive"] == 1


def test_waiting_requests_run_as_one_batch(embed_server, st_model, monkeypatch) -> None:
    """Requests that queue while the worker is busy run as one embed_tokens call, each answer its own."""
    enc = embed_server.state.model
    calls: list[int] = []
    gate = threading.Event()
    embed_tokens = enc.embed_tokens

    def held(ids, **kwargs):
        calls.append(len(ids))
        if len(calls) == 1:
            assert gate.wait(30)
        return embed_tokens(ids, **kwargs)

    monkeypatch.setattr(enc, "embed_tokens", held)
    url = f"{embed_server.url}/v1/embeddings"
    bodies = [{"input": TEXTS[:1]}, {"input": TEXTS[1:3]}, {"input": TEXTS[3:], "dimensions": 32},
              {"input": ["nope", ""]}]
    answers: dict[int, httpx.Response] = {}

    def post(i: int) -> None:
        answers[i] = httpx.post(url, json={"model": "minilm", "encoding_format": "float", **bodies[i]}, timeout=60)

    first = threading.Thread(target=post, args=(0,))
    first.start()
    wait_for(lambda: len(calls) == 1)
    rest = [threading.Thread(target=post, args=(i,)) for i in (1, 2, 3)]
    for t in rest:
        t.start()
    wait_for(lambda: len(embed_server.state.worker._jobs) == 2)  # the empty input never got queued
    gate.set()
    for t in (first, *rest):
        t.join(60)
    assert calls == [1, len(TEXTS) - 1]  # the two that waited, together
    assert_error(answers[3], 400, "invalid_argument", "input")
    want = st_model.encode(TEXTS, convert_to_numpy=True)
    for i in (0, 1):
        got = np.array([d["embedding"] for d in answers[i].json()["data"]])
        lo = 0 if i == 0 else 1
        assert cosines(got, want[lo:lo + len(got)]).min().item() >= 0.99999
    cut = torch.nn.functional.normalize(torch.as_tensor(want[3:, :32]), dim=1)
    assert cosines([d["embedding"] for d in answers[2].json()["data"]], cut).min().item() >= 0.99999


# --- rerank ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cross")
    build_bert_family(folder, "bert", head=True, labels=1)
    return folder


@pytest.fixture(scope="module")
def rerank_server(cross_folder: Path):
    from superslm.serve import create_app

    with LiveServer(create_app(CrossEncoder.load(cross_folder, device="cpu"), served_model_name="ce")) as s:
        yield s


def test_rerank_matches_sentence_transformers(rerank_server, cross_folder) -> None:
    from sentence_transformers import CrossEncoder as STCrossEncoder

    st = STCrossEncoder(str(cross_folder), device="cpu")
    want = np.asarray(st.predict([(QUERY, d) for d in DOCS]), dtype=np.float64).reshape(-1)
    n_tokens = sum(map(len, st.tokenizer([QUERY] * len(DOCS), DOCS, truncation="longest_first",
                                         max_length=st.max_seq_length)["input_ids"]))
    body = {"model": "ce", "query": QUERY, "documents": [d if i % 2 else {"text": d} for i, d in enumerate(DOCS)],
            "truncate": True}
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(f"{rerank_server.url}{route}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["model"] == "ce" and out["id"].startswith("rerank-")
        assert out["usage"] == {"total_tokens": n_tokens}
        got = out["results"]
        assert sorted(x["index"] for x in got) == list(range(len(DOCS)))
        assert all(abs(x["relevance_score"] - want[x["index"]]) <= 1e-5 for x in got)
        scores = [x["relevance_score"] for x in got]
        assert scores == sorted(scores, reverse=True)  # best first
        assert [x["index"] for x in got] == sorted(range(len(DOCS)), key=lambda i: -want[i])  # as the reference
        assert all(x["document"] == {"text": DOCS[x["index"]]} for x in got)
    order = [x["index"] for x in got]
    top = httpx.post(f"{rerank_server.url}/v1/rerank", timeout=60,
                     json={**body, "top_n": 2, "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == order[:2] and all(set(x) == {"index", "relevance_score"} for x in top)
    many = httpx.post(f"{rerank_server.url}/v1/rerank", json={**body, "top_n": 100}, timeout=60).json()
    assert len(many["results"]) == len(DOCS)


def test_rerank_ties_keep_input_order(rerank_server, monkeypatch) -> None:
    # equal scores exactly (identical documents may differ in the last bit, as in sentence-transformers)
    fixed = [0.5, 0.9, 0.5, 0.1, 0.9, 0.5]
    monkeypatch.setattr(rerank_server.state.model, "scores", lambda *a, **k: fixed)
    r = httpx.post(f"{rerank_server.url}/v1/rerank", json={"query": "q", "documents": list("abcdef"), "top_n": 4})
    assert [(x["index"], x["relevance_score"]) for x in r.json()["results"]] == [(1, 0.9), (4, 0.9), (0, 0.5), (2, 0.5)]


@pytest.mark.parametrize("body,code,param", [
    ({"query": QUERY, "documents": []}, "invalid_argument", "documents"),
    ({"documents": ["a"]}, "invalid_argument", "query"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, "invalid_argument", "top_n"),
    ({"query": QUERY, "documents": [{"txt": "a"}]}, "invalid_argument", "documents"),
    ({"query": QUERY, "documents": [3]}, "invalid_argument", "documents"),
    ({"query": QUERY, "documents": DOCS}, "context_length_exceeded", "documents"),  # DOCS[1] is past 40 tokens
])
def test_bad_rerank_requests(rerank_server, body: dict[str, Any], code: str, param: str) -> None:
    r = httpx.post(f"{rerank_server.url}/v1/rerank", json={"model": "ce", **body}, timeout=30)
    assert_error(r, 400, code, param)
    assert httpx.get(f"{rerank_server.url}/health").json() == {"status": "ok"}


def test_wrong_model_kind_on_a_rerank_server(rerank_server) -> None:
    c = openai.OpenAI(base_url=f"{rerank_server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="ce", input="hello")
    assert "wrong model kind" in e.value.message and e.value.code == "unsupported_model"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="ce", messages=[{"role": "user", "content": "hi"}])
    ok = httpx.post(f"{rerank_server.url}/v1/rerank", json={"model": "ce", "query": "q", "documents": ["a", "b"]})
    assert ok.status_code == 200 and len(ok.json()["results"]) == 2


# --- a language model's embeddings -------------------------------------------------------------------


def test_decoder_model_embeds_and_refuses_rerank() -> None:
    from superslm.serve import create_app

    folder, hf = tiny_folder("llama")
    model = superslm.load(folder)
    texts = ["The quick brown fox", "Pack my box", "a"]
    with LiveServer(create_app(model, slots=2, context=64, served_model_name="tiny")) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.embeddings.create(model="tiny", input=texts, encoding_format="float")
        ids = model.tokenizer.encode_batch(texts)
        assert r.usage.prompt_tokens == sum(map(len, ids))
        with torch.no_grad():  # transformers' final-norm hidden state of the last token, L2-normalized
            want = torch.stack([hf.model(torch.tensor([x])).last_hidden_state[0, -1] for x in ids])
        want = torch.nn.functional.normalize(want.float(), dim=1)
        assert cosines(_vectors(r), want).min().item() >= 0.99999
        by_ids = c.embeddings.create(model="tiny", input=ids, encoding_format="float")
        assert np.allclose(_vectors(by_ids), _vectors(r), atol=1e-6)
        assert_error(httpx.post(f"{s.url}/v1/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]}),
                     400, "unsupported_model", "model")
        assert_error(httpx.post(f"{s.url}/v1/embeddings", json={"model": "tiny", "input": "x " * 100}), 400,
                     "context_length_exceeded", "input")
        # generation still works beside it
        done = c.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3


# --- `superslm serve --model ENCODER_FOLDER` ----------------------------------------------------------


def test_serve_cli_with_an_encoder_folder(minilm_folder: Path, st_model) -> None:
    from tests.test_server_load import _free_port, _healthy

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "superslm.cli", "serve", "--model", str(minilm_folder), "--port", str(port),
           "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for(lambda: _healthy(url) or proc.poll() is not None, timeout=90, every=0.2)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        name = minilm_folder.name
        # its own name, and --model as typed
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [name, str(minilm_folder)]
        r = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS, "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = [d["embedding"] for d in r.json()["data"]]
        assert cosines(got, st_model.encode(TEXTS, convert_to_numpy=True)).min().item() >= 0.99999
        assert_error(httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "x"}), 400, "unsupported_model")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_full_and_draining_encoder_server(minilm_folder: Path, monkeypatch) -> None:
    """Past max_waiting requests in flight a request gets 503 queue_full; after drain() every one does."""
    from superslm.serve import create_app

    enc = Encoder.load(minilm_folder, device="cpu")
    gate = threading.Event()
    embed_tokens = enc.embed_tokens
    monkeypatch.setattr(enc, "embed_tokens", lambda ids, **kw: gate.wait(30) and embed_tokens(ids, **kw))
    with LiveServer(create_app(enc, served_model_name="minilm", max_waiting=1)) as s:
        url = f"{s.url}/v1/embeddings"
        answers: list[httpx.Response] = []
        held = threading.Thread(target=lambda: answers.append(httpx.post(url, json={"input": "a"}, timeout=60)))
        held.start()
        wait_for(lambda: s.state.worker._running == 1)
        assert_error(httpx.post(url, json={"input": "b"}), 503, "queue_full")
        s.state.drain()
        assert_error(httpx.get(f"{s.url}/health"), 503, "shutting_down")
        assert_error(httpx.post(url, json={"input": "c"}), 503, "queue_full")
        gate.set()
        held.join(60)
        assert answers[0].status_code == 200 and len(answers[0].json()["data"][0]["embedding"]) == 384
        m = metrics(s.url)
        assert m['superslm_requests_total{endpoint="embeddings",outcome="rejected"}'] == 2
