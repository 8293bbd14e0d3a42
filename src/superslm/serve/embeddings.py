"""The encoder endpoints: POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank (vLLM's, Jina's, Cohere's).

Encoder calls are CPU-bound, so they never run on the event loop: one worker thread runs them all,
one at a time (two would only fight over the same cores). Texts are tokenized per request (a request
too long is refused alone), then the embedding requests that waited together run as one
`Encoder.embed_tokens` call, which sorts and packs them into batches of `BATCH`. Reranking runs
`CrossEncoder.rank` per request. A decoder model embeds through `Encoder.from_model` (last-token
pooling, L2-normalized), on this worker too: the net's forward pass holds no state, so it may run
beside the engine thread.

This module needs no web framework beyond the request and response types.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from superslm.errors import InternalError, QueueFull, SuperSLMError, UnsupportedModel
from superslm.serve.protocol import EmbeddingRequest, RerankRequest, bad, parse
from superslm.serve.worker import ServiceThread

if TYPE_CHECKING:
    import torch

    from superslm.encoders import Encoder
    from superslm.serve.app import ServerState

log = logging.getLogger("superslm.serve")

#: texts per forward pass
BATCH = 32
#: most inputs per embeddings request (OpenAI's limit), and documents per rerank request
MAX_INPUTS = 2048
KIND_WORDS = {"decoder": "a language model", "encoder": "an embedding model", "cross-encoder": "a cross-encoder"}
KIND_ROUTES = {
    "decoder": "/v1/completions, /v1/chat/completions and /v1/embeddings",
    "encoder": "/v1/embeddings",
    "cross-encoder": "/v1/rerank",
}


def wrong_kind(kind: str, name: str, route: str, needs: str) -> UnsupportedModel:
    """The 400 of a route the served model cannot answer (param `model`)."""
    e = UnsupportedModel(
        f"wrong model kind: {route} needs {needs}; {name!r} is {KIND_WORDS[kind]} (this server answers "
        f"{KIND_ROUTES[kind]})"
    )
    e.param = "model"  # type: ignore[attr-defined]
    return e


# --- the worker thread ----------------------------------------------------------------------------


@dataclass
class _Job:
    """One request's work: an embedding (texts or token ids) or any other call (`run`)."""

    run: Callable[[], Any] | None = None
    encoder: Encoder | None = None
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    truncate: bool = False
    dimensions: int | None = None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class EncoderWorker(ServiceThread):
    """One thread that runs every encoder call; `submit` may be called from any event loop.
    `drain` refuses new work while what is queued still runs; `stop` runs what is queued, then ends."""

    thread_name = "superslm-encoder"

    def __init__(self, max_waiting: int, batch: int = BATCH) -> None:
        super().__init__()
        self.capacity = max(1, max_waiting)
        self.batch = batch
        self._jobs: list[_Job] = []  # guarded by _lock
        self._running = 0  # jobs taken by the thread and not yet answered (guarded by _lock)

    async def submit(self, job: _Job) -> Any:
        """Queue `job` and wait for its result; QueueFull when full or draining."""
        if self._thread is None:  # an app used without its lifespan (some test clients skip it)
            self.start()
        with self._lock:
            if not self.alive:
                raise InternalError("the encoder worker has stopped")
            if self._draining:
                raise QueueFull("the server is shutting down")
            if len(self._jobs) + self._running >= self.capacity:
                raise QueueFull(f"the server is full ({self.capacity} requests in flight); retry later")
            self._jobs.append(job)
            self._wake.notify()
        return await asyncio.wrap_future(job.future)

    def _run(self) -> None:
        jobs: list[_Job] = []
        try:
            while True:
                with self._lock:
                    while not (self._jobs or self._stopping):
                        self._wake.wait()
                    jobs, self._jobs = self._jobs, []
                    self._running = len(jobs)
                    if not jobs:
                        return
                # a job whose caller went away is dropped before it runs
                jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
                self._embed([j for j in jobs if j.run is None])
                for j in jobs:
                    if j.run is not None:
                        _settle(j, j.run)
                with self._lock:
                    self._running = 0
        except BaseException as e:  # a bug: fail what was taken and what waits, report dead
            log.exception("the encoder worker died")
            self.error = e
            with self._lock:
                left, self._jobs = self._jobs, []
            for j in [*jobs, *left]:
                if not j.future.done() and (j.future.running() or j.future.set_running_or_notify_cancel()):
                    j.future.set_exception(InternalError(f"the encoder worker stopped: {type(e).__name__}"))

    def _embed(self, jobs: list[_Job]) -> None:
        """Tokenize each job alone (its own errors), then run them all as one embed_tokens call."""
        ready: list[tuple[_Job, list[list[int]]]] = []
        for j in jobs:
            enc = j.encoder
            assert enc is not None
            try:
                ids = enc.tokenize(j.texts, j.truncate) if j.texts is not None else enc.check_tokens(j.ids, j.truncate)
            except Exception as e:
                j.future.set_exception(_public(e))
                continue
            ready.append((j, ids))
        groups: dict[int, list[tuple[_Job, list[list[int]]]]] = {}
        for item in ready:
            groups.setdefault(id(item[0].encoder), []).append(item)
        for group in groups.values():
            self._embed_group(group)

    def _embed_group(self, group: list[tuple[_Job, list[list[int]]]]) -> None:
        enc = group[0][0].encoder
        assert enc is not None
        try:
            out = enc.embed_tokens([s for _, ids in group for s in ids], batch=self.batch)
        except Exception:
            for j, ids in group:  # each alone, so that only the one at fault fails
                _settle(j, _alone, enc, ids, j.dimensions, self.batch)
            return
        start = 0
        for j, ids in group:
            rows = out[start : start + len(ids)]
            start += len(ids)
            _settle(j, _cut, enc, rows, j.dimensions, ids)


