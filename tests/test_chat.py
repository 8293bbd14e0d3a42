"""ChatTemplate: renders as transformers' apply_chat_template does, inside a sandbox that holds."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from superslm.errors import InvalidArgument, TemplateError
from superslm.formats.gguf import GGUFFile
from superslm.tokenizer import ChatTemplate, Tokenizer
from tests.gguf_plain_maps import plain_maps

# --- real templates, as their model repositories ship them ------------------------------------------

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

# Llama 3.1 Instruct's (3.3 ships the same one): JSON tools in the first user message, builtin tools.
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

# Gemma 3's (google/gemma-3-*-it tokenizer_config.json); the Gemma 3 GGUF under test carries none.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# --- conversations ---------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant. Réponds en français si besoin."}
USER = {"role": "user", "content": "  What is 2 + 2?\nAnswer in one word. 😀  "}
ASSISTANT = {"role": "assistant", "content": "Four."}
USER2 = {"role": "user", "content": "And 3 + 3? 中文也可以"}
PLAIN = [[USER], [SYSTEM, USER], [SYSTEM, USER, ASSISTANT, USER2]]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "content": '{"temp_c": 21, "sky": "clear"}'},
]
THINKING_CHAT = [
    USER,
    {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4."},
    USER2,
]


@pytest.fixture(scope="module")
def ref(smollm2_gguf: Path) -> Any:
    """transformers' tokenizer for SmolLM2's GGUF: its apply_chat_template is the oracle."""
    from transformers import AutoTokenizer

    with plain_maps():  # the same tokenizer, its GGUF read ~3x faster
        return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def _same(ref: Any, source: str, messages: list, add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render with us and with transformers; they must agree."""
    kwargs["add_generation_prompt"] = add_generation_prompt  # defaults differ: ours True, theirs False
    ours = ChatTemplate(source, bos_token=ref.bos_token, eos_token=ref.eos_token).render(messages, **kwargs)
    want = ref.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)
    assert ours == want
    return ours


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_gguf_template(smollm2_gguf: Path, ref: Any, add_generation_prompt: bool) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)
    assert tok.chat_template is not None
    for messages in PLAIN:
        ours = ChatTemplate(tok.chat_template, tok.bos_token or "", tok.eos_token or "").render(
            messages, add_generation_prompt=add_generation_prompt
        )
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == want
        assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_gemma3_template(gemma3_gguf: Path, ref: Any) -> None:
    # The Gemma 3 GGUF under test carries no chat template; Gemma 3's own is checked as a string.
    assert Tokenizer.from_gguf(GGUFFile(gemma3_gguf).metadata).chat_template is None
    for messages in PLAIN:
        for agp in (True, False):
            _same(ref, GEMMA3, messages, add_generation_prompt=agp)
    parts = [{"role": "user", "content": [{"type": "text", "text": " Describe "}, {"type": "image"}]}]
    assert "<start_of_image>" in _same(ref, GEMMA3, parts)
    with pytest.raises(TemplateError, match="must alternate"):
        ChatTemplate(GEMMA3).render([USER, USER])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen25_template_with_tools(ref: Any, add_generation_prompt: bool) -> None:
    for messages in [*PLAIN, TOOL_CHAT]:
        _same(ref, QWEN25, messages, add_generation_prompt=add_generation_prompt)
        out = _same(ref, QWEN25, messages, tools=TOOLS, add_generation_prompt=add_generation_prompt)
        assert '"Zürich' in out or "Zürich" in out  # tojson keeps non-ASCII as is


