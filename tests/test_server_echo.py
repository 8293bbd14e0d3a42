"""Completions' echo and vLLM's prompt_logprobs through the server, against the library's own prompt logprobs
(which tests/test_prompt_logprobs.py holds against transformers)."""

from __future__ import annotations

import httpx

from superslm import Request, Sampling
from tests.test_server import CONTEXT, FIXED, client, server, tiny  # noqa: F401  (the module's fixtures)
from tests.test_server_helpers import LiveServer, read_sse


def _lib(model, ids: list[int], k: int) -> list:
    engine = model.engine(slots=1, context=CONTEXT)
    return engine.generate([Request(ids, 1, Sampling(prompt_logprobs=k))])[0].prompt_logprobs


def test_echo_with_logprobs(server, tiny) -> None:  # noqa: F811
    """lm-eval's loglikelihood request: echo, logprobs, one token. The text starts with the prompt; the
    logprobs list the prompt's tokens first (the first with no logprob), then the answer's."""
    model, _ = tiny
    prompt = "Pack my box with five dozen"
    ids = model.tokenizer.encode(prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
            **FIXED}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    choice = r["choices"][0]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": False, "logprobs": None},
                       timeout=30).json()["choices"][0]["text"]
    assert choice["text"] == prompt + plain
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _lib(model, ids, 2)
    for q in range(1, len(ids)):
        assert abs(lp["token_logprobs"][q] - want[q].logprob) <= 1e-5
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(choice["text"])
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 3
    # streamed: the same text, the prompt's first
    events = read_sse(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30).text)
    assert "".join(e["choices"][0]["text"] for e in events if e and e["choices"]) == choice["text"]
    # token ids as the prompt: their text is decoded
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ids}, timeout=30).json()
    assert r["choices"][0]["text"].startswith(model.tokenizer.decode(ids))


def test_prompt_logprobs_field(server, tiny) -> None:  # noqa: F811
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}
    with the prompt's token and the top N; in each completion choice, beside a chat's choices."""
    model, _ = tiny
    ids = model.tokenizer.encode("The quick brown fox")
    want = _lib(model, ids, 2)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, **FIXED}
    got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for q in range(1, len(ids)):
        entry = got[q][str(ids[q])]
        assert abs(entry["logprob"] - want[q].logprob) <= 1e-5 and entry["rank"] == want[q].rank
        assert {str(t) for t, _ in want[q].top} <= set(got[q])
    events = read_sse(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30).text)
    streamed = [c["prompt_logprobs"] for e in events if e for c in e["choices"] if "prompt_logprobs" in c]
    # the same entries; BLAS rounds a GEMM's last rows by its thread split, so default mode's logprobs may move
    # in the last bits between two runs of one request
    assert len(streamed) == 1 and len(streamed[0]) == len(got) and streamed[0][0] is None
    for s, g in zip(streamed[0][1:], got[1:], strict=True):
        assert s.keys() == g.keys()
        for t in g:
            assert (s[t]["rank"], s[t]["decoded_token"]) == (g[t]["rank"], g[t]["decoded_token"])
            assert abs(s[t]["logprob"] - g[t]["logprob"]) <= 1e-5
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                                 "max_tokens": 2, "prompt_logprobs": 0},
                      timeout=30).json()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == len(model.chat_tokens(messages)) and chat["prompt_logprobs"][0] is None
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": 21}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_chat_echo_and_token_masks(server, tiny) -> None:  # noqa: F811
    """vLLM's chat echo (the answer continues the last message's role: its content first), allowed_token_ids and
    bad_words through the server."""
    model, _ = tiny
    messages = [{"role": "user", "content": "List colours."}, {"role": "assistant", "content": "Sure: red, "}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **FIXED,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()
    echoed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "echo": True}, timeout=30).json()
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Sure: red, " + text
    ask = {"model": "tiny", "messages": messages[:1], "max_tokens": 4, "temperature": 0, "echo": True, **FIXED}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=ask, timeout=30).json()
    assert not r["choices"][0]["message"]["content"].startswith("List colours.")  # a new assistant turn
    token = model.tokenizer.encode(" fox", add_special_tokens=False)[-1]
    comp = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0, **FIXED}
    r = httpx.post(f"{server.url}/v1/completions", json={**comp, "allowed_token_ids": [token]}, timeout=30).json()
    assert r["choices"][0]["text"] == model.tokenizer.decode([token] * 3)
    for prompt in ("hi", "def main():", "Pack my box", "The quick brown"):  # a first word that is not blank
        comp["prompt"] = prompt
        free = httpx.post(f"{server.url}/v1/completions", json=comp, timeout=30).json()["choices"][0]["text"]
        if free[:1].strip():
            break
    r = httpx.post(f"{server.url}/v1/completions", json={**comp, "bad_words": [free[:1]]}, timeout=30).json()
    assert r["choices"][0]["text"] != free and not r["choices"][0]["text"].startswith(free[:1])
    bad = httpx.post(f"{server.url}/v1/completions", json={**comp, "allowed_token_ids": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_chat_echo_is_not_a_tool_call(server, tiny) -> None:  # noqa: F811
    """The echoed message is the client's: with tools offered, a call written in it is not parsed as the model's."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": call}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "echo": True, "tools": tools,
            "add_generation_prompt": False, "continue_final_message": True, **FIXED}
    from superslm.serve import create_app

    model, _ = tiny
    with LiveServer(create_app(model, slots=1, context=512, served_model_name="tiny")) as wide:  # tools' prompt
        r = httpx.post(f"{wide.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
    assert r["message"]["content"].startswith(call) and not r["message"].get("tool_calls")
    from superslm.serve.protocol import ChatRequest, to_sampling

    chat = ChatRequest.model_validate({"model": "tiny", "messages": messages, "echo": True, "logprobs": True})
    assert to_sampling(chat, 5, 0).prompt_logprobs is None  # chat echo returns no prompt tokens: none computed
