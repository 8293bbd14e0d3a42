"""`superslm serve`: the OpenAI-compatible server on uvicorn.

--model takes a language model (GGUF, Hugging Face folder, known name), a sentence-transformers
encoder folder (the server then answers /v1/embeddings) or a cross-encoder folder (/v1/rerank).

SIGTERM (or Ctrl-C) drains: /health turns 503 and new requests are refused at once, the listening
socket closes, requests in flight run to their end (at most --drain-timeout seconds, then they are
cancelled), and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any


def _port(text: str) -> int:
    """A TCP port number (argparse's type for --port: an error message, not an OverflowError at bind)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, not {text!r}")
    return port


def _count(least: int) -> Any:
    """argparse's type for a whole number >= least."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"a whole number >= {least}, not {text!r}")
        return n

    return parse


def add_parser(sub: Any) -> None:
    """Register the `serve` subcommand on the CLI's subparsers."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file, a Hugging Face folder, a sentence-transformers encoder or cross-encoder "
                        "folder, or a known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16 (default: a GGUF on the CPU runs its quantized blocks with bf16 "
                        "activations; dense weights are fp32 on the CPU, bf16 on a GPU; either value dequantizes a "
                        "GGUF to dense weights of that type)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads for the kernels (default: the cores this process may use)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's own (a base model has none)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="the port to listen on (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("SUPERSLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(default: $SUPERSLM_API_KEY; none: no key needed)")
    p.add_argument("--slots", "--max-num-seqs", type=int, default=8, dest="slots",
                   help="sequences the engine runs at once (default: 8)")
    p.add_argument("--context", "-c", "--max-model-len", type=int, default=None, dest="context",
                   help="tokens per sequence, prompt and answer (default: the model's, at most 4096)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="allow a context past the positions the model was trained for (with a warning)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients pass as `model` (default: the model's name and --model as given)")
    p.add_argument("--max-waiting", type=_count(0), default=256,
                   help="sequences admitted beyond the slots before requests get 503 (default: 256)")
    p.add_argument("--max-body-bytes", type=_count(1), default=4 << 20,
                   help="larger request bodies get 413 (default: 4 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a SIGTERM waits for requests in flight before cancelling them (default: 30)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers before its connection closes "
                        "(default: 10)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection stays open between requests (default: 5)")
    p.add_argument("--max-connections", type=_count(1), default=None,
                   help="connections served at once; more get 503 (default: 512, or fewer where the "
                        "open-file limit is lower)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="the Host names the server answers to, against DNS rebinding (`*` any, `.example.com` "
                        "with subdomains; default: loopback names when --host is loopback, else any)")
    p.add_argument("--cors-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web pages (e.g. https://app.example) that may call the server from a browser "
                        "(default: none; requests with another Origin get 403)")
    p.add_argument("--deterministic", action="store_true",
                   help="the engine's deterministic mode: a request's tokens and logprobs are the same bits whatever "
                        "else is batched with it (costs speed: docs/determinism.md)")
    p.add_argument("--speculative", default=None, choices=["ngram"],
                   help="draft tokens by prompt lookup and verify them in one step (same tokens as without; faster "
                        "where answers copy their prompt: code edits, quotes, extraction)")
    p.add_argument("--kv", default="auto", choices=["auto", "bf16", "fp16", "fp32", "int8"],
                   help="the KV page format (default auto: the model's dtype; int8 about halves the bytes a token "
                        "holds, on the CPU)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    p.set_defaults(func=cmd_serve)


def _context(model: Any, context: int | None, allow_long: bool = False) -> int | None:
    checked = getattr(model, "checked_context", None)  # encoders have no generation context
    return context if checked is None else checked(context, allow_long)


def startup_line(state: Any, host: str, port: int) -> str:
    """What `serve` says before it listens: the model, its names, the engine's context, slots and KV pages (their
    format when quantized), its modes (deterministic, speculative), an encoder's longest input, the threads and
    the URL."""
    import torch

    names = ", ".join(state.served_names)
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{port}/v1"
    if state.engine is None:
        return (f"superslm serve: {state.kind} {names}, inputs up to {state.max_len} tokens, "
                f"threads {torch.get_num_threads()}, {where}")
    e = state.engine
    kv_mb = (e.kv.k.numel() * e.kv.k.element_size() + e.kv.v.numel() * e.kv.v.element_size()) / 2**20
    fmt = f"{e.kv.format.name} " if e.kv.format.quantized else ""
    modes = "".join([", deterministic" if e.deterministic else "",
                     f", speculative {e.speculator.config.method}" if e.speculator is not None else ""])
    return (f"superslm serve: {names} on {e.model.device} ({str(e.model.dtype).removeprefix('torch.')}), "
            f"context {e.context}, slots {e.slots}, KV {fmt}{e.pool.num_pages} pages of {e.page_size} tokens "
            f"({kv_mb:.0f} MB){modes}, threads {torch.get_num_threads()}, {where}")


def default_names(model_name: str, model_arg: str | None) -> list[str]:
    """The model's own name, then --model as the user typed it (a path or a known name), as vLLM serves it."""
    from superslm.hub import DEFAULT_MODEL

    typed = DEFAULT_MODEL if model_arg is None else model_arg
    return [model_name] if typed == model_name else [model_name, typed]


def cmd_serve(ns: argparse.Namespace) -> int:
    """Load the model, build the app and run uvicorn until SIGTERM/SIGINT."""
    try:
        import uvicorn

        from superslm.serve.app import create_app
        from superslm.serve.connections import uvicorn_options
        from superslm.serve.guard import is_loopback
    except ImportError as e:
        print(f"superslm serve needs the server extra ({e.name} is missing): pip install 'superslm[serve]'",
              file=sys.stderr)
        return 2
    import superslm
    from superslm.encoders import CrossEncoder, Encoder, model_kind

    kind = "decoder" if ns.model is None else model_kind(ns.model)
    loader = {"encoder": Encoder.load, "cross-encoder": CrossEncoder.load}.get(kind, superslm.load)
    model = loader(ns.model, device=ns.device, dtype=ns.dtype)
    if ns.chat_template is not None:
        if not hasattr(model, "use_chat_template"):
            print("superslm: error: --chat-template is for language models, not encoders", file=sys.stderr)
            return 2
        model.use_chat_template(Path(ns.chat_template).read_text(encoding="utf-8"))
    engine_kwargs = {"deterministic": ns.deterministic, "speculative": ns.speculative, "kv": ns.kv}
    if kind != "decoder":
        given = [f"--{k}" for k, v in engine_kwargs.items() if v not in (False, None, "auto")]
        if given:
            print(f"superslm: error: {', '.join(given)} configure a language model's engine, not an {kind}",
                  file=sys.stderr)
            return 2
        engine_kwargs = {}
    names = ns.served_model_name or default_names(model.name, ns.model)
    app = create_app(model, slots=ns.slots, context=_context(model, ns.context, ns.allow_long_context),
                     served_model_name=names,
                     api_key=ns.api_key, max_waiting=ns.max_waiting, max_body_bytes=ns.max_body_bytes,
                     allowed_hosts=ns.allowed_hosts or (None if is_loopback(ns.host) else ["*"]),
                     cors_origins=ns.cors_origins, **engine_kwargs)
    state = app.state.server
    print(startup_line(state, ns.host, ns.port), file=sys.stderr, flush=True)

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server that refuses new requests as soon as the signal comes, and exits 0."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state.drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # as uvicorn's, but a drained shutdown is a clean exit: the signal is not raised again after
            handled = (signal.SIGINT, signal.SIGTERM)
            before = {s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for s, handler in before.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, lifespan="on",
                            timeout_graceful_shutdown=ns.drain_timeout,
                            **uvicorn_options(ns.header_timeout, ns.keep_alive_timeout, ns.max_connections))
    DrainingServer(config).run()
    return 0
