"""The engine replica: one SuperSLM engine per Ray Serve replica, answering through the server's own app.

Each replica loads the model, builds the app `superslm serve` builds (serve.app.create_app) and runs every
carried request through it (bridge.answer). Ray Serve calls `check_health` every few seconds: a replica whose
engine loop died fails it and is replaced; a healthy one posts its /metrics text to the stats board there, so
the ingress's /metrics shows every replica. On scale-down Ray stops routing to the replica and waits (up to the
deployment's graceful_shutdown_timeout_s) for the requests in flight, streams included, before `__del__`
stops the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from superslm.ray.bridge import Carried, Start, answer
from superslm.ray.stats import board

#: the response header naming the replica that answered
REPLICA_HEADER = b"x-superslm-replica"


class EngineReplica:
    """A Serve deployment class (superslm.ray.app binds it): `spec` holds the model and the create_app options."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        import superslm
        from superslm.serve.app import create_app

        spec = dict(spec)
        threads = spec.pop("threads", None) or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads:
            torch.set_num_threads(threads)
        model = superslm.load(spec.pop("model", None), device=spec.pop("device", None), dtype=spec.pop("dtype", None))
        template = spec.pop("chat_template", None)
        if template is not None:
            model.use_chat_template(template)
        self.board_name = spec.pop("board")
        self.app = create_app(model, **spec)
        self.state = self.app.state.server
        self.state.start()  # no uvicorn lifespan here: the replica starts and stops the engine loop itself
        self.id = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        self._board = board(self.board_name)
        self._post()

    def _post(self) -> None:
        text = self.state.metrics.render(self.state.loop.stats(), self.state.alive)
        self._board.put.remote(self.id, text, time.time(), self.pid)

    async def handle(self, req: Carried | None = None, *,
                     carried: Carried | None = None) -> AsyncIterator[Start | bytes]:
        """The response to one carried request: a Start (with the replica's header), then body chunks. A request
        with routing text comes positionally (the routers read the first argument), any other as `carried`."""
        req = req if req is not None else carried
        if req is None:
            raise TypeError("handle() needs the carried request")
        try:
            async for part in answer(self.app, req):
                if isinstance(part, Start):
                    part.headers.append((REPLICA_HEADER, self.id.encode()))
                yield part
        finally:
            self._post()  # the counters this request moved, posted before the ingress answers its last chunk

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop must run."""
        if not self.state.alive:
            raise RuntimeError(f"replica {self.id}: the engine loop has stopped ({self.state.loop.error!r})")
        self._post()

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is None:
            return
        state.stop()  # Ray has waited for the requests in flight; what is left is cancelled
        try:
            self._board.drop.remote(self.id)
        except Exception:  # the cluster is going down with us
            pass


def deployment_class() -> Any:
    """EngineReplica as a Serve deployment (options are set by superslm.ray.app)."""
    return serve.deployment(EngineReplica, name="SuperSLMEngine")

