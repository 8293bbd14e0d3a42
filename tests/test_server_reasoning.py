"""A reasoning template's thinking split from the answer (serve/reasoning.py) on the three chat APIs: chat
completions' `reasoning_content`, Anthropic's thinking blocks, the Responses API's reasoning items, streamed
and whole; `enable_thinking`, `reasoning_effort` and Anthropic's `thinking` switch it per request.

A tiny random llama with a Qwen3.5-style template (its generation prompt opens `<think>`, or closes an empty
block when thinking is off) writes what a regex forces: some thinking, `</think>`, an answer.
"""

from __future__ import annotations

import random
import re

import anthropic
import httpx
import openai
import pytest

from superslm.serve.reasoning import ReasoningSplit, has_reasoning, opens_thinking
from tests.test_server_helpers import LiveServer, tiny_folder

TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
THOUGHT_THEN_ANSWER = "[a-z]{3,8} [a-z]{3,8}</think>\n\n[a-z]{2,6}"
ANSWER_ONLY = "[a-z]{2,6}"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


def reference(text: str, opened: bool) -> tuple[str, str]:
    """(thinking, content) of a whole answer, by a regex: the thinking runs to the first closing tag."""
    if not opened:
        m = re.match(r"\s*<think>", text)
        if m is None:
            return "", text
        text = text[m.end():]
    head, sep, tail = text.partition("</think>")
    return (head, tail.lstrip()) if sep else (text, "")


CASES = ["plain answer", "  <think>a plan</think>\n\nthe answer", "<think>unfinished thought", "<thi",
         "<think></think>", "a < b and </think> is text here", "x</think>y</think>z", "\n\n<think>\n\nq</thi",
         "<think>a</think>   ", "", "<<think>>"]


@pytest.mark.parametrize("opened", [False, True])
def test_split_equals_the_reference_in_any_pieces(opened: bool) -> None:
    rng = random.Random(0)
    for text in CASES:
        want = reference(text, opened)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            split = ReasoningSplit(thinking=opened)
            got = [split.push(p) for p in pieces] + [split.finish()]
            assert ("".join(t for t, _ in got), "".join(c for _, c in got)) == want, (text, pieces)


def test_template_detection() -> None:
    assert has_reasoning(TEMPLATE) and not has_reasoning("{{ messages }}") and not has_reasoning(None)
    assert opens_thinking("<s>assistant\n<think>\n") and not opens_thinking("<think>\n\n</think>\n\n")
    assert not opens_thinking("<s>assistant\n")


@pytest.fixture(scope="module")
def server():
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    model.use_chat_template(TEMPLATE)
    with LiveServer(create_app(model, slots=2, context=1024, served_model_name="thinker")) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(oai: openai.OpenAI, regex: str, **kw):
    return oai.chat.completions.create(model="thinker", messages=ASK, max_tokens=60, temperature=1.0, seed=3,
                                       extra_body={"guided_regex": regex, **kw.pop("extra_body", {})}, **kw)


def test_chat_reasoning_content_whole_and_streamed(server, oai) -> None:
    r = chat(oai, THOUGHT_THEN_ANSWER)
    m = r.choices[0].message
    # the same request as a completion of the rendered prompt's ids: the raw text, split by the reference
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}).json()["tokens"]
    raw = oai.completions.create(model="thinker", prompt=ids, max_tokens=60, temperature=1.0, seed=3,
                                 extra_body={"guided_regex": THOUGHT_THEN_ANSWER}).choices[0].text
    assert "</think>" in raw and reference(raw, opened=True) == (m.reasoning_content, m.content)
    assert re.fullmatch(r"[a-z]{3,8} [a-z]{3,8}", m.reasoning_content), m
    assert re.fullmatch(r"[a-z]{2,6}", m.content), m
    assert r.choices[0].finish_reason == "stop"
    thought, content = "", ""
    for chunk in chat(oai, THOUGHT_THEN_ANSWER, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (thought, content) == (m.reasoning_content, m.content)


def test_thinking_switched_off_per_request(oai) -> None:
    on = chat(oai, THOUGHT_THEN_ANSWER)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {}):
        kw = {"reasoning_effort": "none"} if not extra else {}
        off = chat(oai, ANSWER_ONLY, extra_body=extra, **kw)
        m = off.choices[0].message
        assert m.reasoning_content is None and re.fullmatch(ANSWER_ONLY, m.content), m
        # the template closed an empty block in the prompt: "\n\n</think>\n\n" is more prompt
        assert off.usage.prompt_tokens > on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        chat(oai, ANSWER_ONLY, reasoning_effort="extreme")


