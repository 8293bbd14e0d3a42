"""Anthropic's Messages API on the chat machinery: POST /v1/messages and /v1/messages/count_tokens.

A Messages body is translated into the chat request it means (the system text first; tool_use blocks
as an assistant's tool calls, tool_result blocks as tool messages; tools and tool_choice as OpenAI's;
a last assistant message as a prefill the answer continues), so the prompt, tools, grammars and
sampling are the chat path's own (`generate.plan_chat`, `generate.run`). Only the answer is shaped
here: content blocks (text, tool_use), stop_reason, usage, and the stream's events in Anthropic's
order (message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop). `AnthropicErrors` rewrites every error on these routes into
Anthropic's shape `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from superslm.errors import InternalError, QueueFull, SuperSLMError
from superslm.serve.generate import Writer, plan_chat, run, sse
from superslm.serve.output import Choice, Job
from superslm.serve.protocol import ChatRequest, bad, parse, renamed
from superslm.serve.reasoning import has_reasoning

if TYPE_CHECKING:
    from superslm.serve.app import ServerState

#: the routes whose errors take Anthropic's shape
PREFIX = "/v1/messages"
#: Anthropic's error type per HTTP status (others: invalid_request_error below 500, api_error from it)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
#: the sampling extensions a Messages body may carry as well (Anthropic has none; vLLM's and OpenAI's names)
EXTENSIONS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
              "min_tokens", "stop_token_ids", "truncate_prompt_tokens", "guided_regex", "guided_choice",
              "guided_grammar", "guided_json", "structured_outputs")
#: the chat checks' field names, as a Messages body spells them
RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's shape."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


class MessagesRequest(BaseModel):
    """POST /v1/messages (and count_tokens, where max_tokens is not needed). Unknown fields are allowed
    (`metadata`, `service_tier`, a block's `cache_control`): none of them changes the answer, except the
    sampling extensions in EXTENSIONS (`seed`, `ignore_eos`, ...), which mean what they mean in a chat request."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[Any]
    max_tokens: int | None = None
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    #: structured output ({"format": {"type": "json_schema", "schema": ...}}); its `effort` changes nothing here
    output_config: dict[str, Any] | None = None


def to_chat(req: MessagesRequest, counting: bool = False) -> ChatRequest:
    """The chat request a Messages body means (`counting`: for count_tokens, max_tokens may be absent).
    Raises InvalidArgument naming the Messages field at fault."""
    if not counting and req.max_tokens is None:
        raise bad("max_tokens", "max_tokens: required (the most tokens the answer may have)")
    thinking = _thinking(req.thinking)
    for name in ("mcp_servers", "container"):
        if (req.model_extra or {}).get(name):
            raise bad(name, f"{name}: not supported")
    if not req.messages:
        raise bad("messages", "messages: must be a non-empty list of messages")
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the tool_result blocks that answer it
    for i, m in enumerate(req.messages):
        messages.extend(_messages(i, m, names, last=i == len(req.messages) - 1))
    prefill = messages[-1]["role"] == "assistant"
    if prefill and messages[-1].get("tool_calls"):
        raise bad("messages", "messages: the last message is an assistant's tool_use; answer it with a user "
                              "message of tool_result blocks")
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": req.temperature,
        "stream": req.stream, "stop": req.stop_sequences,
        # a last assistant message is a prefill: the answer continues it, with no new turn opened
        "add_generation_prompt": not prefill, "continue_final_message": prefill,
    }
    extra = req.model_extra or {}
    fields.update({name: extra[name] for name in EXTENSIONS if name in extra})
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking}
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.top_k is not None:
        fields["top_k"] = req.top_k
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"], parallel = _tool_choice(req.tool_choice)
        if parallel is not None:
            fields["parallel_tool_calls"] = parallel
    form = (req.output_config or {}).get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise bad("output_config", 'output_config.format: must be {"type": "json_schema", "schema": {...}}')
        # the chat path's structured output: compiled, and a bad schema is a 400, before the request is queued
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    return ChatRequest(**fields)


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """enable_thinking for Anthropic's `thinking` (None: the template's default)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking", "thinking.type: must be enabled, disabled or adaptive")
    # budget_tokens is accepted; the answer's max_tokens bounds thinking and text together
    return {"enabled": True, "disabled": False}.get(kind)


def _system_text(system: str | list[Any] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad("system", f"system[{j}]: must be a text block {{\"type\": \"text\", \"text\": ...}}")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _messages(i: int, m: Any, names: dict[str, str], last: bool) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user's tool_result blocks become tool messages (in their
    order, among its text), an assistant's tool_use blocks its tool calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad("messages", f"{where}: must be an object with role and content")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad("messages", f"{where}.role: must be user or assistant (a system prompt is the top-level "
                              "system field)")
    content = m.get("content")
    if isinstance(content, str):
        if not content and not (last and role == "assistant"):
            raise bad("messages", f"{where}.content: must not be empty")
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or (not content and not (last and role == "assistant")):
        raise bad("messages", f"{where}.content: must be a string or a non-empty list of content blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad("messages", f"{at}.text: must be a string")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(args, dict):
                raise bad("messages", f"{at}: a tool_use block needs an id, a name and an input object")
            names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking: chat templates leave it out of the history
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in names:
                raise bad("messages", f"{at}.tool_use_id: names no tool_use block of an earlier assistant message")
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            text = _result_text(block.get("content", ""), at)
            # a template has no field for a failed call: the model reads it in the text
            if block.get("is_error") is True:
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text})
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise bad("messages", f"{at}: a {kind!r} block is not supported in a {role} message (only {allowed})")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _result_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise bad("messages", f"{at}.content: a tool_result's content must be a string or a list of text blocks")


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """An Anthropic tool {name, description, input_schema} as an OpenAI function tool."""
    if not isinstance(tool, dict):
        raise bad("tools", f"tools[{i}]: must be an object")
    if tool.get("type") not in (None, "custom"):
        raise bad("tools", f"tools[{i}]: only custom tools (name, description, input_schema) are supported, "
                           f"not {str(tool.get('type'))[:64]!r}")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad("tools", f"tools[{i}].input_schema: required, a JSON schema object")
    fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls or None) of an Anthropic tool_choice."""
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad("tool_choice", "tool_choice.name: required when type is tool")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad("tool_choice", "tool_choice.type: must be auto, any, tool or none")


