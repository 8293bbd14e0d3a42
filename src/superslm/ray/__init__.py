"""ray layer: SuperSLM as a Ray Serve application (scale-out; docs/scale-out.md).

One SuperSLM engine per replica answers the routes `superslm serve` answers (the same app, run in the replica:
bridge.py), behind an ingress that retries a request whose replica died before answering (ingress.py); a
router on Ray Serve's public interface sends a request to the replica most likely to hold its prefix, load
balance first (routers.py). Ray is an optional extra (`pip install 'superslm[ray]'`), imported only when an
application is built; `import superslm.ray` alone costs nothing.

    from superslm.ray import ScaleOut, start
    start(ScaleOut(model="model.gguf", replicas=2))   # a local Ray, Serve on 127.0.0.1:8000
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from superslm.ray.app import ScaleOut, build, start

__all__ = ["ScaleOut", "build", "start"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from superslm.ray import app

        return getattr(app, name)
    raise AttributeError(f"module 'superslm.ray' has no attribute {name!r}")
