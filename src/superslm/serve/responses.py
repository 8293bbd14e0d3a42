"""OpenAI's Responses API on the chat machinery: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A Responses body is translated into the chat request it means (`instructions` as the system message; input
items as messages: a message's text parts, `function_call` items as an assistant's tool calls,
`function_call_output` items as tool messages; `text.format` as a response_format; function tools and
tool_choice as the chat endpoint's), so the prompt, tools, grammars and sampling are the chat path's own
(`generate.plan_chat`, `generate.run`). Only the answer is shaped here: output items (a message of
`output_text`, `function_call`s), status (`completed`, or `incomplete` at max_output_tokens), usage, and the
stream's events in OpenAI's order (response.created, response.in_progress, output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done, function
call arguments likewise, response.completed), each with its sequence_number.

`previous_response_id` continues a stored response: its conversation (input and output, not its
instructions) comes before the new input. Responses are stored unless `store` is false, in a bounded
in-memory store (`ResponseStore`: the oldest go first); a server restart forgets them.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from superslm.errors import SuperSLMError, UnknownRequest
from superslm.serve.anthropic import cut_short
from superslm.serve.generate import Writer, plan_chat, run, sse
from superslm.serve.output import Choice, Job
from superslm.serve.protocol import REASONING_EFFORTS, ChatRequest, bad, parse, renamed
from superslm.serve.reasoning import effort_switch

if TYPE_CHECKING:
    from superslm.serve.app import ServerState

#: sampling extensions a Responses body may carry as well (vLLM's and the chat endpoint's names)
EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
              "min_tokens", "stop", "stop_token_ids", "truncate_prompt_tokens", "guided_regex", "guided_choice",
              "guided_grammar", "guided_json", "structured_outputs")
#: the chat checks' field names, as a Responses body spells them
RENAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}
#: Responses fields that would change the answer and are not supported (a 400, never ignored)
REFUSED = ("background", "conversation", "prompt", "top_logprobs", "max_tool_calls", "image", "context_management")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are allowed (`metadata`, `user`, `service_tier`, `include`, ...): none
    of them changes the answer, except the sampling extensions in EXTENSIONS."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    #: {"effort": ...}: "none" turns a reasoning template's thinking off, the others leave it to the template
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None


class ResponseStore:
    """The last `size` stored responses: each one's body and the conversation it ends (chat messages, without
    its instructions), which a later request continues by `previous_response_id`. Thread-safe."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[body["id"]] = (copy.deepcopy(body), copy.deepcopy(conversation))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(body, conversation) of a stored response, or UnknownRequest (404) naming `param`."""
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            e = UnknownRequest(f"no stored response has the id {response_id[:100]!r} (responses made with "
                               "store: false are not kept, and the store keeps the last "
                               f"{self.size})")
            e.param = param  # type: ignore[attr-defined]
            raise e
        return copy.deepcopy(item[0]), copy.deepcopy(item[1])

    def has(self, response_id: str) -> bool:
        with self._lock:
            return response_id in self._items

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)


# --- the request ---------------------------------------------------------------------------------


