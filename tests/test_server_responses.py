"""OpenAI's Responses API (/v1/responses), live on 127.0.0.1, driven by the official openai client; the same
request through chat completions is the reference (a Responses body is translated into the chat request it
means, so the answers must match token for token).

A tiny random-weight llama serves every check: seeded sampling (the extension `seed`, with `ignore_eos`) fixes
its answers, a tool call is forced by its grammar, and `jsonschema` judges call arguments and structured output.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.test_server_helpers import LiveServer, metrics, tiny_folder

CONTEXT = 2048
SEEDED = {"seed": 7, "ignore_eos": True}
GRAMMAR_ENDS = {"ignore_eos": False}  # a constrained answer ends where its grammar does
TOOL_TOKENS = 400  # a random model writes JSON's whitespace as long as the grammar lets it (32 a gap)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_SCHEMA}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": WEATHER_SCHEMA}}
ASK = "What is the weather like in Paris?"


@pytest.fixture(scope="module")
def server():
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    with LiveServer(create_app(superslm.load(folder), slots=4, context=CONTEXT, served_model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def respond(client: openai.OpenAI, input, **kw):
    return client.responses.create(model="tiny", input=input, max_output_tokens=kw.pop("max_output_tokens", 8),
                                   temperature=1.0, extra_body={**SEEDED, **kw.pop("extra_body", {})}, **kw)


def chat(client: openai.OpenAI, messages: list, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                          temperature=1.0, seed=7, extra_body={"ignore_eos": True}, **kw)


def test_text_answer_matches_chat_completions(client) -> None:
    r = respond(client, ASK, instructions="You are terse.")
    ref = chat(client, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": ASK}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == ref.choices[0].message.content and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [p.type for p in item.content] == ["output_text"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You are terse."


def test_input_items_are_the_chat_messages(client) -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                             {"type": "input_text", "text": "there."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": ASK}]
    r = respond(client, items)
    ref = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": ASK}])
    assert r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens


def test_stream_events_rebuild_the_same_response(client) -> None:
    whole = respond(client, ASK, max_output_tokens=12)
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=12, temperature=1.0,
                                          stream=True, extra_body=SEEDED))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # the SDK's stream helper reads the same events (its final response needs response.completed: an answer
    # cut at max_output_tokens ends with response.incomplete, as OpenAI's does)
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=12, temperature=1.0,
                                 extra_body=SEEDED) as stream:
        helped = list(stream)
    assert [e for e in helped if e.type == "response.output_text.delta"][-1].snapshot == whole.output_text
    assert helped[-1].type == "response.incomplete"
    with client.responses.stream(model="tiny", input=ASK, max_output_tokens=TOOL_TOKENS, temperature=1.0,
                                 tools=[WEATHER], tool_choice="required",
                                 extra_body={**SEEDED, **GRAMMAR_ENDS}) as stream:
        completed = stream.get_final_response()
    assert completed.status == "completed" and completed.output[-1].type == "function_call"


def test_forced_function_call_streams_the_same(client) -> None:
    choice = {"type": "function", "name": "get_weather"}
    r = respond(client, ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=TOOL_TOKENS,
                extra_body=GRAMMAR_ENDS)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    assert r.status == "completed"
    events = list(client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice=choice,
                                          max_output_tokens=TOOL_TOKENS, temperature=1.0, stream=True,
                                          extra_body={**SEEDED, **GRAMMAR_ENDS}))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == calls[0].arguments
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == \
        [(calls[0].name, calls[0].arguments)]
    required = respond(client, ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=TOOL_TOKENS,
                       extra_body=GRAMMAR_ENDS)
    assert [i.type for i in required.output if i.type == "function_call"] == ["function_call"]


def test_function_call_output_round_trip_is_the_chat_prompt(client) -> None:
    args = json.dumps({"city": "Paris", "unit": "celsius"})
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, clear"}]
    r = respond(client, items, tools=[WEATHER])
    ref = chat(client, [{"role": "user", "content": ASK},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                              "arguments": args}}]},
                        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                         "content": "18 degrees, clear"}], tools=[CHAT_WEATHER])
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.output_text == (ref.choices[0].message.content or "")


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = respond(client, "Hello there.", instructions="Be brief.")
    second = respond(client, ASK, previous_response_id=first.id, instructions="Be brief.")
    ref = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."},
                        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": ASK}])
    assert second.output_text == ref.choices[0].message.content
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # a stored response is read back whole, and deleted
    back = client.responses.retrieve(first.id)
    assert back.id == first.id and back.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, ASK, previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    unstored = respond(client, ASK, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_structured_output_through_text_format(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["city", "temp"], "additionalProperties": False}
    r = respond(client, ASK, max_output_tokens=TOOL_TOKENS, extra_body=GRAMMAR_ENDS,
                text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
     "text"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": 5}, 400, None),
])
def test_bad_requests_are_clear_errors(server, body, status, param) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_responses_are_counted_in_metrics(client, server) -> None:
    key = 'superslm_requests_total{endpoint="responses",outcome="success"}'
    before = metrics(server.url).get(key, 0)
    respond(client, ASK, max_output_tokens=2)
    list(client.responses.create(model="tiny", input=ASK, max_output_tokens=2, stream=True, extra_body=SEEDED))
    assert metrics(server.url)[key] == before + 2
