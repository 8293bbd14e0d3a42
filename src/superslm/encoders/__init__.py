"""Sentence encoders and cross-encoders (BERT, RoBERTa, XLM-RoBERTa), as sentence-transformers computes them.

    from superslm.encoders import CrossEncoder, Encoder
    enc = Encoder.load("all-minilm-l6-v2")
    vectors = enc.embed_batch(["first text", "second text"])    # Tensor [2, 384]
"""

from pathlib import Path

from superslm.encoders.config import model_kind as _model_kind
from superslm.encoders.cross import CrossEncoder
from superslm.encoders.encoder import Encoder


def model_kind(path_or_name: str | Path) -> str:
    """"encoder", "cross-encoder" or "decoder": which class a model path or known name loads into
    (Encoder, CrossEncoder, or `superslm.load`). Raises ModelNotFound, FormatError."""
    from superslm.hub import resolve_path

    return _model_kind(resolve_path(path_or_name))


__all__ = ["CrossEncoder", "Encoder", "model_kind"]