def test_llama31_template_with_tools(ref: Any) -> None:
    for messages in PLAIN:
        _same(ref, LLAMA31, messages, add_generation_prompt=True)
    out = _same(ref, LLAMA31, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert json.dumps(TOOLS[0], indent=4, ensure_ascii=False) in out
    _same(ref, LLAMA31, TOOL_CHAT, tools=TOOLS, date_string="01 Jan 2025", tools_in_user_message=False)
    _same(ref, LLAMA31, TOOL_CHAT[:2], builtin_tools=["brave_search", "wolfram_alpha"])
    with pytest.raises(TemplateError, match="single tool-calls"):
        two_calls = {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}
        ChatTemplate(LLAMA31).render([USER, two_calls])


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_template_thinking(ref: Any, enable_thinking: bool | None) -> None:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for messages in [*PLAIN, THINKING_CHAT, TOOL_CHAT]:
        out = _same(ref, QWEN3, messages, add_generation_prompt=True, **kwargs)
        assert out.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
        _same(ref, QWEN3, messages, tools=TOOLS, add_generation_prompt=True, **kwargs)
    # reasoning under another name reaches the template too, as transformers aliases it
    aliased = [USER, {"role": "assistant", "content": "Four.", "thinking": "2 + 2 = 4."}]
    assert "<think>\n2 + 2 = 4.\n</think>" in _same(ref, QWEN3, aliased, add_generation_prompt=False)


def test_helpers(ref: Any) -> None:
    data = {"b": [1, 2], "a": 'é"<>&'}
    src = "{{ d | tojson }}|{{ d | tojson(indent=2, sort_keys=True) }}|{{ d | tojson(separators=(',', ':')) }}"
    out = ChatTemplate(src).render([USER], d=data)
    assert out == "|".join(
        [
            json.dumps(data, ensure_ascii=False),
            json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True),
            json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        ]
    )
    assert ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([USER]) == datetime.now().strftime("%Y-%m-%d")
    loops = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert _same(ref, loops, [USER, ASSISTANT]) == "user"
    # compiled once per source
    assert ChatTemplate(QWEN25)._template is ChatTemplate(QWEN25)._template


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set x = messages[0].update({'role': 'x'}) %}",
        "{% set ns = namespace(_secret=1) %}",
        "{{ (1).__class__.__base__ }}",
    ],
)
def test_sandbox_escapes_are_refused(source: str) -> None:
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([USER])


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% set xs = range(100000)|list %}{% for a in xs %}{% for b in xs %}{{ '' }}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "{{ 'x' * 10 ** 9 }}",
        "{{ [1, 2] * 10 ** 8 }}",
        "{{ (2 ** 4000) ** 8 }}",
    ],
)
def test_a_hostile_template_ends_within_its_budget(source: str) -> None:
    """A template's loops once rendered for minutes (and held a server worker for good); a `*` or `**` can take
    all memory in one line. A render now ends with TemplateError within its budget, and the thread's trace
    function (a debugger's, coverage's) is restored."""
    from superslm.tokenizer.chat import RENDER_SECONDS

    before = sys.gettrace()
    start = time.monotonic()
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([USER])
    assert time.monotonic() - start < RENDER_SECONDS + 2
    assert sys.gettrace() is before


def test_the_budget_leaves_real_templates_alone() -> None:
    chat = [USER if i % 2 == 0 else {"role": "assistant", "content": "fine " * 50} for i in range(400)]
    assert ChatTemplate(QWEN25).render(chat).count("<|im_start|>") == 402  # system, 400, the answer


def test_template_errors() -> None:
    with pytest.raises(TemplateError, match="no assistant here"):
        ChatTemplate("{{ raise_exception('no assistant here') }}").render([USER])
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 1 // 0 }}").render([USER])


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        {"role": "user", "content": "hi"},
        ["hello"],
        [{"content": "no role"}],
        [{"role": 1, "content": "bad role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "dict content"}}],
        [{"role": "user", "content": "hi", "extra": object()}],
    ],
)
def test_malformed_messages_are_refused(messages: Any) -> None:
    with pytest.raises(InvalidArgument):
        ChatTemplate(QWEN25).render(messages)


def test_malformed_tools_are_refused() -> None:
    for tools in ("get_weather", TOOLS[0], ["get_weather"]):
        with pytest.raises(InvalidArgument):
            ChatTemplate(QWEN25).render([USER], tools=tools)


def test_continue_final_message_cuts_as_transformers(smollm2_gguf: Path, ref: Any) -> None:
    """Model.chat_prompt(continue_final_message=True) ends inside the last message as apply_chat_template does: a
    template that keeps the content's spacing (ChatML) and one that trims it (Gemma 3's), content parts too."""
    from superslm.model import _cut_at_tag, _tag_final

    smol = Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata).chat_template
    finals = [{"role": "assistant", "content": "Sure! The first is "}, {"role": "assistant", "content": "  x"},
              {"role": "assistant", "content": [{"type": "text", "text": "Part one "}]}]  # fmt: skip
    for source in (smol, GEMMA3, QWEN25):
        for final in finals:
            if source != GEMMA3 and not isinstance(final["content"], str):
                continue  # ChatML templates print a parts list as is
            messages = [USER, final]
            ours = _cut_at_tag(ChatTemplate(source, bos_token=ref.bos_token, eos_token=ref.eos_token).render(
                _tag_final(messages), add_generation_prompt=False))
            want = ref.apply_chat_template(messages, chat_template=source, tokenize=False, continue_final_message=True)
            assert ours == want, (source[:30], final)
    for bad in ([], [{"role": "assistant"}], [{"role": "assistant", "content": [{"type": "image"}]}]):
        with pytest.raises(InvalidArgument):
            _tag_final(bad)
    with pytest.raises(TemplateError, match="continue_final_message"):
        _cut_at_tag("<|im_start|>assistant\n")
