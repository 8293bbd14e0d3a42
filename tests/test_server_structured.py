"""Structured output and tool calls through the server, driven by the official openai client.

SmolLM2-135M-Instruct answers where real output matters (its ChatML template knows no tools, so
the server lists them in the system message; a copy with a Hermes-style template checks the
<tool_call> path). Outputs are checked with `jsonschema` and against the library's own answer for
the same constraint. A tiny random model serves the 400s and a schema shipped in a model folder.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import jsonschema
import openai
import pytest

import superslm
from superslm import Request, Sampling
from superslm.grammar import Constraint
from superslm.model import Model
from superslm.serve.structured import prompt_inputs, tool_setup
from superslm.serve.toolcalls import ToolStream
from tests.test_server_helpers import LiveServer, assert_error, metrics, tiny_folder

CONTEXT = 1024
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "temp": {"type": "integer", "minimum": -50,
                                                                          "maximum": 50},
                   "sky": {"enum": ["clear", "cloudy", "rain"]}},
    "required": ["city", "temp", "sky"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [[{"role": "user", "content": "What is the weather like in Paris?"}],
       [{"role": "user", "content": "What time is it in Tokyo right now?"}]]
JSON_ASK = [{"role": "user", "content": "Give the weather in Paris as JSON with keys city and temperature."}]
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(smollm2_gguf) -> superslm.Model:
    return superslm.load(smollm2_gguf)


@pytest.fixture(scope="module")
def server(model):
    from superslm.serve import create_app

    with LiveServer(create_app(model, slots=4, context=CONTEXT, served_model_name="smollm2")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, messages: list, **kw):
    return client.chat.completions.create(model=kw.pop("model", "smollm2"), messages=messages,
                                          temperature=0, **{"max_tokens": 64, **kw})


def stream_message(client: openai.OpenAI, messages: list, **kw) -> tuple[str, dict[int, dict], str | None]:
    """A chat stream rebuilt as a client does: (content, {index: {id, name, arguments}}, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def check_calls(calls, names: set[str]) -> None:
    """Every call names a tool in `names` and its arguments are valid for that tool's parameters."""
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


# --- structured output ---------------------------------------------------------------------------


def test_json_object_and_schema_validate(client, model) -> None:
    r = chat(client, JSON_ASK, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True}}
    r = chat(client, JSON_ASK, response_format=rf)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    # the fixed keys are forced (jump-forward), and usage says how many
    assert r.usage.completion_tokens_details.forced_tokens > 0
    # the library's answer under the same constraint is the same text
    ref = model.engine(slots=1, context=CONTEXT).generate(
        [Request(model.chat_tokens(JSON_ASK), 64, Sampling(grammar=Constraint.json_schema(WEATHER_SCHEMA)))])[0]
    assert text == ref.text
    streamed, calls, finish = stream_message(client, JSON_ASK, response_format=rf)
    assert (streamed, calls, finish) == (text, {}, "stop")


def test_guided_regex_choice_grammar(client) -> None:
    r = chat(client, [{"role": "user", "content": "Give me a phone number."}],
             extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    options = ["positive", "negative", "neutral"]
    r = chat(client, [{"role": "user", "content": "Sentiment of: I love this!"}], extra_body={"guided_choice": options})
    assert r.choices[0].message.content in options
    # a GBNF grammar (llama.cpp's syntax, as vLLM accepts it) on the completions endpoint
    c = client.completions.create(model="smollm2", prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= " yes" | " no"'})
    assert c.choices[0].text in (" yes", " no") and c.choices[0].finish_reason == "stop"


# --- tools ---------------------------------------------------------------------------------------


def test_tools_required_and_named_always_call(client) -> None:
    names = {t["function"]["name"] for t in TOOLS}
    for messages in ASK:
        r = chat(client, messages, tools=TOOLS, tool_choice="required")
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        check_calls(msg.tool_calls, names)
        assert r.usage.completion_tokens_details.forced_tokens > 0
        for name in names:
            r = chat(client, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}})
            assert r.choices[0].finish_reason == "tool_calls"
            calls = r.choices[0].message.tool_calls
            check_calls(calls, {name})
            assert len(calls) == 1


