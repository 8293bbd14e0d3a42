"""engine layer: requests, the scheduling rule, the step runner and the Engine API."""

from superslm.engine.engine import Completion, Engine
from superslm.engine.request import Progress, Request

__all__ = ["Completion", "Engine", "Progress", "Request"]
