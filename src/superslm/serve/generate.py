"""The generation endpoints' flow: body -> token ids -> Submission -> a JSON body or an SSE stream.

A client that goes away is noticed by a task reading the ASGI `receive` channel: it puts a `None`
into the submission's event queue, and whoever reads the queue cancels the submission at once, so
its KV pages return to the pool. A stream sends its headers only once the first event has come, so
a request that fails before its first token gets a plain HTTP error.

A constraint (response_format, guided_*, a forced tool call) is compiled before the request is
queued (see structured.py): an invalid one is a 400 and never reaches the engine thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from superslm.engine import Request
from superslm.errors import ContextLengthExceeded, SuperSLMError, TokenOutOfRange
from superslm.grammar import Constraint
from superslm.grammar.spec import THINK_CLOSE
from superslm.serve.loop import Event, Submission
from superslm.serve.output import Job
from superslm.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    bad,
    chat_messages,
    check_chat,
    check_completion,
    param_of,
    parse,
    to_sampling,
)
from superslm.serve.reasoning import effort_switch, has_reasoning, prompt_thinking
from superslm.serve.structured import compile_constraint, prompt_inputs, request_constraint, tool_setup

if TYPE_CHECKING:
    from superslm.serve.app import ServerState

#: what a handler answers a client that is gone (nginx's "client closed request"; nobody reads it)
CLIENT_GONE = 499
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


#: characters JSON leaves raw that str.splitlines() (httpx's iter_lines among others) takes for line ends
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse(obj: Any) -> str:
    """One SSE frame; the JSON escapes every character a line-splitting client could cut a frame at."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that leaves disconnect detection to our own watcher (see module doc)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the client went away mid-write
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def watch_disconnect(request: HTTPRequest, sub: Submission) -> asyncio.Task[None]:
    """A task that puts None into the submission's queue when the client disconnects."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                sub.events.put_nowait(None)  # type: ignore[arg-type]
                return

    return asyncio.create_task(watch())


def budget(prompt_len: int, asked: int | None, default: int | None, context: int, param: str) -> int:
    """The max_tokens of one prompt: prompt + answer must fit in the context."""
    if prompt_len >= context:
        e = ContextLengthExceeded(f"the prompt has {prompt_len} tokens; the context holds {context} tokens")
        e.param = param  # type: ignore[attr-defined]
        raise e
    if asked is None:
        return min(default or context, context - prompt_len)
    if prompt_len + asked > context:
        e = ContextLengthExceeded(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({asked}) is more than the context ({context} tokens)"
        )
        e.param = "max_tokens"  # type: ignore[attr-defined]
        raise e
    return asked


def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = state.model.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        vocab = state.engine.vocab
        for t in ids:
            if not 0 <= t < vocab:
                e = TokenOutOfRange(f"prompt: token {t} is outside the vocabulary [0, {vocab})")
                e.param = "prompt"  # type: ignore[attr-defined]
                raise e
    if not ids:
        raise bad("prompt", "prompt: is empty")
    return ids


def _include_stop(req: CompletionRequest | ChatRequest) -> tuple[int, ...] | None:
    return tuple(req.stop_token_ids or ()) if req.include_stop_str_in_output else None


def _truncated(req: CompletionRequest | ChatRequest, ids: list[int], state: ServerState) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context's worth), its start dropped."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    return ids[-(state.engine.context if k == -1 else k):]


async def completions(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/completions."""
    body = await state.read_body(request)
    req = parse(CompletionRequest, body)
    check_completion(req)
    model_name = state.check_model(req.model, adapters=True)
    p = req.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
        prompts = [p]  # type: ignore[list-item]
    else:
        prompts = list(p)  # type: ignore[arg-type]
    if not prompts:
        raise bad("prompt", "prompt: is empty")
    constraint, param = request_constraint(req, state.model)
    if constraint is not None:
        await compile_constraint(state, constraint, param)
    ids = await asyncio.to_thread(lambda: [_truncated(req, _prompt_ids(state, x), state) for x in prompts])
    # echo: each choice's text starts with its prompt's (the string as given; token ids decoded)
    tok = state.model.tokenizer
    echo = [(x if isinstance(x, str) and req.truncate_prompt_tokens is None else tok.decode(i), i)
            for x, i in zip(prompts, ids)] if req.echo else None
    job = Job(state.model.tokenizer, model_name, False, req.n, [len(x) for x in ids], req.logprobs,
              bool(req.stream_options and req.stream_options.include_usage), include_stop=_include_stop(req),
              echo=echo, prompt_logprobs=req.prompt_logprobs)
    return await run(state, request, req, job, ids, req.max_tokens, DEFAULT_COMPLETION_TOKENS, req.logprobs,
                      constraint)


@dataclass
class ChatPlan:
    """A chat request made ready to run: its prompt ids, its Job, its compiled constraint, the answer
    tokens it asks for (None: up to the context) and its logprobs."""

    ids: list[int]
    job: Job
    constraint: Constraint | None
    asked: int | None
    logprobs: int | None
    #: the token after which the constraint starts (a reasoning model's end of thinking), None: from the first
    after: int | None = None


