"""`superslm serve`: the OpenAI-compatible server on uvicorn.

--model takes a language model (GGUF, Hugging Face folder, known name), a sentence-transformers
encoder folder (the server then answers /v1/embeddings) or a cross-encoder folder (/v1/rerank).

Several models (`superslm serve MODEL MODEL ...`, NAME=MODEL to name one, or --config FILE) are served
by one server: each request goes to the model it names, which loads at its first request; --models-max
bounds how many are loaded at once (the least recently used idle one unloads first) and --idle-unload
unloads a model after that many idle seconds.

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

from superslm.memory import freeze_heap


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
    p.add_argument("models_pos", nargs="*", metavar="MODEL",
                   help="the model (same as --model), or several: NAME=MODEL names one (default: its own name)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON or TOML file naming the models: {\"models\": [{\"name\", \"model\", and "
                        "per-model slots, context, kv, speculative, deterministic, device, dtype}], "
                        "\"models_max\", \"idle_unload\"}")
    p.add_argument("--models-max", type=_count(1), default=None,
                   help="with several models: the most loaded at once (default: no limit)")
    p.add_argument("--models-memory", type=float, default=None, metavar="GIB",
                   help="with several models: the GiB their weights may take together; loading one more first unloads "
                        "the least recently used idle ones (default: no limit)")
    p.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                   help="with several models: unload one after this many seconds without a request (default: never)")
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file, a Hugging Face folder, a sentence-transformers encoder or cross-encoder "
                        "folder, or a known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16 (default: a GGUF on the CPU runs its quantized blocks with bf16 "
                        "activations; dense weights are fp32 on the CPU, bf16 on a GPU; either value dequantizes a "
                        "GGUF to dense weights of that type)")
    p.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="a mixture-of-experts model keeps N experts of each block on the device and reads the "
                        "others from host memory when chosen (for a GPU that cannot hold them all)")
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
    p.add_argument("--speculative", "--speculative-config", default=None, type=speculative_arg,
                   metavar="{ngram,mtp,JSON}",
                   help="draft tokens and verify them in one step (same tokens as without): ngram drafts by prompt "
                        "lookup (faster where answers copy their prompt: code edits, quotes, extraction); mtp drafts "
                        "with the model's own multi-token prediction block (Qwen3.5 / Qwen3-Next checkpoints that "
                        "keep it); or a JSON object as vLLM's --speculative-config, e.g. "
                        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (at most 3 for mtp)")
    p.add_argument("--kv", default="auto", choices=["auto", "bf16", "fp16", "fp32", "int8", "k8v4", "k4v8", "k4v4"],
                   help="the KV page format (default auto: the model's dtype while every slot's context fits, else "
                        "the most precise quantized format that fits within +3%% measured perplexity; int8 about "
                        "halves the bytes a token holds, k8v4 (int8 keys, rotated 4-bit values) cuts them ~2.5x; "
                        "quantized pages on the CPU)")
    p.add_argument("--lora", nargs="+", default=[], metavar="NAME=FOLDER",
                   help="PEFT LoRA adapter folders over the model, each served as its own model name")
    p.add_argument("--allow-lora-loading", action="store_true",
                   help="let clients load and unload adapters at run time (/v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter; they name folders on this machine)")
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
        import uvicorn  # noqa: F401 (checked here: the server extra is installed)

        from superslm.serve.app import create_app
        from superslm.serve.guard import is_loopback
    except ImportError as e:
        print(f"superslm serve needs the server extra ({e.name} is missing): pip install 'superslm[serve]'",
              file=sys.stderr)
        return 2
    import superslm
    from superslm.encoders import CrossEncoder, Encoder, model_kind

    given = ([ns.model] if ns.model else []) + list(ns.models_pos or [])
    if ns.config is not None or len(given) > 1:
        if ns.expert_slots is not None:
            print("superslm: error: --expert-slots serves one model (not --config or several)", file=sys.stderr)
            return 2
        return _serve_several(ns, given)
    ns.model = given[0] if given else None
    kind = "decoder" if ns.model is None else model_kind(ns.model)
    loader = {"encoder": Encoder.load, "cross-encoder": CrossEncoder.load}.get(kind, superslm.load)
    if ns.expert_slots is not None and kind != "decoder":
        print("superslm: error: --expert-slots is for mixture-of-experts language models", file=sys.stderr)
        return 2
    extra = {} if ns.expert_slots is None else {"expert_slots": ns.expert_slots}
    model = loader(ns.model, device=ns.device, dtype=ns.dtype, **extra)
    freeze_heap()  # one model, served to the process's end
    if ns.chat_template is not None:
        if not hasattr(model, "use_chat_template"):
            print("superslm: error: --chat-template is for language models, not encoders", file=sys.stderr)
            return 2
        model.use_chat_template(Path(ns.chat_template).read_text(encoding="utf-8"))
    engine_kwargs: dict[str, Any] = {"deterministic": ns.deterministic, "speculative": ns.speculative, "kv": ns.kv}
    lora = {}
    for item in ns.lora:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            print(f"superslm: error: --lora takes NAME=FOLDER, not {item!r}", file=sys.stderr)
            return 2
        lora[name] = folder
    if lora or ns.allow_lora_loading:
        engine_kwargs.update(lora=lora, allow_lora_loading=ns.allow_lora_loading)
    if kind != "decoder":
        given = [f"--{k.replace('_', '-')}" for k, v in engine_kwargs.items() if v not in (False, None, "auto", {})]
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

    _run(app, ns, state.drain)
    return 0


def _run(app: Any, ns: argparse.Namespace, drain: Any) -> None:
    """uvicorn serving `app` until SIGTERM/SIGINT, calling `drain()` as the signal comes."""
    import uvicorn

    from superslm.serve.connections import uvicorn_options

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server that refuses new requests as soon as the signal comes, and exits 0."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            drain()
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


def speculative_arg(text: str) -> str | dict[str, Any]:
    """--speculative's value: "ngram", "mtp", or a JSON object of a Speculative's fields (engine/speculative.py)."""
    import json

    if text in ("ngram", "mtp"):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected ngram, mtp or a JSON object, got {text!r}")
    return value


#: what a config file's model entry may set besides name and model
SPEC_KEYS = ("slots", "context", "kv", "speculative", "deterministic", "device", "dtype", "lora")


def read_settings(path: str, label: str) -> Any:
    """A settings file's data: TOML by its .toml suffix, else JSON; InvalidArgument (prefixed `label`) when it does
    not parse."""
    import json

    from superslm.errors import InvalidArgument

    text = Path(path).read_text(encoding="utf-8")
    try:
        if path.endswith(".toml"):
            import tomllib

            return tomllib.loads(text)
        return json.loads(text)
    except (ValueError, ImportError) as e:
        raise InvalidArgument(f"{label}: not valid {'TOML' if path.endswith('.toml') else 'JSON'} ({e})") from e


def read_config(path: str) -> dict[str, Any]:
    """A --config file (JSON, or TOML by its .toml suffix) as plain data; raises InvalidArgument."""
    from superslm.errors import InvalidArgument

    data = read_settings(path, f"--config {path}")
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise InvalidArgument(f'--config {path}: needs "models", a non-empty list of {{"name", "model"}} entries')
    unknown = set(data) - {"models", "models_max", "idle_unload"}
    if unknown:
        raise InvalidArgument(f"--config {path}: unknown keys {sorted(unknown)}")
    for i, entry in enumerate(data["models"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise InvalidArgument(f'--config {path}: models[{i}] needs "model" (a path or a known name)')
        extra = set(entry) - {"name", "model", *SPEC_KEYS}
        if extra:
            raise InvalidArgument(f"--config {path}: models[{i}]: unknown keys {sorted(extra)}")
    return data


def spec_name(model: str) -> str:
    """The name a model given on the command line is served as: a file's stem, a folder's name, or the
    known name as typed."""
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.name
    return model


def _serve_several(ns: argparse.Namespace, given: list[str]) -> int:
    from superslm.errors import InvalidArgument
    from superslm.serve.guard import is_loopback
    from superslm.serve.router import ModelSpec, Router

    flags = {"slots": ns.slots, "context": ns.context, "kv": ns.kv, "speculative": ns.speculative,
             "deterministic": ns.deterministic, "device": ns.device, "dtype": ns.dtype}
    shared = {k: v for k, v in flags.items() if v is not None}
    specs, models_max, idle = [], ns.models_max, ns.idle_unload
    if ns.config is not None:
        data = read_config(ns.config)
        for entry in data["models"]:
            options = {**shared, **{k: entry[k] for k in SPEC_KEYS if k in entry}}
            specs.append(ModelSpec(entry.get("name") or spec_name(entry["model"]), entry["model"], options))
        models_max = models_max if models_max is not None else data.get("models_max")
        idle = idle if idle is not None else data.get("idle_unload")
    for arg in given:
        name, sep, model = arg.partition("=")
        if not sep or not name or Path(arg).exists():
            name, model = spec_name(arg), arg
        specs.append(ModelSpec(name, model, dict(shared)))
    if ns.served_model_name or ns.chat_template:
        raise InvalidArgument("with several models, name each one NAME=MODEL (or in --config); --served-model-name "
                              "and --chat-template are for one model")
    try:
        memory = None if ns.models_memory is None else int(ns.models_memory * 2**30)
        router = Router(specs, models_max=models_max, idle_unload=idle, memory_budget=memory, api_key=ns.api_key,
                        max_body_bytes=ns.max_body_bytes, max_waiting=ns.max_waiting,
                        allowed_hosts=ns.allowed_hosts or (None if is_loopback(ns.host) else ["*"]),
                        cors_origins=ns.cors_origins)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e
    shown = f"[{ns.host}]" if ":" in ns.host else ns.host
    limits = f", at most {models_max} loaded" if models_max else ""
    limits += f", idle unload after {idle:g} s" if idle else ""
    print(f"superslm serve: {len(specs)} models ({', '.join(s.name for s in specs)}), each loaded at its first "
          f"request{limits}, http://{shown}:{ns.port}/v1", file=sys.stderr, flush=True)

    def drain() -> None:
        router.draining = True

    _run(router, ns, drain)
    return 0
