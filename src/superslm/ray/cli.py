"""The scale-out commands: `superslm serve --replicas N` (a local Ray) and `superslm ray-deploy CONFIG` (a cluster).

The top-level CLI registers them (`add_parsers`): `--replicas` joins the serve subcommand's options and, when
given, runs the model as N Ray Serve replicas on this machine instead of one uvicorn process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

RAY_MISSING = "needs Ray Serve ({} is missing): pip install 'superslm[ray]'"


def add_parsers(sub: Any) -> None:
    """Add `--replicas` to the serve subcommand (registered before) and the `ray-deploy` subcommand."""
    serve = sub.choices["serve"]
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve the model as N Ray Serve replicas on a local Ray, prefix-aware routing "
                            "(needs superslm[ray]; docs/scale-out.md)")
    single = serve.get_default("func")
    serve.set_defaults(func=lambda ns: cmd_replicas(ns) if ns.replicas is not None else single(ns))
    p = sub.add_parser("ray-deploy", help="deploy a model as a Ray Serve application on an existing Ray cluster",
                       description="Deploy the scale-out application a config file describes (TOML or JSON: "
                                   "model, replicas, slots, router, host, port, address, ...; docs/scale-out.md) on "
                                   "the Ray cluster at its address, and exit; the application keeps running.")
    p.add_argument("config", metavar="CONFIG", help="the config file (.toml, else JSON)")
    p.add_argument("--address", default=None,
                   help="the Ray cluster (ray://head:10001, or auto; default: the config's, else auto)")
    p.set_defaults(func=cmd_ray_deploy)


def _ray_or_none() -> str | None:
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        return e.name or "ray"
    return None


def cmd_replicas(ns: argparse.Namespace) -> int:
    """`superslm serve --replicas N`: a local Ray, the application on --host:--port, until SIGTERM/SIGINT (then
    Serve drains: the replicas finish their requests in flight, at most --drain-timeout seconds)."""
    from superslm.errors import InvalidArgument
    from superslm.ray.app import ScaleOut, start

    missing = _ray_or_none()
    if missing is not None:
        print(f"superslm serve --replicas {RAY_MISSING.format(missing)}", file=sys.stderr)
        return 2
    given = ([ns.model] if ns.model else []) + list(ns.models_pos or [])
    if len(given) > 1 or ns.config is not None or ns.lora or ns.allow_lora_loading:
        raise InvalidArgument("--replicas serves one language model (no --config, several models or --lora)")
    from superslm.serve.guard import is_loopback

    cores = os.cpu_count() or 1
    cfg = ScaleOut(model=given[0] if given else None, replicas=ns.replicas, slots=ns.slots, context=ns.context,
                   kv=ns.kv, speculative=ns.speculative, deterministic=ns.deterministic, device=ns.device,
                   dtype=ns.dtype, served_model_name=ns.served_model_name, chat_template=ns.chat_template,
                   api_key=ns.api_key, max_waiting=ns.max_waiting, max_body_bytes=ns.max_body_bytes,
                   allowed_hosts=ns.allowed_hosts or (None if is_loopback(ns.host) else ["*"]),
                   cors_origins=ns.cors_origins, num_cpus=max(1, cores // max(1, ns.replicas)), threads=ns.threads,
                   drain_timeout=ns.drain_timeout, host=ns.host, port=ns.port)
    cfg.check()
    stop = threading.Event()

    def catch() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda *_: stop.set())

    catch()  # before Ray starts: a signal while it deploys still drains
    start(cfg, num_cpus=max(cores, ns.replicas), object_store_bytes=256 << 20)
    catch()  # again: ray.init installs its own SIGTERM handler, which exits without draining
    shown = f"[{ns.host}]" if ":" in ns.host else ns.host
    print(f"superslm serve: {ns.replicas} replicas of {cfg.model or 'the default model'} on a local Ray, "
          f"router {cfg.router}, http://{shown}:{ns.port}/v1", file=sys.stderr, flush=True)
    stop.wait()
    from ray import serve

    serve.shutdown()  # each replica drains (graceful_shutdown_timeout_s = --drain-timeout)
    return 0


def cmd_ray_deploy(ns: argparse.Namespace) -> int:
    """`superslm ray-deploy CONFIG`: the application on an existing cluster; returns once it is running."""
    from superslm.ray.app import read_config, start

    missing = _ray_or_none()
    if missing is not None:
        print(f"superslm ray-deploy {RAY_MISSING.format(missing)}", file=sys.stderr)
        return 2
    cfg, address = read_config(ns.config)
    start(cfg, address=ns.address or address or "auto")
    print(f"superslm ray-deploy: {cfg.name} ({cfg.replicas} replicas of {cfg.model}, router {cfg.router}) is "
          f"running; Serve listens on {cfg.host}:{cfg.port}{cfg.route_prefix}", file=sys.stderr, flush=True)
    return 0
