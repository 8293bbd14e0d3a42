"""Sentence encoders and cross-encoders (BERT, RoBERTa, XLM-RoBERTa), as sentence-transformers computes them.

    from superslm.encoders import CrossEncoder, Encoder
    enc = Encoder.load("all-minilm-l6-v2")
    vectors = enc.embed_batch(["first text", "second text"])    # Tensor [2, 384]
"""

from superslm.encoders.cross import CrossEncoder
from superslm.encoders.encoder import Encoder

__all__ = ["CrossEncoder", "Encoder"]