def test_tools_auto_and_none(client) -> None:
    r = chat(client, ASK[0], tools=TOOLS)  # tool_choice defaults to auto
    msg = r.choices[0].message
    if msg.tool_calls:
        check_calls(msg.tool_calls, set(PARAMS))
        assert r.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content and r.choices[0].finish_reason in ("stop", "length")
    # a streamed text answer is the same text (content held back only where a call could start)
    content, calls, finish = stream_message(client, ASK[0], tools=TOOLS)
    assert (content or None, bool(calls), finish) == (msg.content, bool(msg.tool_calls), r.choices[0].finish_reason)
    # "none": the tools are left out of the prompt, so the answer is the one without tools
    plain = chat(client, ASK[0]).choices[0].message.content
    r = chat(client, ASK[0], tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == plain and not r.choices[0].message.tool_calls
    # "auto" with an answer in a call's shape: parsed into tool_calls
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "arguments": PARAMS["get_weather"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    r = chat(client, ASK[0], tools=TOOLS, extra_body={"guided_json": call_schema})
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, {"get_weather"})


def test_streamed_deltas_rebuild_the_call(client) -> None:
    for kw in ({"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}):
        whole = chat(client, ASK[1], tools=TOOLS, **kw)
        content, calls, finish = stream_message(client, ASK[1], tools=TOOLS, **kw)
        want = whole.choices[0].message.tool_calls
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in want]
        assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())


def test_hermes_template_tool_calls(model) -> None:
    """A model whose template renders tools and teaches <tool_call> blocks: the tools reach the
    template, the forced call is written in that format, and it is parsed back."""
    from superslm.serve import create_app

    tok = type(model.tokenizer).__new__(type(model.tokenizer))
    tok.__dict__.update(model.tokenizer.__dict__)
    tok.chat_template = HERMES_TEMPLATE
    hermes = Model(model.source, model.net, tok, "smollm2-hermes")
    assert '"get_weather"' in hermes.chat_prompt(ASK[0], tools=TOOLS)
    with LiveServer(create_app(hermes, slots=2, context=CONTEXT, served_model_name="hermes")) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=300)
        r = chat(c, ASK[0], model="hermes", tools=TOOLS, tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}})
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, {"get_weather"})
        content, calls, finish = stream_message(c, ASK[0], model="hermes", tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1 and content == ""
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        # parallel calls allowed: this model repeats its call until max_tokens; the whole ones are parsed
        r = chat(c, ASK[0], model="hermes", tools=TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        check_calls(r.choices[0].message.tool_calls, set(PARAMS))


def test_tool_history_renders_for_a_template_without_tools(model) -> None:
    """Earlier calls and results reach a ChatML model as the JSON it is asked to write and a user turn."""
    from superslm.serve.protocol import ChatRequest

    req = ChatRequest(messages=[], tools=TOOLS)
    setup = tool_setup(req, model)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    messages, tools = prompt_inputs(history, setup, model.chat_template)
    assert tools is None and messages[0]["role"] == "system" and '"get_time"' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert messages[3]["role"] == "user" and "-3 C, snow" in messages[3]["content"]
    prompt = model.chat_prompt(messages)
    assert prompt.count("<|im_start|>") == 5  # system, user, assistant, tool result, generation prompt


def test_tool_stream_holds_back_calls() -> None:
    """Content streams up to where a call may start; the rest is decided by the final parse."""
    pieces = ["Let me ", "check. ", '{"name": "get_', 'time", "arguments": {"tz": "JST"}}', " Done."]
    ts = ToolStream(TOOLS)
    sent = "".join(ts.push(p) for p in pieces)
    assert sent == "Let me check."  # trailing space held, nothing from the brace on
    rest = ts.finish()
    assert [c["function"]["name"] for c in ts.calls] == ["get_time"]
    assert sent + rest == ts.content  # the streamed content is the final content
    text = ToolStream(TOOLS)
    out = "".join(text.push(p) for p in ["Hello", " there", " friend "]) + text.finish()
    assert out == text.content == "Hello there friend" and not text.calls


# --- the 400s ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The tiny random model, from a copy of its folder that ships a schema (schemas/flag.json)."""
    from superslm.serve import create_app

    folder = tmp_path_factory.mktemp("tiny") / "model"
    shutil.copytree(tiny_folder("llama")[0], folder)
    (folder / "schemas").mkdir()
    (folder / "schemas" / "flag.json").write_text(json.dumps(FLAG))
    with LiveServer(create_app(superslm.load(folder), slots=2, context=256, served_model_name="tiny")) as s:
        yield s


FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                      "uniqueItems": True}}}},
     "response_format", "invalid_grammar"),
    ({"response_format": {"type": "yaml"}}, "response_format", "invalid_argument"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_grammar"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid_grammar"),
    ({"guided_regex": "a(?=b)"}, "guided_regex", "invalid_grammar"),
    # built lazily, past the lexer's limits at the first token: a compile error, every time
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "invalid_grammar"),
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "invalid_grammar"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid_grammar"),
    ({"guided_choice": []}, "guided_choice", "invalid_argument"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "invalid_argument"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", None),
    ({"tools": [WEATHER, WEATHER]}, "tools", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "invalid_grammar"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", None),
    # OpenAI's 400s: a response_format without type, a json_schema one without a valid name, a bad tool name
    ({"response_format": {}}, "response_format", "invalid_argument"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": FLAG}}}, "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": FLAG}}},
     "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": FLAG}}},
     "response_format", None),
    ({"tools": [{"type": "function", "function": {"name": "a b c"}}]}, "tools", None),
    # vLLM's structured_outputs: one constraint, no option that would be ignored
    ({"structured_outputs": {}}, "structured_outputs", "invalid_argument"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_argument"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs", None),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", None),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", None),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid_grammar"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "invalid_argument"),
]


