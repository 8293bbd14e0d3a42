"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), live on 127.0.0.1, driven by the
official anthropic client; the same request through the openai client's chat completions is the reference
(a Messages body is translated into the chat request it means, so the answers must match token for token).

A tiny random-weight llama serves every check: seeded sampling (the extension `seed`, with `ignore_eos`) fixes
its answers, which greedy decoding would make one repeated token; a tool call is forced by its grammar, and
`jsonschema` judges tool inputs and structured output.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.test_server_helpers import LiveServer, metrics, tiny_folder

CONTEXT = 2048
GREEDY = {"temperature": 1.0, "seed": 7, "ignore_eos": True}  # not greedy: fixed by its seed (see above)
TOOL_TOKENS = 400  # a random model writes JSON's whitespace as long as the grammar lets it (32 a gap)
GRAMMAR_ENDS = {"ignore_eos": False}  # a constrained answer ends where its grammar does
OAI = {"temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                   "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server():
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    with LiveServer(create_app(model, slots=4, context=CONTEXT, served_model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client: anthropic.Anthropic, messages: list, **kw):
    return client.messages.create(model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                  extra_body={**GREEDY, **kw.pop("extra_body", {})}, **kw)


def blocks(message) -> list[tuple]:
    """A message's content as plain tuples (the stream helper builds its own block classes)."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]


def test_text_answer_matches_chat_completions(client, oai) -> None:
    r = ask(client, ASK, system="You are terse.")
    ref = oai.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "You are terse."}, *ASK],
                                      max_tokens=8, **OAI)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    text = ref.choices[0].message.content
    assert [b.type for b in r.content] == (["text"] if text else [])
    assert "".join(b.text for b in r.content) == text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)


def test_system_as_blocks_is_the_same_prompt(client) -> None:
    as_text = ask(client, ASK, system="You are terse.\n\nAnswer briefly.")
    cached = {"type": "ephemeral"}  # accepted, changes nothing
    as_blocks = ask(client, ASK, system=[{"type": "text", "text": "You are terse."},
                                         {"type": "text", "text": "Answer briefly.", "cache_control": cached}])
    assert blocks(as_blocks) == blocks(as_text) and as_blocks.usage == as_text.usage


def test_stream_rebuilds_the_same_message(client) -> None:
    whole = ask(client, ASK, max_tokens=12)
    with client.messages.stream(model="tiny", messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds


def test_stream_event_order_on_the_wire(server) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 6, "stream": True, **GREEDY}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    names = []
    for frame in frames:
        head, data = frame.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        names.append(head[len("event: "):])
        assert json.loads(data[len("data: "):])["type"] == names[-1]
    # a text answer: one block, opened, pinged, its deltas, closed
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence_cuts_the_answer(client) -> None:
    free = "".join(b.text for b in ask(client, ASK, max_tokens=16).content)
    assert len(free) >= 4, free
    stop = free[2:4]
    cut = ask(client, ASK, max_tokens=16, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    text = "".join(b.text for b in cut.content)
    assert free.startswith(text) and stop not in text


def test_prefill_continues_the_last_assistant_message(client, oai) -> None:
    messages = [*ASK, {"role": "assistant", "content": "The weather"}]
    r = ask(client, messages)
    ref = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=7,
                                      extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                  "ignore_eos": True})
    assert "".join(b.text for b in r.content) == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens


def test_count_tokens_equals_the_prompt(client) -> None:
    r = ask(client, ASK, system="You are terse.")
    counted = client.messages.count_tokens(model="tiny", messages=ASK, system="You are terse.")
    assert counted.input_tokens == r.usage.input_tokens


def test_forced_tool_use_is_valid_and_streams_the_same(client) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    r = ask(client, ASK, tools=[WEATHER], tool_choice=choice, max_tokens=TOOL_TOKENS, extra_body=GRAMMAR_ENDS)
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    with client.messages.stream(model="tiny", messages=ASK, max_tokens=TOOL_TOKENS, tools=[WEATHER], tool_choice=choice,
                                extra_body={**GREEDY, **GRAMMAR_ENDS}) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(r)
    assert final.stop_reason == "tool_use"
    any_tool = ask(client, ASK, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=TOOL_TOKENS,
                   extra_body=GRAMMAR_ENDS)
    assert any_tool.stop_reason == "tool_use"


def test_tool_result_round_trip_is_the_chat_prompt(client, oai) -> None:
    call_input = {"city": "Paris", "unit": "celsius"}
    messages = [*ASK,
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": call_input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "18 degrees, clear"}]},
                                             {"type": "text", "text": "Thanks."}]}]
    r = ask(client, messages, tools=[WEATHER])
    chat = [*ASK,
            {"role": "assistant", "content": "Let me look.",
             "tool_calls": [{"id": "toolu_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18 degrees, clear"},
            {"role": "user", "content": "Thanks."}]
    ref = oai.chat.completions.create(model="tiny", messages=chat, tools=[OPENAI_WEATHER], max_tokens=8, **OAI)
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert "".join(b.text for b in r.content if b.type == "text") == (ref.choices[0].message.content or "")
    assert client.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER]).input_tokens == \
        ref.usage.prompt_tokens


def test_structured_output_follows_the_schema(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["city", "temp"], "additionalProperties": False}
    r = ask(client, ASK, max_tokens=TOOL_TOKENS, output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body=GRAMMAR_ENDS)
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


@pytest.mark.parametrize(("body", "status", "kind", "word"), [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": [], "max_tokens": 4}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4}, 400, "invalid_request_error", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, 400,
     "invalid_request_error", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}], "max_tokens": 4},
     400, "invalid_request_error", "tool_use_id"),
    ({"messages": ASK, "max_tokens": 4, "stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
    ({"messages": ASK, "max_tokens": 4, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "input_schema"),
    ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "thinking"),
    ({"messages": ASK, "max_tokens": 4, "output_config": {"format": {"type": "json_schema",
                                                                     "schema": {"type": "nope"}}}},
     400, "invalid_request_error", None),
    ({"messages": ASK, "max_tokens": 4, "model": "other"}, 404, "not_found_error", "other"),
    ({"messages": ASK, "max_tokens": 100000}, 400, "invalid_request_error", "max_tokens"),
])
def test_bad_requests_get_anthropic_errors(server, body, status, kind, word) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    assert err["error"]["type"] == kind, err
    if word is not None:
        assert word in err["error"]["message"], err


def test_client_raises_its_own_error_classes(client, server) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", messages=ASK, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", messages=[{"role": "user", "content": ""}], max_tokens=4)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_api_key_as_x_api_key() -> None:
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    with LiveServer(create_app(superslm.load(folder), slots=1, context=64, served_model_name="tiny",
                               api_key="sekrit")) as s:
        good = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0, timeout=60)
        assert good.messages.create(model="tiny", messages=ASK, max_tokens=2).type == "message"
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="tiny", messages=ASK, max_tokens=2)
        assert e.value.body["error"]["type"] == "authentication_error"
        # the OpenAI routes take the same key as x-api-key too
        r = httpx.get(f"{s.url}/v1/models", headers={"x-api-key": "sekrit"})
        assert r.status_code == 200


def test_messages_are_counted_in_metrics(client, server) -> None:
    key = 'superslm_requests_total{endpoint="messages",outcome="success"}'
    before = metrics(server.url).get(key, 0)
    ask(client, ASK, max_tokens=2)
    with client.messages.stream(model="tiny", messages=ASK, max_tokens=2, extra_body=GREEDY) as stream:
        stream.get_final_message()
    assert metrics(server.url)[key] == before + 2
