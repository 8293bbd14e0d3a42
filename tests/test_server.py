"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client.

A tiny random-weight llama serves most checks (its text is mostly byte pieces, so `ignore_eos`
fixes answer lengths); transformers' forward pass of the same weights is the logprobs reference.
"""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import openai
import pytest
import torch

import superslm
from tests.test_server_helpers import LiveServer, metrics, read_sse, tiny_folder

CONTEXT = 128
FIXED = {"ignore_eos": True}  # vLLM's extension: answers run to max_tokens


@pytest.fixture(scope="module")
def tiny() -> tuple[superslm.Model, object]:
    folder, hf = tiny_folder("llama")
    return superslm.load(folder), hf


@pytest.fixture(scope="module")
def server(tiny):
    from superslm.serve import create_app

    model, _ = tiny
    with LiveServer(create_app(model, slots=4, context=CONTEXT, served_model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_usage_and_n(client, tiny) -> None:
    model, _ = tiny
    prompt = "The quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=2, temperature=0,
                                  extra_body=FIXED)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy: both the same
    n_prompt = len(model.tokenizer.encode(prompt))
    assert r.usage.prompt_tokens == n_prompt  # once per prompt, as OpenAI counts
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == n_prompt + 12
    # the same text from the engine directly
    eng = model.engine(slots=1, context=CONTEXT)
    ref = eng.generate([superslm.Request(prompt, 6, superslm.Sampling(ignore_eos=True))])[0]
    assert r.choices[0].text == ref.text


def test_completion_prompt_forms(client, tiny) -> None:
    model, _ = tiny
    ids = model.tokenizer.encode("Pack my box")
    a = client.completions.create(model="tiny", prompt="Pack my box", max_tokens=5, temperature=0, extra_body=FIXED)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, extra_body=FIXED)
    assert a.choices[0].text == b.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["Pack my box", "def main"], max_tokens=5, n=2,
                                      temperature=0, extra_body=FIXED)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == a.choices[0].text
    n2 = len(model.tokenizer.encode("def main"))
    assert batch.usage.prompt_tokens == len(ids) + n2
    assert batch.usage.completion_tokens == 20


def test_stream_equals_non_stream_greedy(client, server) -> None:
    for n in (1, 2):
        whole = client.completions.create(model="tiny", prompt="Zwölf Boxkämpfer", max_tokens=12, n=n,
                                          temperature=0, extra_body=FIXED)
        parts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for chunk in client.completions.create(model="tiny", prompt="Zwölf Boxkämpfer", max_tokens=12, n=n,
                                               temperature=0, stream=True, extra_body=FIXED):
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + c.text
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert parts == {c.index: c.text for c in whole.choices}
        assert finish == {c.index: "length" for c in whole.choices}

    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           extra_body=FIXED)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=FIXED))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_sse_framing(server) -> None:
    body = {"model": "tiny", "prompt": "Pack my", "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = read_sse(r.text)
    assert frames[-2]["usage"]["completion_tokens"] == 5 and frames[-2]["choices"] == []
    assert frames[-3]["choices"][0]["finish_reason"] == "length"
    assert all(f["object"] == "text_completion" and f["id"] == frames[0]["id"] for f in frames[:-1])


def test_stop_strings(client) -> None:
    # pick a stop string out of the greedy answer: the answer with it ends just before it
    for prompt in ("The quick brown fox", "def main():", "Pack my box with", "jumps over the"):
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body=FIXED).choices[0].text
        clean = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
        if clean:
            break
    else:
        pytest.skip("no clean two-character piece in the tiny model's answers")
    stop = full[clean[0]:clean[0] + 2]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@@"],
                                  extra_body=FIXED)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True, extra_body=FIXED))
    assert streamed == r.choices[0].text
    # vLLM's include_stop_str_in_output: the text runs to the end of the stop string, streamed or not
    kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@@"],
              extra_body={**FIXED, "include_stop_str_in_output": True})
    with_stop = client.completions.create(**kw).choices[0]
    assert with_stop.text == full[: full.index(stop) + len(stop)] and with_stop.finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == with_stop.text


def test_stop_token_counts_in_usage(client, tiny) -> None:
    model, _ = tiny
    token = model.tokenizer.encode(" fox")[-1]
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=8, logit_bias={str(token): 100},
                                  extra_body={"stop_token_ids": [token]})
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1  # the stop token was sampled, though not returned
    # with include_stop_str_in_output a stop_token_ids token's text is the answer's end (as vLLM)
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=8, logit_bias={str(token): 100},
                                  extra_body={"stop_token_ids": [token], "include_stop_str_in_output": True})
    assert r.choices[0].text == model.tokenizer.decode([token]) != ""
    # min_tokens: the stop token waits until three tokens are out (vLLM's min_tokens)
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=8, logit_bias={str(token): 100},
                                  extra_body={"stop_token_ids": [token], "min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"


def test_truncate_prompt_tokens(client, tiny) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, after the chat template (-1: the context's)."""
    model, _ = tiny
    ids = model.tokenizer.encode("Pack my box with five dozen liquor jugs")
    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={**FIXED, "truncate_prompt_tokens": 3})
    r = client.completions.create(prompt=ids, **kw)
    same = client.completions.create(model="tiny", prompt=ids[-3:], max_tokens=4, temperature=0, extra_body=FIXED)
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == same.choices[0].text
    messages = [{"role": "user", "content": "Pack my box with five dozen liquor jugs"}]
    chat = client.chat.completions.create(messages=messages, **kw)
    tail = model.chat_tokens(messages)[-3:]
    want = client.completions.create(model="tiny", prompt=tail, max_tokens=4, temperature=0, extra_body=FIXED)
    assert chat.usage.prompt_tokens == 3 and chat.choices[0].message.content == want.choices[0].text
    whole = client.completions.create(prompt=ids, **{**kw, "extra_body": {**FIXED, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == len(ids)


def test_seed_reproducible(client) -> None:
    kw = dict(model="tiny", prompt="Once upon", max_tokens=10, temperature=1.0, extra_body=FIXED)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b
    pair = client.completions.create(seed=7, n=2, **kw).choices
    # choice i gets seed + i, so the two choices differ and each matches its single-choice run
    assert [pair[0].text, pair[1].text] == [a, c]
    assert a != c
    # a batch of prompts: each prompt's choice i gets seed + i too, as a single request of that prompt
    batch = client.completions.create(seed=7, n=2, **{**kw, "prompt": ["Once upon", "Once upon"]}).choices
    assert [c.text for c in batch] == [a, c, a, c]


def test_logprobs_against_transformers(client, tiny) -> None:
    model, hf = tiny
    messages = [{"role": "user", "content": "Pack my box"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body=FIXED)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    ids = model.chat_tokens(messages)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    top = ref.topk(3)
    first = content[0]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    want = [model.tokenizer.token_bytes(i) for i in top.indices.tolist()]
    assert [bytes(t.bytes) for t in first.top_logprobs] == want
    for item in content:  # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == item.top_logprobs[0].bytes
    c = client.completions.create(model="tiny", prompt="Pack my box", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body=FIXED).choices[0].logprobs
    assert len(c.tokens) == len(c.token_logprobs) == len(c.top_logprobs) == 5
    assert c.text_offset == sorted(c.text_offset) and c.text_offset[0] == 0
    assert all(len(t) <= 2 for t in c.top_logprobs)


def test_completion_logprobs_of_partial_utf8_tokens(client, tiny) -> None:
    # the tiny model's tokens are mostly single bytes: an emoji is 4 tokens, none UTF-8 alone
    model, _ = tiny
    r = client.completions.create(model="tiny", prompt="\U0001f600\U0001f603\u00e9", max_tokens=12,
                                  temperature=0, logprobs=20, extra_body=FIXED).choices[0]
    lp = r.logprobs
    partial = [t for t in lp.tokens if t.startswith("bytes:")]
    assert partial, lp.tokens  # else the test checks nothing
    for t in partial:
        assert re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", t), t
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert len(top) == 20 and token in top  # distinct keys; greedy: the chosen token is the top one
    assert lp.text_offset == sorted(lp.text_offset) and all(o <= len(r.text) for o in lp.text_offset)


def test_text_offset_of_a_character_split_over_tokens(tiny) -> None:
    from superslm.engine.request import Logprob, Progress
    from superslm.serve.output import Job

    model, _ = tiny
    tok = model.tokenizer
    ids = [i for ch in "\U0001f600\u00e9a" for i in tok.encode(ch, add_special_tokens=False)]
    assert [len(tok.token_bytes(i)) for i in ids] == [1, 1, 1, 1, 1, 1, 1]
    # the text as the engine streams it: a character once its last byte has come
    texts = ["", "", "", "\U0001f600", "", "\u00e9", "a"]
    job = Job(tok, "tiny", False, 1, [1], 0, False)
    streamed: list[int] = []
    for k, (i, text) in enumerate(zip(ids, texts)):
        p = Progress(0, tokens=[i], text=text, logprobs=[Logprob(i, -1.0)], end="length" if k == 6 else "")
        streamed += job.absorb(0, p)[0]["logprobs"]["text_offset"]
    # each byte of a character starts where the character does
    assert streamed == [0, 0, 0, 0, 1, 1, 2]
    body = job.response()["choices"][0]
    assert body["text"] == "\U0001f600\u00e9a" and body["logprobs"]["text_offset"] == streamed
    assert body["logprobs"]["tokens"][:2] == ["bytes:\\xf0", "bytes:\\x9f"] and body["logprobs"]["tokens"][6] == "a"


def test_continue_final_message(client, server, tiny) -> None:
    from transformers import AutoTokenizer

    model, _ = tiny
    messages = [{"role": "user", "content": "List colours."}, {"role": "assistant", "content": "Sure! The first is "}]
    # the reference: transformers' apply_chat_template ends the prompt inside the last message
    ref = AutoTokenizer.from_pretrained(tiny_folder("llama")[0]).apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False)
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"] == ref
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                       extra_body={**FIXED, **body})
    assert r.usage.prompt_tokens == len(ref)
    same = client.completions.create(model="tiny", prompt=ref, max_tokens=5, temperature=0, extra_body=FIXED)
    assert r.choices[0].message.content == same.choices[0].text


def test_tokenize_detokenize(server, tiny) -> None:
    model, _ = tiny
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Pack my box", "return_token_strs": True}).json()
    assert r["tokens"] == model.tokenizer.encode("Pack my box") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT
    assert r["token_strs"] == [model.tokenizer.id_to_token(i) for i in r["tokens"]]
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == model.chat_tokens(msgs)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Pack my box"}


def test_metrics_exact(tiny) -> None:
    """A fresh server, a known sequence of requests, and every counter checked against it."""
    from superslm.serve import create_app

    model, _ = tiny
    with LiveServer(create_app(model, slots=2, context=CONTEXT, served_model_name="tiny")) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        usages = []
        r1 = c.completions.create(model="tiny", prompt="The quick", max_tokens=5, n=2, extra_body=FIXED)
        usages.append(r1.usage)
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                                max_tokens=4, stream=True, stream_options={"include_usage": True},
                                                extra_body=FIXED))
        usages.append(chunks[-1].usage)
        token = model.tokenizer.encode("x")[-1]
        r3 = c.completions.create(model="tiny", prompt="abc", max_tokens=8, logit_bias={str(token): 100},
                                  extra_body={"stop_token_ids": [token]})
        usages.append(r3.usage)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="abc", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hey"}])

        m = metrics(s.url)
        prompts = [len(model.tokenizer.encode("The quick")),
                   len(model.chat_tokens([{"role": "user", "content": "hey"}])),
                   len(model.tokenizer.encode("abc"))]
        assert [u.prompt_tokens for u in usages] == prompts
        assert m["superslm_prompt_tokens_total"] == sum(prompts)
        assert [u.completion_tokens for u in usages] == [10, 4, 1]
        assert m["superslm_generation_tokens_total"] == 15
        req = 'superslm_requests_total{endpoint="%s",outcome="%s"}'
        assert m[req % ("completions", "success")] == 2
        assert m[req % ("completions", "invalid")] == 1
        assert m[req % ("chat_completions", "success")] == 1
        assert m[req % ("chat_completions", "invalid")] == 1  # the 404 for an unknown model
        assert sum(v for k, v in m.items() if k.startswith("superslm_requests_total")) == 5
        seq = 'superslm_sequences_finished_total{reason="%s"}'
        assert (m[seq % "length"], m[seq % "stop"], m[seq % "cancelled"]) == (3, 1, 0)
        # one first token per sequence, then one interval per further token
        assert m["superslm_time_to_first_token_seconds_count"] == 4
        assert m['superslm_time_to_first_token_seconds_bucket{le="+Inf"}'] == 4
        assert m["superslm_time_per_output_token_seconds_count"] == (5 - 1) * 2 + (4 - 1) + 0
        buckets = [v for k, v in m.items() if k.startswith("superslm_time_per_output_token_seconds_bucket")]
        assert buckets == sorted(buckets)
        assert m["superslm_requests_running"] == 0 and m["superslm_requests_waiting"] == 0
        assert m["superslm_kv_pages_used"] == 0
        stats = s.state.engine.pool.stats()
        assert m["superslm_kv_pages_total"] == stats.num_pages
        assert m["superslm_kv_pages_cached"] + m["superslm_kv_pages_free"] == stats.num_pages
        assert m["superslm_prefix_cache_hits_total"] == stats.prefix_hit_tokens
        assert m["superslm_prefix_cache_queries_total"] == stats.prefix_query_tokens
        assert m["superslm_preemptions_total"] == 0 and m["superslm_engine_alive"] == 1


def test_serve_imports_lazily() -> None:
    code = ("import sys, superslm.cli, superslm.serve; superslm.cli.build_parser(); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'pydantic', 'starlette') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_sse_frames_survive_line_splitting_clients() -> None:
    import json

    # a tiny model's text can hold U+0085 / U+2028 / U+2029: httpx's iter_lines (str.splitlines) splits on them
    from httpx._decoders import LineDecoder

    from superslm.serve.generate import sse

    obj = {"text": "a\u2028b\u2029c\x85d\u00e9\n\r\x1c"}
    frame = sse(obj)
    lines = LineDecoder().decode(frame) + LineDecoder().flush()
    assert [x for x in lines if x] == [frame.strip()]
    assert json.loads(frame[len("data: "):]) == obj
    assert "\u00e9" in frame  # other non-ASCII text stays as it is
