"""The FastAPI app: routes, API-key check, body limit, and errors in OpenAI's shape.

    import superslm
    from superslm.serve import create_app
    app = create_app(superslm.load("model.gguf"), slots=8, api_key="secret")
    # then: uvicorn.run(app, host="127.0.0.1", port=8000)
    app = create_app(Encoder.load("all-minilm-l6-v2"))      # /v1/embeddings only
    app = create_app(CrossEncoder.load("path/to/reranker"))  # /v1/rerank only

A language model serves the generation routes and /v1/embeddings (last-token pooling); an encoder
serves /v1/embeddings, a cross-encoder /v1/rerank (embeddings.py); any other route of the three
answers 400 (wrong model kind).

Every error answers `{"error": {"message", "type", "param", "code"}}`: SuperSLM errors with their
own `http_status` and `code`, HTTP-level ones (401, 404 route, 405, 413) with codes of their own.
Messages are cut short so that no error echoes a whole input back.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from superslm.encoders import CrossEncoder, Encoder
from superslm.errors import InternalError, ModelNotFound, SuperSLMError, UnsupportedModel
from superslm.serve import anthropic, embeddings, generate, responses
from superslm.serve.connections import ShutdownCut
from superslm.serve.guard import BrowserGuard, HostRules
from superslm.serve.loop import EngineLoop
from superslm.serve.metrics import Metrics
from superslm.serve.protocol import DetokenizeRequest, TokenizeRequest, bad, chat_messages, check_continue, parse

if TYPE_CHECKING:
    from superslm.engine import Engine
    from superslm.model import Model

MAX_MESSAGE = 400
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 503: "service_unavailable_error"}
HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_payload(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The inside of an OpenAI error body (the message cut to MAX_MESSAGE characters)."""
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"message": message, "type": kind, "param": param, "code": code}


