"""serve layer: the OpenAI-compatible HTTP server (`superslm serve`, or `create_app` in a program).

FastAPI, uvicorn and pydantic are an optional extra (`pip install superslm[serve]`): they are
imported only when an app is built, so `import superslm.serve` costs nothing.

    from superslm.serve import create_app
    app = create_app(superslm.load("model.gguf"), slots=8)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from superslm.serve.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from superslm.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'superslm.serve' has no attribute {name!r}")
