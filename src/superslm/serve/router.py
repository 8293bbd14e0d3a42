"""Several models behind one server: each request goes to the model its body names.

`Router` is an ASGI app in front of one `create_app` app per model (a language model, an encoder or a
cross-encoder, each with its own engine or worker, settings and metrics). A model loads at its first request
and stays loaded while it is used; when `models_max` are loaded, loading another first unloads the least
recently used idle one (a request finds every loaded model busy: 503), and `idle_unload` seconds without a
request unload a model on their own. The router answers `/v1/models` (every model, with its status),
`/health`, `/metrics` (every loaded model's, labelled `model`) and the chat page; every other request is
handed whole to its model's app: a POST by the `model` of its JSON body (none: the first model), a stored
response by the model that stored it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from superslm.errors import InternalError, ModelNotFound, QueueFull, SuperSLMError
from superslm.serve import anthropic
from superslm.serve.app import KEY_MESSAGE, error_handlers, error_json, key_ok, page_routes
from superslm.serve.guard import BrowserGuard, HostRules

log = logging.getLogger("superslm.serve")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the paths the router answers itself (every model's), not handed to a model's app
OWN_PATHS = ("/", "/health", "/metrics", "/v1/models")


@dataclass
class ModelSpec:
    """One served model: the name requests give, what to load (a path or a known name), and its settings
    (`create_app` keywords: slots, context, kv, speculative, deterministic, ...; `device`, `dtype` for loading)."""

    name: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Hosted:
    spec: ModelSpec
    app: Any = None  # its FastAPI app while loaded
    in_flight: int = 0
    last_used: float = 0.0
    loaded_at: float = 0.0
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)


def load_spec(spec: ModelSpec, server: dict[str, Any]) -> Any:
    """The app serving `spec` (loads its weights): `server` holds the keywords every model shares."""
    import superslm
    from superslm.encoders import CrossEncoder, Encoder, model_kind
    from superslm.serve.app import create_app

    options = dict(spec.options)
    device, dtype = options.pop("device", None), options.pop("dtype", None)
    kind = model_kind(spec.model)
    loader = {"encoder": Encoder.load, "cross-encoder": CrossEncoder.load}.get(kind, superslm.load)
    model = loader(spec.model, device=device, dtype=dtype)
    if kind != "decoder":  # the engine settings are a language model's
        options = {k: v for k, v in options.items() if k not in ENGINE_KEYS}
    return create_app(model, served_model_name=[spec.name], **server, **options)


#: settings only a language model's engine takes
ENGINE_KEYS = ("slots", "context", "kv", "speculative", "deterministic", "kv_budget", "page_size", "lora")


class Router:
    """The ASGI app serving `specs` (names must differ). `loader(spec)` builds one model's app (default:
    `load_spec` with the shared keywords); `models_max`: most models loaded at once (None: no limit);
    `idle_unload`: seconds without a request before a model unloads (None: never); `memory_budget`: bytes the
    loaded models' weights may take together (each counted as its files on disk; a model larger than the budget
    still loads, alone)."""

    def __init__(self, specs: Sequence[ModelSpec], *, models_max: int | None = None, idle_unload: float | None = None,
                 memory_budget: int | None = None,
                 api_key: str | None = None, max_body_bytes: int = 4 << 20, max_waiting: int = 256,
                 allowed_hosts: Iterable[str] | None = None, cors_origins: Iterable[str] = (),
                 loader: Callable[[ModelSpec], Any] | None = None) -> None:
        if not specs:
            raise ValueError("give at least one model")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must differ: {names}")
        if models_max is not None and models_max < 1:
            raise ValueError(f"models_max must be at least 1, got {models_max}")
        self.hosted = {s.name: _Hosted(s) for s in specs}
        self.first = names[0]
        self.models_max, self.idle_unload, self.memory_budget = models_max, idle_unload, memory_budget
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        shared = {"api_key": api_key, "max_body_bytes": max_body_bytes, "max_waiting": max_waiting,
                  "allowed_hosts": allowed_hosts, "cors_origins": cors_origins}
        self.loader = loader or (lambda spec: load_spec(spec, shared))
        self.created = int(time.time())
        self.draining = False
        self._room = asyncio.Lock()  # one load or unload decision at a time keeps the count bounded
        control = self._control()
        cors = [cors_origins] if isinstance(cors_origins, str) else list(cors_origins)
        hosts = [allowed_hosts] if isinstance(allowed_hosts, str) else allowed_hosts
        self._control_app = control
        inner: ASGIApp = self._dispatch
        if cors:
            from starlette.middleware.cors import CORSMiddleware

            inner = CORSMiddleware(inner, allow_origins=cors, allow_methods=["GET", "POST", "DELETE"],
                                   allow_headers=["authorization", "content-type", "x-api-key"])
        # as one model's app: a refused Host or Origin reaches nothing, Anthropic's routes answer in its shape
        self.app: ASGIApp = anthropic.AnthropicErrors(BrowserGuard(inner, rules=HostRules(hosts, cors),
                                                                   error=error_json))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    # --- the router's own routes ------------------------------------------------------------------

    def _control(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            reaper = asyncio.create_task(self._reap()) if self.idle_unload is not None else None
            try:
                yield
            finally:
                self.draining = True
                if reaper is not None:
                    reaper.cancel()
                for hosted in self.hosted.values():
                    await self._unload(hosted)

        app = FastAPI(title="SuperSLM", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        error_handlers(app)
        expected = self.api_key.encode() if self.api_key else None

        def auth(request: HTTPRequest) -> None:
            if expected is not None and not key_ok(request.headers, expected):
                raise HTTPException(401, KEY_MESSAGE)

        need_key = [Depends(auth)]

        @app.get("/health")
        async def health() -> Response:
            if self.draining:
                return error_json(503, "the server is shutting down", "shutting_down")
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models", dependencies=need_key)
        async def models() -> Response:
            cards = [self._card(h) for h in self.hosted.values()]
            for h in self.hosted.values():  # the adapters loaded models serve
                if h.app is not None:
                    cards += [{"id": n, "object": "model", "created": self.created, "owned_by": "superslm",
                               "root": folder, "parent": h.spec.name, "status": {"value": "loaded"}}
                              for n, (_, folder) in h.app.state.server.adapters.items()]
            return JSONResponse({"object": "list", "data": cards})

        @app.get("/v1/models/{name:path}", dependencies=need_key)
        async def model_card(name: str) -> Response:
            return JSONResponse(self._card(self._named(name)))

        @app.get("/metrics", dependencies=need_key)
        async def metrics() -> Response:
            return PlainTextResponse(self._metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

        page_routes(app)
        return app

    def _card(self, hosted: _Hosted) -> dict[str, Any]:
        card: dict[str, Any] = {"id": hosted.spec.name, "object": "model", "created": self.created,
                                "owned_by": "superslm", "status": {"value": "loaded" if hosted.app else "unloaded"}}
        if hosted.app is not None:
            card["max_model_len"] = hosted.app.state.server.max_len
        return card

    def _named(self, name: Any) -> _Hosted:
        if name is None:
            return self.hosted[self.first]
        hosted = self.hosted.get(name) if isinstance(name, str) else None
        if hosted is None and isinstance(name, str):  # a LoRA adapter a loaded model serves
            hosted = next((h for h in self.hosted.values() if h.app is not None
                           and name in h.app.state.server.adapters), None)
        if hosted is None:
            e = ModelNotFound(f"the model {str(name)[:100]!r} does not exist; this server serves "
                              f"{list(self.hosted)}")
            e.param = "model"  # type: ignore[attr-defined]
            raise e
        return hosted

    def _metrics(self) -> str:
        """Every loaded model's scrape, each sample labelled with its model; one HELP and TYPE per family."""
        families: dict[str, list[str]] = {}
        order: list[str] = []
        loaded = 0
        for hosted in self.hosted.values():
            if hosted.app is None:
                continue
            loaded += 1
            state = hosted.app.state.server
            text = state.metrics.render(state.loop.stats() if state.loop is not None else None, state.alive)
            family = ""
            for line in text.splitlines():
                if line.startswith("# "):
                    family = line.split(" ", 3)[2]
                    if family not in families:
                        families[family] = []
                        order.append(family)
                    if len(families[family]) < 2 and line not in families[family]:
                        families[family].append(line)
                elif line:
                    families[family].append(_labelled(line, hosted.spec.name))
        name = "superslm_models_loaded"
        lines = [f"# HELP {name} Models loaded now (of those the server names).", f"# TYPE {name} gauge",
                 f"{name} {loaded}"]
        for family in order:
            lines.extend(families[family])
        return "\n".join(lines) + "\n"

    # --- handing requests to a model --------------------------------------------------------------

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan: the router's own
            await self._control_app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in OWN_PATHS or path.startswith(("/v1/models/", "/static/")):
            await self._control_app(scope, receive, send)
            return
        try:
            if self.api_key and not key_ok(_headers(scope), self.api_key.encode()):
                # checked here too: no model loads for a request without the key
                raise _Refusal(401, KEY_MESSAGE, "invalid_api_key")
            body, receive = await self._body(scope, receive)
            hosted = self._owner(scope, path, body)
            app = await self._acquire(hosted)
        except _Refusal as r:
            await error_json(r.status, r.message, r.code)(scope, receive, send)
            return
        except SuperSLMError as e:
            await error_json(e.http_status, str(e), e.code, getattr(e, "param", None))(scope, receive, send)
            return
        try:
            await app(scope, receive, send)
        finally:
            hosted.in_flight -= 1
            hosted.last_used = time.monotonic()

    async def _body(self, scope: Scope, receive: Receive) -> tuple[bytes, Receive]:
        """A POST's whole body (at most max_body_bytes), and a receive that hands it over again."""
        if scope.get("method") != "POST":
            return b"", receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refusal(400, "the client went away", "client_gone")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refusal(413, f"the body is larger than {self.max_body_bytes} bytes", "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        return body, replay

    def _owner(self, scope: Scope, path: str, body: bytes) -> _Hosted:
        """The model a request goes to."""
        if path.startswith("/v1/responses/"):  # a stored response: the model that stored it
            response_id = path.removeprefix("/v1/responses/")
            for hosted in self.hosted.values():
                store = getattr(hosted.app.state.server, "responses", None) if hosted.app is not None else None
                if store is not None and store.has(response_id):
                    return hosted
            return self.hosted[self.first]  # its app answers the 404
        name = None
        if body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None  # the model's app answers the malformed body
            if isinstance(data, dict):
                name = data.get("model")
        return self._named(name)

    async def _acquire(self, hosted: _Hosted) -> Any:
        """`hosted`'s app, loaded if need be, with one more request in flight."""
        if hosted.app is None:
            async with hosted.loading:
                if hosted.app is None:
                    if self.draining:
                        raise QueueFull("the server is shutting down")
                    async with self._room:
                        await self._make_room(hosted)
                        hosted.in_flight += 1  # held while it loads: no one unloads it before its request runs
                        try:
                            app = await asyncio.to_thread(self.loader, hosted.spec)
                        except SuperSLMError:
                            hosted.in_flight -= 1
                            raise
                        except Exception as e:  # a bug below: say so without details
                            hosted.in_flight -= 1
                            log.exception("loading %s failed", hosted.spec.name)
                            raise InternalError(f"loading the model failed ({type(e).__name__})") from e
                        app.state.server.start()
                        hosted.app, hosted.loaded_at = app, time.monotonic()
                        hosted.last_used = hosted.loaded_at
                        log.info("loaded %s", hosted.spec.name)
                        return app
        hosted.in_flight += 1
        return hosted.app

    async def _make_room(self, coming: _Hosted) -> None:
        """Unload least recently used idle models until `coming` fits under models_max and memory_budget."""
        def over() -> bool:
            loaded = [h for h in self.hosted.values() if h.app is not None]
            if self.models_max is not None and len(loaded) >= self.models_max:
                return True
            if self.memory_budget is None:
                return False
            return bool(loaded) and sum(map(_weight_bytes, loaded)) + _weight_bytes(coming) > self.memory_budget

        while over():
            idle = [h for h in self.hosted.values() if h.app is not None and h.in_flight == 0]
            if not idle:
                raise QueueFull("every loaded model is busy and another does not fit beside them; try again when "
                                "one is idle")
            await self._unload(min(idle, key=lambda h: h.last_used))

    async def _unload(self, hosted: _Hosted) -> None:
        app, hosted.app = hosted.app, None
        if app is not None:
            await asyncio.to_thread(app.state.server.stop)
            log.info("unloaded %s", hosted.spec.name)

    async def _reap(self) -> None:
        """Unload the models idle for idle_unload seconds, checking a few times per period."""
        assert self.idle_unload is not None
        period = min(max(self.idle_unload / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for hosted in self.hosted.values():
                if hosted.app is not None and hosted.in_flight == 0 and now - hosted.last_used >= self.idle_unload:
                    async with self._room:
                        if hosted.app is not None and hosted.in_flight == 0:
                            await self._unload(hosted)


def _weight_bytes(hosted: _Hosted) -> int:
    """A model's weights as its files on disk (a GGUF file, or a folder's files; a known name: its cached file)."""
    from pathlib import Path

    path = Path(hosted.spec.model)
    if not path.exists():
        try:
            from superslm.hub import fetch

            path = fetch(hosted.spec.model, progress=False)
        except Exception:  # an unknown name fails at load with its own error
            return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class _Refusal(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _labelled(sample: str, model: str) -> str:
    """A sample line with a `model` label added (vLLM's families carry `model_name` already)."""
    name_labels, _, value = sample.rpartition(" ")
    if "model_name=" in name_labels:
        return sample
    label = 'model="' + model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if name_labels.endswith("}"):
        return f"{name_labels[:-1]},{label}}} {value}"
    return f"{name_labels}{{{label}}} {value}"