def _alone(enc: Encoder, ids: list[list[int]], dimensions: int | None, batch: int) -> tuple[Any, int]:
    return enc.embed_tokens(ids, batch=batch, dimensions=dimensions), sum(map(len, ids))


def _cut(enc: Encoder, rows: torch.Tensor, dimensions: int | None, ids: list[list[int]]) -> tuple[Any, int]:
    return enc.truncate_dim(rows, dimensions), sum(map(len, ids))


def _public(e: Exception) -> SuperSLMError:
    """A SuperSLM error as it is; anything else (a bug) as an InternalError that names only its type."""
    if isinstance(e, SuperSLMError):
        return e
    log.error("an encoder call failed", exc_info=e)
    return InternalError(f"the encoder call failed ({type(e).__name__})")


def _settle(job: _Job, run: Callable[..., Any], *args: Any) -> None:
    try:
        job.future.set_result(run(*args))
    except Exception as e:
        job.future.set_exception(_public(e))


# --- the request helpers --------------------------------------------------------------------------


def truncation(req: EmbeddingRequest | RerankRequest, limit: int) -> bool:
    """Whether over-long inputs are cut to the model's limit: `truncate`, or vLLM's truncate_prompt_tokens,
    of which only -1 (the model's limit; `limit` itself is accepted too) is supported."""
    t = req.truncate_prompt_tokens
    if t is not None and t not in (-1, limit):
        raise bad("truncate_prompt_tokens",
                  f"truncate_prompt_tokens: only -1 (cut to the model's limit, {limit} tokens) is supported")
    return req.truncate or t is not None


def embedding_inputs(value: str | list[str] | list[int] | list[list[int]]) -> tuple[list[str] | None, Any]:
    """(texts, None) or (None, token id lists) of an `input`; empty inputs are a 400."""
    items: list[Any] = [value] if isinstance(value, str) else list(value)
    if not items:
        raise bad("input", "input: must not be empty")
    if len(items) > MAX_INPUTS:
        raise bad("input", f"input: at most {MAX_INPUTS} inputs per request")
    if isinstance(items[0], int):  # one token id list
        return None, [items]
    for i, item in enumerate(items):
        if not item:
            raise bad("input", f"input[{i}]: must not be empty")
    return (items, None) if isinstance(items[0], str) else (None, items)


def _with_param(e: SuperSLMError, param: str) -> SuperSLMError:
    if getattr(e, "param", None) is None:
        e.param = param  # type: ignore[attr-defined]
    return e


def _vector(v: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


async def embeddings(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/embeddings."""
    req = parse(EmbeddingRequest, await state.read_body(request))
    name = state.check_model(req.model)
    enc = state.embedder()
    if req.encoding_format not in ("float", "base64"):
        raise bad("encoding_format", "encoding_format: must be 'float' or 'base64'")
    if req.dimensions is not None and not 1 <= req.dimensions <= enc.dim:
        raise bad("dimensions", f"dimensions: must be from 1 to {enc.dim} for this model, got {req.dimensions}")
    truncate = truncation(req, enc.max_seq_length)
    texts, ids = embedding_inputs(req.input)
    job = _Job(encoder=enc, texts=texts, ids=ids, truncate=truncate, dimensions=req.dimensions)
    try:
        vectors, tokens = await state.worker.submit(job)
    except SuperSLMError as e:
        raise _with_param(e, "input") from None
    data = [{"object": "embedding", "index": i, "embedding": _vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    state.metrics.on_encoded("embeddings", len(data), tokens)
    state.metrics.on_request("embeddings", "success")
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def documents(docs: Sequence[str | dict[str, Any]]) -> list[str]:
    """The texts of `documents`: strings or {"text": str} objects."""
    if not docs:
        raise bad("documents", "documents: must not be empty")
    if len(docs) > MAX_INPUTS:
        raise bad("documents", f"documents: at most {MAX_INPUTS} documents per request")
    out = []
    for i, d in enumerate(docs):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise bad("documents", f"documents[{i}]: must be a string or an object with a string 'text'")
        out.append(text)
    return out


async def rerank(state: ServerState, request: HTTPRequest) -> Response:
    """POST /v1/rerank, /rerank, /v2/rerank."""
    req = parse(RerankRequest, await state.read_body(request))
    name = state.check_model(req.model)
    ce = state.reranker()
    texts = documents(req.documents)
    if req.top_n is not None and req.top_n < 1:
        raise bad("top_n", f"top_n: must be at least 1, got {req.top_n}")
    truncate = truncation(req, ce.max_seq_length)

    def run() -> tuple[list[tuple[int, float]], int]:
        tokens = sum(len(s) for s in ce.tokenize(req.query, texts, truncate))
        return ce.rank(req.query, texts, top=req.top_n, batch=BATCH, truncate=truncate), tokens

    try:
        ranked, tokens = await state.worker.submit(_Job(run=run))
    except SuperSLMError as e:
        raise _with_param(e, "documents") from None
    results = []
    for index, score in ranked:
        item: dict[str, Any] = {"index": index, "relevance_score": score}
        if req.return_documents:
            item["document"] = {"text": texts[index]}
        results.append(item)
    state.metrics.on_encoded("rerank", len(texts), tokens)
    state.metrics.on_request("rerank", "success")
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                         "usage": {"total_tokens": tokens}})


def refuse(route: str, needs: str) -> Callable[[ServerState, HTTPRequest], Any]:
    """A handler for a route this server's model kind cannot answer: 400 wrong model kind."""

    async def handler(state: ServerState, request: HTTPRequest) -> Response:
        await state.read_body(request)
        raise wrong_kind(state.kind, state.served_names[0], route, needs)

    return handler
