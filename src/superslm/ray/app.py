"""The Ray Serve application: N engine replicas behind one ingress, and the ways to start it.

    from superslm.ray import ScaleOut, build
    app = build(ScaleOut(model="smollm2-135m-instruct", replicas=2, slots=4))
    ray.serve.run(app, name="superslm", route_prefix="/")

`run_local` is `superslm serve --replicas N` (a Ray of its own on this machine, until SIGTERM); `deploy` is
`superslm ray-deploy CONFIG` (an existing cluster; the application stays after the command exits).
`builder` is the import path for Ray's own CLI: `serve run superslm.ray.app:builder model=... replicas=2`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from superslm.errors import InvalidArgument

#: routers by the name ScaleOut.router takes (None: Ray's default, power of two choices)
ROUTERS = {"prefix": "superslm.ray.routers:PrefixAffinityRouter",
           "round-robin": "superslm.ray.routers:RoundRobinRouter", "pow2": None}
#: the create_app options a replica takes from ScaleOut
APP_KEYS = ("slots", "context", "served_model_name", "api_key", "max_waiting", "max_body_bytes", "allowed_hosts",
            "cors_origins", "kv", "speculative", "deterministic")


@dataclass
class ScaleOut:
    """What a scale-out deployment runs: the model and engine (as `superslm serve` takes them), the replicas
    and their resources, the router, and Ray Serve's HTTP and shutdown settings."""

    model: str | None = None
    replicas: int = 2
    slots: int = 8
    context: int | None = None
    kv: str = "auto"
    speculative: str | None = None
    deterministic: bool = False
    device: str | None = None
    dtype: str | None = None
    served_model_name: list[str] | None = None
    chat_template: str | None = None
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    allowed_hosts: list[str] | None = None
    cors_origins: list[str] = field(default_factory=list)
    #: CPUs (and GPUs) each replica reserves; its torch threads default to its CPUs
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    #: "prefix" (load balance first, then prefix affinity), "round-robin" or "pow2" (Ray's default)
    router: str = "prefix"
    #: in-flight requests a replica may have beyond the least loaded and still win a request by its prefix
    imbalanced_threshold: int = 2
    #: requests a replica takes at once (default: twice its slots); Ray queues the rest at the router
    max_ongoing_requests: int | None = None
    #: seconds a replica being removed waits for its requests in flight (streams included)
    drain_timeout: float = 30.0
    health_check_period_s: float = 5.0
    #: tries on another replica for a request whose replica died before it answered anything
    retries: int = 2
    name: str = "superslm"
    route_prefix: str = "/"
    host: str = "127.0.0.1"
    port: int = 8000

    def check(self) -> None:
        """InvalidArgument for a setting out of range."""
        if self.replicas < 1:
            raise InvalidArgument(f"replicas: at least 1, not {self.replicas}")
        if self.router not in ROUTERS:
            raise InvalidArgument(f"router: one of {sorted(ROUTERS)}, not {self.router!r}")
        if self.slots < 1:
            raise InvalidArgument(f"slots: at least 1, not {self.slots}")
        if self.retries < 0 or self.drain_timeout < 0:
            raise InvalidArgument("retries and drain_timeout: zero or more")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> ScaleOut:
        """A ScaleOut from plain data (a config file's), refusing keys it does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"address"})
        if unknown:
            raise InvalidArgument(f"{where}: unknown keys {unknown} (known: {sorted(known | {'address'})})")
        try:
            out = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise InvalidArgument(f"{where}: {e}") from e
        out.check()
        return out


def read_config(path: str) -> tuple[ScaleOut, str | None]:
    """A `ray-deploy` config file (TOML by its .toml suffix, else JSON): the ScaleOut and the cluster address."""
    from superslm.serve.cli import read_settings

    data = read_settings(path, path)
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: needs a table of settings")
    address = data.get("address")
    if address is not None and not isinstance(address, str):
        raise InvalidArgument(f"{path}: address: a Ray address such as ray://head:10001 or auto")
    return ScaleOut.from_dict(data, path), address


def replica_spec(cfg: ScaleOut, board_name: str) -> dict[str, Any]:
    """What each replica's EngineReplica gets: the model, the create_app options, its threads."""
    spec: dict[str, Any] = {k: getattr(cfg, k) for k in APP_KEYS}
    spec.update(model=cfg.model, device=cfg.device, dtype=cfg.dtype, board=board_name,
                threads=cfg.threads or max(1, int(cfg.num_cpus)))
    if cfg.chat_template is not None:
        spec["chat_template"] = Path(cfg.chat_template).read_text(encoding="utf-8")
    return spec


def build(cfg: ScaleOut) -> Any:
    """The bound Serve application of `cfg` (serve.run it)."""
    from ray.serve.config import RequestRouterConfig

    from superslm.ray import ingress, replica

    cfg.check()
    board_name = f"superslm-stats-{cfg.name}"
    options: dict[str, Any] = {
        "num_replicas": cfg.replicas,
        "max_ongoing_requests": cfg.max_ongoing_requests or 2 * cfg.slots,
        "ray_actor_options": {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
        "graceful_shutdown_timeout_s": cfg.drain_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": cfg.health_check_period_s,
    }
    router = ROUTERS[cfg.router]
    if router is not None:
        kwargs = {"imbalanced_threshold": cfg.imbalanced_threshold} if cfg.router == "prefix" else {}
        options["request_router_config"] = RequestRouterConfig(request_router_class=router,
                                                               request_router_kwargs=kwargs)
    engine = replica.deployment_class().options(**options).bind(replica_spec(cfg, board_name))
    entry = ingress.deployment_class().options(num_replicas=1, ray_actor_options={"num_cpus": 0},
                                               max_ongoing_requests=100_000)
    return entry.bind(engine, board_name, cfg.api_key, cfg.max_body_bytes, cfg.retries)


def builder(args: dict[str, str]) -> Any:
    """Ray's application builder (`serve run superslm.ray.app:builder model=PATH replicas=2 ...`): every value
    comes as text and is read as JSON where it parses (numbers, booleans, lists), else kept as text."""
    data: dict[str, Any] = {}
    for k, v in args.items():
        try:
            data[k] = json.loads(v) if isinstance(v, str) else v
        except ValueError:
            data[k] = v
    return build(ScaleOut.from_dict(data, "serve run arguments"))


def start(cfg: ScaleOut, address: str | None = None, num_cpus: int | None = None,
          object_store_bytes: int | None = None) -> Any:
    """Connect to Ray (`address`; None: a new local one, with `num_cpus` and the object store given), start
    Serve's HTTP proxy on cfg.host:cfg.port and run the application; returns its ingress handle."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=num_cpus, object_store_memory=object_store_bytes, include_dashboard=False,
                     configure_logging=False)
        else:
            ray.init(address=address, configure_logging=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    return serve.run(build(cfg), name=cfg.name, route_prefix=cfg.route_prefix)