async def plan_chat(state: ServerState, req: ChatRequest, compile: bool = True) -> ChatPlan:
    """Check a chat request, render its prompt and build its Job (and compile its constraint unless
    `compile` is false: counting a prompt's tokens needs no grammar). Raises InvalidArgument & co."""
    check_chat(req)
    model_name = state.check_model(req.model, adapters=True)
    tools = tool_setup(req, state.model)
    constraint, param = request_constraint(req, state.model, tools)
    messages, template_tools = prompt_inputs(chat_messages(req.messages), tools, state.model.chat_template)
    kwargs = dict(req.chat_template_kwargs or {})
    enable_thinking = kwargs.pop("enable_thinking", None)
    if enable_thinking is None and req.reasoning_effort is not None:
        enable_thinking = effort_switch(req.reasoning_effort)
    # names the request sets itself, and the renderers' own parameters ("self": a TypeError, an HTTP 500)
    for reserved in ("self", "messages", "tools", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)

    def render() -> list[int]:
        return state.model.chat_tokens(messages, tools=template_tools, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       enable_thinking=enable_thinking, **kwargs)

    ids = _truncated(req, await asyncio.to_thread(render), state)
    # a reasoning template's answer has its thinking split off; the prompt's end says whether it starts inside
    thinking = prompt_thinking(state.model.tokenizer.decode(ids[-24:])) if has_reasoning(
        state.model.chat_template) else None
    reasoning = None if thinking is None else thinking == "open"
    # the grammar starts where the thinking ends, unless it names the closing tag (then it shapes the thinking too):
    # after the closing tag's token where it is one (nothing to mask while the model thinks), else in the grammar
    after = None
    if constraint is not None and thinking in ("open", "maybe") and THINK_CLOSE not in str(constraint.value or ""):
        close = state.model.tokenizer.encode(THINK_CLOSE, add_special_tokens=False)
        if thinking == "open" and len(close) == 1:
            after = close[0]
        else:
            constraint = constraint.after_thinking("open" if thinking == "open" else "optional")
    if constraint is not None and compile:
        await compile_constraint(state, constraint, param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # vLLM's chat echo: the answer continues the last message's role (no generation prompt): its content first
    echo = None
    last = messages[-1]
    role = "assistant" if req.add_generation_prompt else last.get("role")
    if req.echo and last.get("role") == role and isinstance(last.get("content"), str):
        echo = [(last["content"], [])]
    job = Job(state.model.tokenizer, model_name, True, req.n, [len(ids)], logprobs,
              bool(req.stream_options and req.stream_options.include_usage),
              tools=tools.tools if tools else None, forced_call=bool(tools and tools.forced),
              include_stop=_include_stop(req), prompt_logprobs=req.prompt_logprobs, echo=echo, reasoning=reasoning)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return ChatPlan(ids, job, constraint, asked, logprobs, after)


async def chat_completions(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/chat/completions."""
    body = await state.read_body(request)
    req = parse(ChatRequest, body)
    plan = await plan_chat(state, req)
    return await run(state, request, req, plan.job, [plan.ids], plan.asked, None, plan.logprobs, plan.constraint,
                     after=plan.after)


class Writer(Protocol):
    """One stream's frames in one API's shape (OpenAI's chunks, Anthropic's or the Responses API's events)."""

    def start(self) -> list[str]:
        """The frames before the first piece."""
        ...

    def pieces(self, pieces: list[dict[str, Any]]) -> list[str]:
        """The frames of the chat chunk choices `Job.absorb` returned."""
        ...

    def end(self) -> list[str]:
        """The last frames, once the job is done."""
        ...

    def error(self, error: SuperSLMError) -> list[str]:
        """The frames that end a stream an error cut short."""
        ...


class Shape(Protocol):
    """How one API answers a generation request: the metrics endpoint label, the whole body and the stream."""

    endpoint: str

    def body(self, job: Job) -> dict[str, Any]:
        """The non-streaming body of a finished job."""
        ...

    def writer(self, state: ServerState, job: Job) -> Writer:
        """A writer for one stream of `job`."""
        ...


class OpenAIShape:
    """OpenAI's completion and chat completion bodies and chunk streams (ended by `data: [DONE]`)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def body(self, job: Job) -> dict[str, Any]:
        return job.response()

    def writer(self, state: ServerState, job: Job) -> Writer:
        return _OpenAIWriter(state, job)


class _OpenAIWriter:
    def __init__(self, state: ServerState, job: Job) -> None:
        self.state, self.job = state, job

    def start(self) -> list[str]:
        return [sse(self.job.role_chunk())] if self.job.chat else []

    def pieces(self, pieces: list[dict[str, Any]]) -> list[str]:
        return [sse(self.job.chunk([p])) for p in pieces]

    def end(self) -> list[str]:
        usage = [sse(self.job.chunk([], usage=self.job.usage()))] if self.job.include_usage else []
        return [*usage, "data: [DONE]\n\n"]

    def error(self, error: SuperSLMError) -> list[str]:
        return [sse({"error": self.state.error_body(error)}), "data: [DONE]\n\n"]


COMPLETIONS, CHAT = OpenAIShape("completions"), OpenAIShape("chat_completions")


async def run(state: ServerState, request: HTTPRequest, req: CompletionRequest | ChatRequest, job: Job,
              prompts: list[list[int]], asked: int | None, default: int | None, logprobs: int | None,
              grammar: Constraint | None = None, shape: Shape | None = None, after: int | None = None) -> Response:
    """Submit every choice (each constrained by `grammar`, compiled already), then answer with
    the whole body or a stream in `shape` (default: OpenAI's for the job's endpoint)."""
    shape = shape or (CHAT if job.chat else COMPLETIONS)
    asked_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if asked is not None and asked < 1:
        raise bad(asked_param, f"{asked_param}: must be at least 1, got {asked}")
    if req.max_tokens is not None and req.max_tokens < 1:  # beside max_completion_tokens, still checked
        raise bad("max_tokens", f"max_tokens: must be at least 1, got {req.max_tokens}")
    total = len(prompts) * req.n
    if total > state.loop.capacity:
        raise bad("n", f"n: the request asks for {total} sequences; this server holds at most {state.loop.capacity}")
    requests = []
    for ids in prompts:
        max_tokens = budget(len(ids), asked, default, state.engine.context, "messages" if job.chat else "prompt")
        for i in range(req.n):
            # every prompt's choice i gets seed + i (as vLLM): a batch answers as single requests do
            sampling = to_sampling(req, logprobs, seed_offset=i, grammar=grammar, after=after)
            requests.append(Request(prompt=ids, max_tokens=max_tokens, sampling=sampling,
                                    adapter=state.adapter_for(job.model_name), speculative=not req.disable_spec_decode))
    for r in requests:  # the checks engine.add makes, here so that they fail as a 400 before any work
        try:
            r.sampling.validate(state.engine.vocab)
        except SuperSLMError as e:
            e.param = param_of(str(e), {"logprobs": "top_logprobs"} if job.chat else None)  # type: ignore[attr-defined]
            raise
        if r.sampling.min_tokens > r.max_tokens:
            raise bad("min_tokens", f"min_tokens: {r.sampling.min_tokens} is more than max_tokens {r.max_tokens}")
    sub = Submission(requests, prompt_tokens=sum(len(x) for x in prompts))
    state.loop.submit(sub)
    watcher = watch_disconnect(request, sub)
    done = False
    try:
        if req.stream:
            first = await sub.events.get()  # headers wait for it: an early error is a plain HTTP error
            failed = next((ev.error for ev in first or () if ev.error is not None), None)
            if failed is not None:
                raise failed
            if first is not None:
                done = True  # from here on the stream owns the submission and the watcher
                headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
                return EventStream(_frames(state, job, sub, first, watcher, shape), media_type="text/event-stream",
                                   headers=headers)
        elif await _collect(job, sub):
            done = True
            body = shape.body(job)  # may refuse (an Anthropic answer its grammar cut short): counted by the caller
            state.metrics.on_request(shape.endpoint, "success")
            return JSONResponse(body)
        state.metrics.on_request(shape.endpoint, "cancelled")  # the client went away
        return Response(status_code=CLIENT_GONE)
    finally:
        if not done:
            state.loop.cancel(sub)
            watcher.cancel()
        elif not req.stream:
            watcher.cancel()


async def _collect(job: Job, sub: Submission) -> bool:
    """Absorb every event to the end (False: the client went away); an error event is raised."""
    while not job.done:
        events = await sub.events.get()
        if events is None:
            return False
        for ev in events:
            if ev.error is not None:
                raise ev.error
            assert ev.progress is not None
            job.absorb(ev.index, ev.progress)
    return True


async def _frames(state: ServerState, job: Job, sub: Submission, first: list[Event],
                  watcher: asyncio.Task[None], shape: Shape) -> AsyncIterator[str]:
    outcome = "cancelled"
    writer = shape.writer(state, job)
    try:
        for frame in writer.start():
            yield frame
        events: list[Event] | None = first
        while events is not None:
            for ev in events:
                if ev.error is not None:  # after the headers: the error goes in the stream
                    outcome = "error" if ev.error.http_status >= 500 else "invalid"
                    for frame in writer.error(ev.error):
                        yield frame
                    return
                assert ev.progress is not None
                for frame in writer.pieces(job.absorb(ev.index, ev.progress)):
                    yield frame
            if job.done:
                # counted before the last frames, so a client that has read them sees it in /metrics
                outcome = "success"
                state.metrics.on_request(shape.endpoint, outcome)
                for frame in writer.end():
                    yield frame
                return
            events = await sub.events.get()
    finally:
        watcher.cancel()
        if outcome != "success":
            state.loop.cancel(sub)
            state.metrics.on_request(shape.endpoint, outcome)