def test_anthropic_thinking_blocks(server, oai) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    ref = chat(oai, THOUGHT_THEN_ANSWER).choices[0].message
    kw = {"model": "thinker", "messages": ASK, "max_tokens": 60,
          "extra_body": {"temperature": 1.0, "seed": 3, "guided_regex": THOUGHT_THEN_ANSWER}}
    r = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == \
        [("thinking", ref.reasoning_content), ("text", ref.content)]
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", ref.reasoning_content), ("text", ref.content)]
    assert "thinking" in kinds and "signature" in kinds  # the SDK's own events for thinking deltas
    off = client.messages.create(thinking={"type": "disabled"}, **{**kw, "extra_body": {
        "temperature": 1.0, "seed": 3, "guided_regex": ANSWER_ONLY}})
    assert [b.type for b in off.content] == ["text"]
    # earlier thinking blocks in the history are accepted and left out of the prompt
    history = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                       {"type": "text", "text": "blue light scatters"}]},
               {"role": "user", "content": "More?"}]
    plain = [*ASK, {"role": "assistant", "content": "blue light scatters"}, {"role": "user", "content": "More?"}]
    assert client.messages.count_tokens(model="thinker", messages=history).input_tokens == \
        client.messages.count_tokens(model="thinker", messages=plain).input_tokens


def test_responses_reasoning_items(oai) -> None:
    ref = chat(oai, THOUGHT_THEN_ANSWER).choices[0].message
    kw = {"model": "thinker", "input": ASK[0]["content"], "max_output_tokens": 60, "temperature": 1.0,
          "extra_body": {"seed": 3, "guided_regex": THOUGHT_THEN_ANSWER}}
    r = oai.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == ref.reasoning_content and r.output_text == ref.content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (ref.reasoning_content, ref.content)
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    off = oai.responses.create(reasoning={"effort": "none"}, **{**kw, "extra_body": {
        "seed": 3, "guided_regex": ANSWER_ONLY}})
    assert [i.type for i in off.output] == ["message"]


def test_a_grammar_starts_after_the_thinking(server, monkeypatch) -> None:
    """A schema (or tools) constrains the answer after the thinking block the prompt opened; with thinking
    off (an empty block closed in the prompt) it constrains the answer from its first token; a grammar that
    names the closing tag shapes the thinking too."""
    import asyncio

    from superslm.grammar import GrammarCompiler
    from superslm.serve.generate import plan_chat
    from superslm.serve.protocol import ChatRequest

    state = server.app.state.server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    def plan(**kw):
        return asyncio.run(plan_chat(state, ChatRequest(model="thinker", messages=ASK, **kw)))

    def constraint(**kw):
        return plan(**kw).constraint

    compiler = GrammarCompiler(state.model.tokenizer)

    def accepts(c, text: str) -> bool:
        m = compiler.compile(c).new_matcher()
        ok = m.consume_tokens(state.model.tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and not m.is_error() and m.is_accepting()

    after = constraint(response_format=form)
    assert after.thinking == "open"
    assert accepts(after, 'so, a number </think>\n\n{"a": 5}') and not accepts(after, '{"a": 5}')
    off = constraint(response_format=form, chat_template_kwargs={"enable_thinking": False})
    assert off.thinking == "" and accepts(off, '{"a": 5}')
    assert constraint(guided_regex=THOUGHT_THEN_ANSWER).thinking == ""
    assert plan(response_format=form).after is None
    # where the closing tag is one token (Qwen3's, DeepSeek-R1's), the constraint starts after that token instead
    tok = state.model.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: [7] if text == "</think>" else encode(text, **kw))
    one = plan(response_format=form)
    assert one.after == 7 and one.constraint.thinking == ""