def error_json(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    """An error response in OpenAI's shape."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": error_payload(status, message, code, param)}, status_code=status, headers=headers)


class ServerState:
    """What the routes share: the model, the engine loop (a language model's) or the encoder worker, the
    metrics and the settings. `kind` is "decoder", "encoder" or "cross-encoder"."""

    def __init__(self, model: Model | Encoder | CrossEncoder, engine: Engine | None, served_names: list[str],
                 api_key: str | None, max_waiting: int, max_body_bytes: int) -> None:
        self.model: Any = model  # a Model wherever `engine` is set (the generation routes need both)
        self.engine: Any = engine
        self.kind = "encoder" if isinstance(model, Encoder) else "cross-encoder" if isinstance(
            model, CrossEncoder) else "decoder"
        self.served_names = served_names
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(served_names[0])
        self.loop: Any = None if engine is None else EngineLoop(engine, max_waiting, self.metrics)
        self.worker = embeddings.EncoderWorker(max_waiting)
        self._embedder: Encoder | None = model if isinstance(model, Encoder) else None
        self.draining = False
        self.created = int(time.time())
        #: the Responses API's stored responses (previous_response_id, GET /v1/responses/{id})
        self.responses = responses.ResponseStore()
        #: LoRA adapters served by name (--lora, /v1/load_lora_adapter): name -> (adapter, folder)
        self.adapters: dict[str, tuple[Any, str]] = {}
        self.allow_lora_loading = False
        self.metrics.lora_info = self.lora_info

    def adapter_for(self, name: str) -> Any:
        """The adapter a served name means (None: the base model)."""
        entry = self.adapters.get(name)
        return entry[0] if entry is not None else None

    def lora_info(self) -> tuple[list[str], int]:
        """(the adapters live requests use, the adapters loaded), for vLLM's lora_requests_info."""
        return [n for n, (a, _) in self.adapters.items() if a.users], len(self.adapters)

    def load_adapter(self, name: str, folder: str) -> None:
        """Serve the PEFT LoRA folder as `name` (InvalidArgument: a name in use; AdapterMismatch: it does not fit)."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise bad("lora_name", "lora_name: required, a non-empty string")
        if not isinstance(folder, str) or not folder:
            raise bad("lora_path", "lora_path: required, the adapter's folder")
        if name in self.adapters or name in self.served_names:
            raise bad("lora_name", f"lora_name: {name[:100]!r} is already served")
        if not Path(folder).is_dir():
            raise bad("lora_path", "lora_path: not a folder on the server")
        try:
            adapter = self.model.adapter(folder)
        except ModelNotFound as e:  # a folder without an adapter in it: the client's path is wrong
            raise bad("lora_path", f"lora_path: {e}") from None
        self.adapters[name] = (adapter, folder)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (AdapterInUse while live requests use it)."""
        entry = self.adapters.get(name) if isinstance(name, str) else None
        if entry is None:
            e = ModelNotFound(f"no LoRA adapter is served as {str(name)[:100]!r}")
            e.param = "lora_name"  # type: ignore[attr-defined]
            raise e
        entry[0].unmap()
        del self.adapters[name]

    @property
    def max_len(self) -> int:
        """The longest input in tokens (a language model's context, an encoder's max_seq_length)."""
        return int(self.engine.context if self.engine is not None else self.model.max_seq_length)

    @property
    def alive(self) -> bool:
        """Whether the thread that does the work (engine loop or encoder worker) runs."""
        return bool(self.loop.alive if self.loop is not None else self.worker.alive)

    def start(self) -> None:
        if self.loop is not None:
            self.loop.start()
        self.worker.start()

    def stop(self) -> None:
        self.drain()
        if self.loop is not None:
            self.loop.stop()  # quick: cancels what is left and joins the loop thread
        self.worker.stop()

    def drain(self) -> None:
        """Refuse new work from now on (SIGTERM); what is in flight goes on. /health turns 503."""
        self.draining = True
        if self.loop is not None:
            self.loop.drain()
        self.worker.drain()

    def embedder(self) -> Encoder:
        """The Encoder behind /v1/embeddings (a language model's is built on first use), or a 400."""
        if self.kind == "cross-encoder":
            raise embeddings.wrong_kind(self.kind, self.served_names[0], "/v1/embeddings",
                                        "an embedding model or a language model")
        if self._embedder is None:
            try:
                # inputs get the server's context, as prompts do
                self._embedder = Encoder.from_model(self.model, pooling="last", normalize=True,
                                                    max_length=self.engine.context)
            except UnsupportedModel as e:  # a model loaded without all its layers
                e.param = "model"  # type: ignore[attr-defined]
                raise
        return self._embedder

    def reranker(self) -> CrossEncoder:
        """The CrossEncoder behind /v1/rerank, or a 400."""
        if not isinstance(self.model, CrossEncoder):
            raise embeddings.wrong_kind(self.kind, self.served_names[0], "/v1/rerank", "a cross-encoder")
        return self.model

    def check_model(self, name: str | None, adapters: bool = False) -> str:
        """The served name a request means (None: the first), or ModelNotFound (404); `adapters`: the name may
        be a LoRA adapter's (the generation routes)."""
        if name is None:
            return self.served_names[0]
        if adapters and name in self.adapters:
            return name
        if name not in self.served_names:
            e = ModelNotFound(f"the model {name[:100]!r} does not exist; this server serves {self.served_names}")
            e.param = "model"  # type: ignore[attr-defined]
            raise e
        return name

    async def read_body(self, request: HTTPRequest) -> bytes:
        """The request body, or 413 once it passes max_body_bytes (without reading the rest)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise HTTPException(413, f"the body is larger than {self.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise HTTPException(413, f"the body is larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def error_body(e: SuperSLMError) -> dict[str, Any]:
        """The `error` object for an error inside a stream."""
        return error_payload(e.http_status, str(e), e.code, getattr(e, "param", None))


def create_app(
    model: Model | Encoder | CrossEncoder,
    engine: Engine | None = None,
    *,
    slots: int = 8,
    context: int | None = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_waiting: int = 256,
    max_body_bytes: int = 4 << 20,
    allowed_hosts: Iterable[str] | None = None,
    cors_origins: Iterable[str] = (),
    lora: dict[str, str] | None = None,
    allow_lora_loading: bool = False,
    **engine_kwargs: Any,
) -> FastAPI:
    """The OpenAI-compatible app serving `model`: a language model, an `Encoder` (/v1/embeddings) or a
    `CrossEncoder` (/v1/rerank); the engine settings do not apply to the last two.

    `engine` defaults to `model.engine(slots, context, **engine_kwargs)`. `served_model_name`: the
    name(s) requests may give as `model` (default: model.name). `api_key`: when set, every route but
    /health needs `Authorization: Bearer <api_key>`. `max_waiting`: sequences admitted beyond the
    engine's slots before requests get 503. `max_body_bytes`: larger bodies get 413.
    `allowed_hosts`: the Host names requests may carry (default: loopback names; `*` any; `.example.com`
    with its subdomains), `cors_origins`: the web pages (origins) that may call it from a browser; other
    Origins get 403, a POST that is not `application/json` 415 (serve/guard.py).
    `lora`: PEFT LoRA folders served by name ({name: folder}); `allow_lora_loading`: /v1/load_lora_adapter and
    /v1/unload_lora_adapter may add and drop them at run time (they read folders on the server: off by default).
    The engine loop thread starts with the app's lifespan (or at the first request) and stops with it.
    """
    if isinstance(model, (Encoder, CrossEncoder)):
        if engine is not None:
            raise bad("engine", "engine: an encoder or cross-encoder is served without an engine")
    elif engine is None:
        engine = model.engine(slots=slots, context=context, **engine_kwargs)
    if engine is not None:
        # decode graphs (a GPU) captured before the engine thread starts: no request waits for a capture
        engine.warm_up_graphs()
    if served_model_name is None:
        names = [model.name]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    if not names:
        raise bad("served_model_name", "served_model_name: give at least one name")
    state = ServerState(model, engine, names, api_key, max_waiting, max_body_bytes)
    state.allow_lora_loading = allow_lora_loading
    for name, folder in (lora or {}).items():
        if engine is None:
            raise bad("lora", "lora: adapters are for a language model")
        state.load_adapter(name, folder)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        state.stop()

    app = FastAPI(title="SuperSLM", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    cors = [cors_origins] if isinstance(cors_origins, str) else list(cors_origins)
    hosts = [allowed_hosts] if isinstance(allowed_hosts, str) else allowed_hosts
    if cors:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    # a refused Host or Origin reaches no route and no CORS answer
    app.add_middleware(BrowserGuard, rules=HostRules(hosts, cors), error=error_json)
    # a request the end of a drain cuts still gets an API error
    app.add_middleware(ShutdownCut, draining=lambda: state.draining, error=error_payload)
    # outermost (added last): every error on the Anthropic routes, from the app or the middleware above, in its shape
    app.add_middleware(anthropic.AnthropicErrors)
    error_handlers(app)
    auth = Depends(_auth(state))

    @app.get("/health")
    async def health() -> Response:
        state.start()  # no-op once started (the lifespan starts it; some test clients skip that)
        if not state.alive:
            return error_json(503, "the engine loop has stopped", "engine_stopped")
        if state.draining:
            return error_json(503, "the server is shutting down", "shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[auth])
    async def metrics() -> Response:
        text = state.metrics.render(state.loop.stats() if state.loop is not None else None, state.alive)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def card(name: str) -> dict[str, Any]:
        out = {"id": name, "object": "model", "created": state.created, "owned_by": "superslm",
               "max_model_len": state.max_len}
        if name in state.adapters:  # vLLM's fields for an adapter: its folder, its base
            out.update(root=state.adapters[name][1], parent=names[0])
        return out

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [card(n) for n in [*names, *state.adapters]]})

    @app.get("/v1/models/{name:path}", dependencies=[auth])
    async def model_card(name: str) -> Response:
        return JSONResponse(card(state.check_model(name, adapters=True)))

    def counted(endpoint: str, run: Callable[[ServerState, HTTPRequest], Awaitable[Response]]) -> Any:
        async def handler(request: HTTPRequest) -> Response:
            try:
                return await run(state, request)
            except ClientDisconnect:  # gone while sending its body
                state.metrics.on_request(endpoint, "cancelled")
                return Response(status_code=generate.CLIENT_GONE)
            except (SuperSLMError, HTTPException) as e:
                status = e.http_status if isinstance(e, SuperSLMError) else e.status_code
                outcome = "rejected" if status == 503 else "invalid" if status < 500 else "error"
                state.metrics.on_request(endpoint, outcome)
                raise
            except Exception:
                state.metrics.on_request(endpoint, "error")
                raise

        return handler

    app.post("/v1/embeddings", dependencies=[auth])(counted("embeddings", embeddings.embeddings))
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(route, dependencies=[auth])(counted("rerank", embeddings.rerank))
    if engine is None:  # an encoder: the language-model routes are a 400, not a 404
        lm = "a language model"
        app.post("/v1/completions", dependencies=[auth])(
            counted("completions", embeddings.refuse("/v1/completions", lm)))
        app.post("/v1/chat/completions", dependencies=[auth])(
            counted("chat_completions", embeddings.refuse("/v1/chat/completions", lm)))
        app.post("/v1/messages", dependencies=[auth])(counted("messages", embeddings.refuse("/v1/messages", lm)))
        app.post("/v1/responses", dependencies=[auth])(counted("responses", embeddings.refuse("/v1/responses", lm)))
        for route in ("/tokenize", "/detokenize", "/v1/messages/count_tokens"):
            app.post(route, dependencies=[auth])(_bound(state, embeddings.refuse(route, lm)))
        return app
    _generation_routes(app, state, auth, counted)
    return app


def _generation_routes(app: FastAPI, state: ServerState, auth: Any, counted: Callable[..., Any]) -> None:
    """The routes of a language model: completions, chat, Anthropic's messages, OpenAI's responses, tokenize,
    detokenize."""
    model, engine = state.model, state.engine
    app.post("/v1/completions", dependencies=[auth])(counted("completions", generate.completions))
    app.post("/v1/chat/completions", dependencies=[auth])(counted("chat_completions", generate.chat_completions))
    app.post("/v1/messages", dependencies=[auth])(counted("messages", anthropic.messages))
    app.post("/v1/messages/count_tokens", dependencies=[auth])(_bound(state, anthropic.count_tokens))
    app.post("/v1/responses", dependencies=[auth])(counted("responses", responses.create))
    page_routes(app)
    _lora_routes(app, state, auth)
    app.get("/v1/responses/{response_id}", dependencies=[auth])(_bound(state, responses.retrieve))
    app.delete("/v1/responses/{response_id}", dependencies=[auth])(_bound(state, responses.delete))

    @app.post("/tokenize", dependencies=[auth])
    async def tokenize(request: HTTPRequest) -> Response:
        req = parse(TokenizeRequest, await state.read_body(request))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad(None, "give either prompt or messages")
        tok = model.tokenizer
        if req.prompt is not None:
            prompt: str = req.prompt
            ids = await asyncio.to_thread(tok.encode, prompt, req.add_special_tokens)
        else:
            check_continue(req.continue_final_message, req.add_generation_prompt)
            messages = chat_messages(req.messages)
            ids = await asyncio.to_thread(lambda: model.chat_tokens(
                messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return JSONResponse(out)

    @app.post("/detokenize", dependencies=[auth])
    async def detokenize(request: HTTPRequest) -> Response:
        req = parse(DetokenizeRequest, await state.read_body(request))
        state.check_model(req.model)
        try:
            text = model.tokenizer.decode(req.tokens)
        except SuperSLMError as e:
            e.param = "tokens"  # type: ignore[attr-defined]
            raise
        return JSONResponse({"prompt": text})


def _lora_routes(app: FastAPI, state: ServerState, auth: Any) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters served by name at run time, where
    the server allows it (they read a folder on the server: off unless serve --allow-lora-loading)."""

    async def body(request: HTTPRequest) -> dict[str, Any]:
        if not state.allow_lora_loading:
            raise HTTPException(403, "loading LoRA adapters at run time is off (serve --allow-lora-loading)")
        try:
            data = json.loads(await state.read_body(request))
        except ValueError:
            raise bad(None, "the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise bad(None, "the body must be a JSON object")
        return data

    @app.post("/v1/load_lora_adapter", dependencies=[auth])
    async def load_lora(request: HTTPRequest) -> Response:
        data = await body(request)
        name, folder = data.get("lora_name"), data.get("lora_path")
        await asyncio.to_thread(state.load_adapter, name, folder)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[auth])
    async def unload_lora(request: HTTPRequest) -> Response:
        name = (await body(request)).get("lora_name")
        state.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


#: the chat page's files (serve/static) and their types; nothing else is served from there
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
              "chat.css": "text/css; charset=utf-8"}
#: the page runs its own script and style only, talks to this server only, and is framed by no other page
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                           "base-uri 'none'; form-action 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def page_routes(app: FastAPI) -> None:
    """The chat page at / (static files shipped in the package; public, as it holds no data: its API calls
    carry the key the user types into it)."""
    from importlib.resources import files

    root = files("superslm.serve") / "static"

    def page(name: str) -> Response:
        return Response((root / name).read_bytes(), media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return page("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in PAGE_FILES:
            raise HTTPException(404, "no such file")
        return page(name)


def _bound(state: ServerState, run: Callable[[ServerState, HTTPRequest], Awaitable[Response]]) -> Any:
    async def handler(request: HTTPRequest) -> Response:
        return await run(state, request)

    return handler


def key_ok(headers: Any, expected: bytes) -> bool:
    """Whether a request's headers carry the API key: `Authorization: Bearer <key>`, or Anthropic's
    `x-api-key: <key>` where no Authorization header is sent."""
    given = headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    anthropic_key = headers.get("x-api-key")
    if anthropic_key is not None and not given:
        scheme, token = "bearer", anthropic_key
    # compare_digest takes as long whatever the key's first differing byte
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)


#: what a request without the right key is told
KEY_MESSAGE = "a missing or wrong API key (send Authorization: Bearer <key>, or x-api-key: <key>)"


def _auth(state: ServerState) -> Callable[[HTTPRequest], None]:
    expected = state.api_key.encode() if state.api_key else None

    def check(request: HTTPRequest) -> None:
        if expected is not None and not key_ok(request.headers, expected):
            raise HTTPException(401, KEY_MESSAGE)

    return check


def error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

    @app.exception_handler(SuperSLMError)
    async def superslm_error(request: HTTPRequest, e: SuperSLMError) -> Response:
        return error_json(e.http_status, str(e), e.code, getattr(e, "param", None))

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException) -> Response:
        code = HTTP_CODES.get(e.status_code, "http_error")
        message = e.detail if isinstance(e.detail, str) and e.status_code not in (404, 405) else {
            404: "no such route", 405: "method not allowed"}.get(e.status_code, str(e.detail))
        return error_json(e.status_code, message, code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, e: RequestValidationError) -> Response:
        return error_json(400, "the request is malformed", "invalid_argument")

    @app.exception_handler(Exception)
    async def unexpected(request: HTTPRequest, e: Exception) -> Response:
        # a bug: say so without details (they may hold the input)
        err = InternalError(f"internal error ({type(e).__name__})")
        return error_json(err.http_status, str(err), err.code)