# --- the answer ----------------------------------------------------------------------------------


def cut_short(c: Choice) -> SuperSLMError | None:
    """Why a finished choice was cut short (its grammar died, or the server cancelled it), or None: the
    Messages and Responses APIs have no finish reason for it, so it ends the request as an error."""
    reason = c.finish_reason
    if reason == "error":
        return InternalError("the answer stopped early: its grammar allowed no token, or the model's logits "
                             "were not finite")
    if reason == "abort":
        return QueueFull("the server cancelled the request")
    return None


def _stop(c: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    reason = c.finish_reason
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):  # a stop string (a stop token's reason is its id)
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(job: Job) -> dict[str, int]:
    usage = job.usage()
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


def event(name: str, data: dict[str, Any]) -> str:
    """One SSE frame with its event name (Anthropic's clients skip frames without one)."""
    return f"event: {name}\n{sse(data)}"


class AnthropicShape:
    """The Messages API's body and stream of one request's job (a single choice)."""

    endpoint = "messages"

    def __init__(self) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, job: Job, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": job.model_name, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def body(self, job: Job) -> dict[str, Any]:
        c = job.choices[0]
        failure = cut_short(c)
        if failure is not None:
            raise failure
        text = "".join(c.text) if c.tools is None else c.tools.content
        thought = "".join(c.thought)
        content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        if text:
            content.append({"type": "text", "text": text})
        for call in c.tools.calls if c.tools is not None else ():
            content.append({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        return self.message(job, content, _stop(c), _usage(job))

    def writer(self, state: ServerState, job: Job) -> Writer:
        return _Stream(self, state, job)


class _Stream:
    """The events of one stream: a block opens at its first delta (text) or its call (tool_use), and the
    ping follows the first block's start, as Anthropic sends it."""

    def __init__(self, shape: AnthropicShape, state: ServerState, job: Job) -> None:
        self.shape, self.state, self.job = shape, state, job
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.pinged = False

    def start(self) -> list[str]:
        message = self.shape.message(self.job, [], (None, None),
                                     {"input_tokens": sum(self.job.prompt_lens), "output_tokens": 0})
        return [event("message_start", {"type": "message_start", "message": message})]

    def _block(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        return out + self._ping()

    def _ping(self) -> list[str]:
        if self.pinged:
            return []
        self.pinged = True
        return [event("ping", {"type": "ping"})]

    def _close(self) -> list[str]:
        if not self.open:
            return []
        # a thinking block ends with its signature, as Anthropic's do (ours is empty: nothing to verify)
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return [*out, event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def pieces(self, pieces: list[dict[str, Any]]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            delta = piece.get("delta", {})
            thought = delta.get("reasoning_content")
            if thought:
                if self.open != "thinking":
                    out += self._block({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": thought}))
            text = delta.get("content")
            if text:
                if self.open != "text":
                    out += self._block({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls", ()):
                fn = call["function"]
                if "id" in call:
                    out += self._block({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": fn["name"],
                                        "input": {}})
                elif fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def end(self) -> list[str]:
        c = self.job.choices[0]
        failure = cut_short(c)
        if failure is not None:
            return self._close() + self.error(failure)
        stop_reason, stop_sequence = _stop(c)
        usage = {"output_tokens": _usage(self.job)["output_tokens"]}
        return [*self._close(), *self._ping(),
                event("message_delta", {"type": "message_delta", "usage": usage,
                                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}),
                event("message_stop", {"type": "message_stop"})]

    def error(self, error: SuperSLMError) -> list[str]:
        message = self.state.error_body(error)["message"]
        return [event("error", error_body(error.http_status, message))]


# --- the routes ----------------------------------------------------------------------------------


async def messages(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/messages."""
    req = parse(MessagesRequest, await state.read_body(request))
    try:
        chat = to_chat(req)
        if req.thinking and req.thinking.get("type") == "enabled" and not has_reasoning(state.model.chat_template):
            raise bad("thinking", "thinking: this model's chat template writes no thinking blocks")
        plan = await plan_chat(state, chat)
        return await run(state, request, chat, plan.job, [plan.ids], plan.asked, None, None, plan.constraint,
                         AnthropicShape(), after=plan.after)
    except SuperSLMError as e:
        raise renamed(e, RENAMES) from None


async def count_tokens(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens the same /v1/messages request would use."""
    req = parse(MessagesRequest, await state.read_body(request))
    try:
        plan = await plan_chat(state, to_chat(req, counting=True), compile=False)
    except SuperSLMError as e:
        raise renamed(e, RENAMES) from None
    return JSONResponse({"input_tokens": len(plan.ids)})


# --- errors --------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class AnthropicErrors:
    """ASGI middleware: on the /v1/messages routes, an error body in OpenAI's shape (as the app's handlers and
    its other middleware write every error) is rewritten into Anthropic's, its status kept."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def rewrite(message: Any) -> None:
            if message["type"] == "http.response.start":
                json_body = any(k.lower() == b"content-type" and v.startswith(b"application/json")
                                for k, v in message.get("headers", []))
                if message["status"] >= 400 and json_body:
                    held["start"] = message  # sent with the rewritten body
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start = held.pop("start")
                body = _anthropic_error(b"".join(chunks), start["status"])
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewrite)


def _anthropic_error(body: bytes, status: int) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:400] or f"HTTP {status}"
    return json.dumps(error_body(status, str(message)), ensure_ascii=False).encode()
