"""SuperSLM: small language models and sentence encoders, fast and deterministic on any hardware.

    import superslm
    model = superslm.load()          # the default model, or a GGUF path, a HF folder, a known name
    engine = model.engine(slots=8)
    print(engine.complete("The capital of France is", 16))
"""

from superslm import errors
from superslm.devices import set_threads
from superslm.encoders import CrossEncoder, Encoder
from superslm.engine import Completion, Engine, Progress, Request
from superslm.model import Model, load
from superslm.sampling import DampedGreedy, Sampling

__version__ = "0.1.0"

__all__ = [
    "Completion", "CrossEncoder", "DampedGreedy", "Encoder", "Engine", "Model", "Progress", "Request", "Sampling",
    "errors", "load", "set_threads", "__version__",
]
