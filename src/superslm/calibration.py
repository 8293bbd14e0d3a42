"""Calibration text through a dense copy of a model, one layer at a time, for GPTQ (`quant.gptq`).

`superslm convert --format int4 --calibrate [FILE]` quantizes each layer's linears against the second
moments of the inputs they see on real text. The default text is Python's own reference documentation
(`pydoc_data.topics`, English prose and code that every CPython install carries), so it never overlaps
the license text `benchmarks/perplexity.py` measures on. The hidden states of each sequence are kept
between layers ([tokens, hidden] float32), so memory is one dense model plus one layer's statistics.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from superslm.cache.kv import KVCache
from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata
from superslm.memory import available_memory
from superslm.models.parts import LINEAR_NAMES
from superslm.quant.gptq import Calibration

#: calibration tokens by default, in sequences of SEQ tokens
TOKENS = 2048
SEQ = 512
_PAGE = 16


def default_text() -> str:
    """Python's reference documentation topics, in a fixed order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data off
        raise InvalidArgument("this Python has no pydoc_data for the default calibration text: "
                              "pass a text file (--calibrate FILE)") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(calibrate: str | Path | bool) -> tuple[str, str]:
    """(text, name): True or "default" for the default text, else a UTF-8 text file."""
    if calibrate is True or calibrate == "default":
        return default_text(), "pydoc_data.topics"
    path = Path(calibrate)
    try:
        return path.read_text(encoding="utf-8"), path.name
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the calibration text {path}: {e}") from None


def dense_dtype(parameters: int, available: int | None = None) -> str:
    """The dtype of the dense copy calibration runs: float32 where it fits in 70% of the available memory,
    else bfloat16 (the statistics are summed in float64 either way); InvalidArgument when neither fits."""
    available = available_memory() if available is None else available
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        if parameters * size <= 0.7 * available:
            return dtype
    raise InvalidArgument(f"calibration runs a dense copy of the model: {parameters * 2 / 2**30:.1f} GiB in bf16, "
                          f"{available / 2**30:.1f} GiB available; convert without --calibrate")


class LayerCalibrator:
    """Second moments of each layer's linear inputs on calibration text, computed layer by layer with the
    model's own forward pass (dense float32, or bf16 where float32 would not fit; torch modules: the hooks
    see every linear's input)."""

    def __init__(self, path: Path, layers: int, calibrate: str | Path | bool, tokens: int = TOKENS,
                 parameters: int = 0) -> None:
        from superslm.model import load

        text, name = read_text(calibrate)
        dtype = dense_dtype(parameters)
        self.model = load(path, device="cpu", dtype=dtype, quant=None, layers=layers)
        net = self.model.net
        net.fast_decode = False  # the C++ plan would bypass the modules and their hooks
        self._ids = self.model.tokenizer.encode(text, add_special_tokens=False)
        ids = self._ids[:tokens]
        if len(ids) < SEQ // 2:
            raise InvalidArgument(f"the calibration text has {len(ids)} tokens; GPTQ needs at least {SEQ // 2}")
        self.seqs = self._cut(ids)
        self.tokens = sum(len(s) for s in self.seqs)
        self.info: dict[str, Any] = {"method": "gptq", "text": name, "tokens": self.tokens, "dtype": dtype,
                                     "sha256": hashlib.sha256(text.encode()).hexdigest()}
        with torch.no_grad():
            self.h = [net.embed(torch.tensor(s)) for s in self.seqs]
        a = net.arch
        longest = max(len(s) for s in self.seqs)
        self.kv = KVCache(len(net.layers), -(-longest // _PAGE), _PAGE, a.kv_heads, a.head_dim, net.dtype)

    def _cut(self, ids: list[int]) -> list[list[int]]:
        """ids in sequences of SEQ tokens, each after BOS where the model adds one."""
        bos = self.model.tokenizer.bos_id if self.model.tokenizer.add_bos else None
        seqs = [([bos] if bos is not None else []) + ids[i : i + SEQ] for i in range(0, len(ids), SEQ)]
        return [s for s in seqs if len(s) > 1]

    def tuning_seqs(self, steps: int) -> list[list[int]]:
        """steps + 1 sequences of the calibration text from its start (the last one held out by
        `quant.tune.tune_int4`); fewer where the text is shorter (the steps then cycle over them)."""
        return self._cut(self._ids[: (steps + 1) * SEQ])

    def layer(self, i: int) -> dict[str, torch.Tensor | None]:
        """{linear attr: mean x x^T of its inputs} for layer i (ask for layers in order); the hidden states
        then move on to layer i + 1 through the dense layer. (Feeding each layer the quantized layers'
        outputs instead, as the GPTQ paper does, measured worse on SmolLM2: 16.0 vs 15.7 perplexity.)"""
        net = self.model.net
        layer = net.layers[i]
        cal = Calibration()
        with torch.no_grad(), cal.watch({attr: getattr(layer, attr) for attr in LINEAR_NAMES}):
            for j, seq in enumerate(self.seqs):
                n = len(seq)
                meta = AttnMetadata.one_prompt(n, _PAGE)
                self.h[j] = net.run_layers(self.h[j], meta, self.kv.k, self.kv.v, start=i, end=i + 1)
        return {attr: cal.pop(attr) for attr in LINEAR_NAMES}