def to_chat(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The chat request a Responses body means, and its conversation without instructions (`earlier`: the
    conversation of its previous response). Raises InvalidArgument naming the Responses field at fault."""
    extra = req.model_extra or {}
    for name in REFUSED:
        if extra.get(name):
            raise bad(name, f"{name}: not supported")
    if req.truncation not in (None, "disabled", "auto"):
        raise bad("truncation", "truncation: must be disabled or auto")
    conversation = [*earlier, *_input_messages(req.input, _call_names(earlier))]
    if not conversation:
        raise bad("input", "input: must be a non-empty string or list of items")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "stream": req.stream,
    }
    fields.update({name: extra[name] for name in EXTENSIONS if name in extra})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad("reasoning", f"reasoning.effort: must be one of {', '.join(REASONING_EFFORTS)}")
    if effort_switch(effort) is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": effort_switch(effort)}
    if req.truncation == "auto":  # the oldest tokens go where the prompt passes the context
        fields.setdefault("truncate_prompt_tokens", -1)
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    form = (req.text or {}).get("format")
    if form is not None:
        fields["response_format"] = _format(form)
    return ChatRequest(**fields), conversation


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """call_id -> function name of every tool call in `messages`."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}


def _input_messages(items: str | list[Any], names: dict[str, str]) -> list[dict[str, Any]]:
    """The input as chat messages: consecutive function_call items join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("input", f"{at}: must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad("input", f"{at}.role: must be user, assistant, system or developer")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(args, str):
                raise bad("input", f"{at}: a function_call item needs call_id, name and arguments (a JSON string)")
            try:
                json.loads(args)
            except ValueError:
                raise bad("input", f"{at}.arguments: not valid JSON") from None
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in names:
                raise bad("input", f"{at}.call_id: names no function_call before it (in this input or the "
                                   "previous response)")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{at}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "name": names[call_id], "content": text})
        elif kind == "reasoning":
            continue  # a model's earlier thinking: chat templates leave it out of the history
        else:
            raise bad("input", f"{at}: items of type {str(kind)[:64]!r} are not supported (message, function_call, "
                               "function_call_output)")
    return out


def _text(content: Any, at: str) -> str:
    """A message's content (a string, or a list of input_text / output_text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("input", f"{at}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad("input", f"{at}[{j}]: {str(kind)[:64]!r} parts are not supported (input_text, output_text)")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise bad("input", f"{at}[{j}]: its text must be a string")
        texts.append(value)
    return "".join(texts)


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool {type, name, description, parameters, strict} as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad("tools", f"tools[{i}]: only function tools are supported, not {str(kind)[:64]!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: the chat endpoint's own words (and its checks)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", 'tool_choice: must be auto, none, required or {"type": "function", "name": ...}')


def _format(form: Any) -> dict[str, Any]:
    """text.format as a chat response_format."""
    kind = form.get("type") if isinstance(form, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": spec}
    raise bad("text", "text.format.type: must be text, json_object or json_schema")


# --- the answer ----------------------------------------------------------------------------------


class ResponsesShape:
    """One request's Response object and stream (a single choice); stores the response when it is done."""

    endpoint = "responses"

    def __init__(self, req: ResponsesRequest, store: ResponseStore, conversation: list[dict[str, Any]]) -> None:
        self.req, self.store, self.conversation = req, store, conversation
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, job: Job, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        r = self.req
        done = status != "in_progress"
        usage = None
        if done:
            u = job.usage()
            usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                     "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                     "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get(
                         "cached_tokens", 0)},
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(job)}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": job.model_name, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id, "reasoning": r.reasoning or {"effort": None},
            "store": r.store, "temperature": r.temperature, "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": r.top_p if r.top_p is not None
            else 1.0, "truncation": r.truncation or "disabled", "usage": usage, "metadata": r.metadata or {},
        }

    @staticmethod
    def reasoning_tokens(job: Job) -> int:
        """The thinking's tokens (its text encoded again: the sampled tokens are not kept apart)."""
        thought = "".join(job.choices[0].thought)
        return len(job.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0

    def items(self, c: Choice) -> list[dict[str, Any]]:
        """The output items of a finished choice: its message (when it has text), then its calls."""
        text = "".join(c.text) if c.tools is None else (c.tools.content or "")
        thought = "".join(c.thought)
        out: list[dict[str, Any]] = [self.reasoning_item(thought, "completed")] if thought else []
        if text:
            out.append(self.message_item(text, "completed"))
        for call in c.tools.calls if c.tools is not None else ():
            out.append(self.call_item(call, "completed"))
        return out

    def reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments,
                "status": status}

    def finish(self, job: Job) -> dict[str, Any]:
        """The finished response (stored unless store is false), or the error that cut it short."""
        c = job.choices[0]
        failure = cut_short(c)
        if failure is not None:
            raise failure
        body = self.response(job, "incomplete" if c.finish_reason == "length" else "completed", self.items(c))
        if self.req.store:
            text = "".join(c.text) if c.tools is None else (c.tools.content or "")
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if c.tools is not None and c.tools.calls:
                answer["tool_calls"] = c.tools.calls
            self.store.put(body, [*self.conversation, answer])
        return body

    def body(self, job: Job) -> dict[str, Any]:
        return self.finish(job)

    def writer(self, state: ServerState, job: Job) -> Writer:
        return _Stream(self, state, job)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Stream:
    """The events of one stream: the message item opens at the first text, each call's item at its call."""

    def __init__(self, shape: ResponsesShape, state: ServerState, job: Job) -> None:
        self.shape, self.state, self.job = shape, state, job
        self.seq = 0
        self.index = -1  # the open item's output_index
        self.open: dict[str, Any] | None = None  # the open item, as it will be when done
        self.done_items: list[dict[str, Any]] = []

    def event(self, kind: str, **data: Any) -> str:
        frame = f"event: {kind}\n{sse({'type': kind, 'sequence_number': self.seq, **data})}"
        self.seq += 1
        return frame

    def start(self) -> list[str]:
        body = self.shape.response(self.job, "in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=self.index,
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
            out += [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                    self.event("response.content_part.done", **where, part=_text_part(text))]
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=self.index, arguments=item["arguments"]))
        item["status"] = "completed"
        self.done_items.append(item)
        return [*out, self.event("response.output_item.done", output_index=self.index, item=item)]

    def pieces(self, pieces: list[dict[str, Any]]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            delta = piece.get("delta", {})
            thought = delta.get("reasoning_content")
            if thought:
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._close()
                    self.index += 1
                    self.open = self.shape.reasoning_item("", "in_progress")
                    out.append(self.event("response.output_item.added", output_index=self.index,
                                          item=self.shape.reasoning_item(None, "in_progress")))
                self.open["content"][0]["text"] += thought
                out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=self.index, content_index=0, delta=thought))
            text = delta.get("content")
            if text:
                if self.open is None or self.open["type"] != "message":
                    out += self._close()
                    self.index += 1
                    self.open = self.shape.message_item("", "in_progress")
                    out.append(self.event("response.output_item.added", output_index=self.index,
                                          item=self.shape.message_item(None, "in_progress")))
                    out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                          output_index=self.index, content_index=0, part=_text_part("")))
                self.open["content"][0]["text"] += text
                out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self.index,
                                      content_index=0, delta=text, logprobs=[]))
            for call in delta.get("tool_calls", ()):
                args = call["function"].get("arguments") or ""
                if "id" in call:
                    out += self._close()
                    self.index += 1
                    self.open = self.shape.call_item(call, "in_progress", "")
                    out.append(self.event("response.output_item.added", output_index=self.index,
                                          item=dict(self.open)))
                if args and self.open is not None:
                    self.open["arguments"] += args
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=self.index, delta=args))
        return out

    def end(self) -> list[str]:
        out = self._close()
        try:
            body = self.shape.finish(self.job)
        except SuperSLMError as e:
            return out + self.error(e)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=body)]

    def error(self, error: SuperSLMError) -> list[str]:
        e = self.state.error_body(error)
        return [self.event("error", code=e["code"], message=e["message"], param=e["param"])]


# --- the routes ----------------------------------------------------------------------------------


async def create(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/responses."""
    req = parse(ResponsesRequest, await state.read_body(request))
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        _, earlier = state.responses.get(req.previous_response_id, "previous_response_id")
    try:
        chat, conversation = to_chat(req, earlier)
        plan = await plan_chat(state, chat)
        shape = ResponsesShape(req, state.responses, conversation)
        return await run(state, request, chat, plan.job, [plan.ids], plan.asked, None, None, plan.constraint, shape,
                         after=plan.after)
    except SuperSLMError as e:
        raise renamed(e, RENAMES) from None


async def retrieve(state: ServerState, request: HTTPRequest) -> Response:
    """GET /v1/responses/{response_id}: a stored response."""
    body, _ = state.responses.get(request.path_params["response_id"], "response_id")
    return JSONResponse(body)


async def delete(state: ServerState, request: HTTPRequest) -> Response:
    """DELETE /v1/responses/{response_id}."""
    response_id = request.path_params["response_id"]
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