@pytest.mark.parametrize("extra,param,code", INVALID, ids=[f"{i}-{c[1]}" for i, c in enumerate(INVALID)])
def test_invalid_constraints_are_400(tiny_server, extra, param, code) -> None:
    steps = tiny_server.state.loop.stats().steps
    start = time.monotonic()
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    err = assert_error(r, 400, code, param)
    assert err["type"] == "invalid_request_error"
    assert time.monotonic() - start < 15  # the compile bound is 10 s
    assert tiny_server.state.loop.stats().steps == steps and tiny_server.state.loop.admitted == 0  # never queued


def test_server_keeps_serving_and_named_schema(tiny_server) -> None:
    c = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=CHAT["messages"], extra_body={"guided_regex": "(ab"})
    assert e.value.status_code == 400 and e.value.body["code"] == "invalid_grammar"
    # a json_schema response_format naming a schema shipped with the model, without giving it
    rf = {"type": "json_schema", "json_schema": {"name": "flag"}}
    r = c.chat.completions.create(model="tiny", messages=CHAT["messages"], response_format=rf, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), FLAG)
    m = metrics(tiny_server.url)
    assert m["superslm_forced_tokens_total"] == r.usage.completion_tokens_details.forced_tokens > 0
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("spelled,as_before", [
    ({"choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
    ({"regex": "[a-c]{3}"}, {"guided_regex": "[a-c]{3}"}),
    ({"grammar": 'start: "up" | "down"'}, {"guided_grammar": 'start: "up" | "down"'}),
    ({"json": FLAG, "disable_any_whitespace": False}, {"guided_json": FLAG}),
    ({"json_object": True}, {"response_format": {"type": "json_object"}}),
])
def test_structured_outputs_is_guided(tiny_server, spelled, as_before) -> None:
    # vLLM's structured_outputs is the newer spelling of guided_*: the same constraint, the same answer
    url = f"{tiny_server.url}/v1/chat/completions"
    body = {**CHAT, "max_tokens": 24, "temperature": 0}
    new = httpx.post(url, json={**body, "structured_outputs": spelled}, timeout=60)
    old = httpx.post(url, json={**body, **as_before}, timeout=60)
    assert new.status_code == old.status_code == 200, new.text
    assert new.json()["choices"][0]["message"] == old.json()["choices"][0]["message"]
    if "choice" in spelled:
        assert new.json()["choices"][0]["message"]["content"] in spelled["choice"]


def test_a_grammar_that_dies_finishes_with_error(client, monkeypatch) -> None:
    """A grammar that dies mid-answer (an llguidance error, such as its lexer limit: here the third token is
    refused) cut the text short and the server said "stop", so a client took truncated JSON for a whole
    answer. It says "error" now; the next identical request, grammar intact, finishes with "stop"."""
    from superslm.grammar import GrammarState

    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}
    real = GrammarState.accept

    def dies(self, token):
        return real(self, token) if len(self.tokens) < 2 else False

    monkeypatch.setattr(GrammarState, "accept", dies)
    r = chat(client, JSON_ASK, response_format=fmt)
    assert r.choices[0].finish_reason == "error"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)
    monkeypatch.setattr(GrammarState, "accept", real)
    ok = chat(client, JSON_ASK, response_format=fmt)
    assert ok.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(ok.choices[0].message.content), WEATHER_SCHEMA)


@pytest.mark.parametrize("options", [{"lenient": True}, {"item_separator": "x"}, {"key_separator": "="},
                                     {"whitespace_pattern": "[a-z]*"}, {"whitespace_pattern": r"\s*"},
                                     {"whitespace_flexible": "yes"}, "compact"])
def test_a_schemas_x_guidance_cannot_loosen_it(server, options) -> None:
    """llguidance's other options would break the output's JSON (separators) or drop keywords it does not
    know (lenient): a schema may set its whitespace only, with a pattern of JSON whitespace."""
    schema = {**WEATHER_SCHEMA, "x-guidance": options}
    body = {"model": "smollm2", "messages": JSON_ASK, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert_error(r, 400, "invalid_grammar")
    fine = {**WEATHER_SCHEMA, "x-guidance": {"whitespace_pattern": r"[\x20\n]{0,2}"}}
    body["response_format"]["json_schema"]["schema"] = fine
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
