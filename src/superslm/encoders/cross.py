"""`CrossEncoder`: (query, document) relevance scores as sentence-transformers' CrossEncoder computes them.

    from superslm.encoders import CrossEncoder
    ce = CrossEncoder.load("path/to/cross-encoder")
    ce.scores("what is x?", ["x is ...", "y is ..."])     # [0.97, 0.02]
    ce.rank("what is x?", docs, top=3)                   # [(index, score), ...] best first
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from superslm.encoders.batching import TextTokens, check_texts, pack, plan
from superslm.encoders.config import BertSpec, cross_activation, max_length, read_json, transformer_dir
from superslm.encoders.encoder import resolve_dtype
from superslm.encoders.net import ACTIVATIONS, BertNet, ClassifierHead, Weights, read_tensors
from superslm.encoders.workers import run_split
from superslm.errors import InvalidArgument, UnsupportedModel


class CrossEncoder:
    """A BERT / RoBERTa / XLM-R sequence-classification model scoring text pairs."""

    def __init__(
        self, spec: BertSpec, net: BertNet, head: ClassifierHead, tokens: TextTokens, activation: str, name: str,
        path: Path,
    ) -> None:
        self.spec, self.net, self.head, self.tokens = spec, net, head, tokens
        self.activation = activation
        self.name, self.path = name, path

    @classmethod
    def load(
        cls,
        path_or_name: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> CrossEncoder:
        """Load a cross-encoder folder (BertForSequenceClassification, RobertaForSequenceClassification or
        XLMRobertaForSequenceClassification with tokenizer.json). The activation is config.json's
        sentence_transformers.activation_fn, else sigmoid for one label and identity for more.
        Raises ModelNotFound, FormatError, UnsupportedModel (also: no classification head)."""
        from superslm.devices import pick_device
        from superslm.hub import resolve_path
        from superslm.tokenizer import Tokenizer

        folder = resolve_path(path_or_name)
        dev, dt = pick_device(device), resolve_dtype(dtype)
        model_dir = transformer_dir(folder)
        config = read_json(model_dir / "config.json")
        spec = BertSpec.from_config(config, model_dir)
        sbert = read_json(model_dir / "sentence_bert_config.json", required=False).get("max_seq_length")
        tokens = TextTokens(
            Tokenizer.from_folder(model_dir),
            max_length(spec, model_dir, sbert if isinstance(sbert, int) else None),
            zero_types=spec.type_vocab == 1 or spec.family != "bert",
        )
        w = Weights(read_tensors(model_dir), model_dir, dt, dev)
        head = ClassifierHead(spec, w)
        net = BertNet(spec, w)
        st_config = read_json(folder / "config_sentence_transformers.json", required=False)
        activation = cross_activation(config, st_config, spec.num_labels, model_dir)
        name = folder.name if Path(str(path_or_name)).exists() else str(path_or_name)
        return cls(spec, net, head, tokens, activation, name, folder)

    @property
    def num_labels(self) -> int:
        return self.spec.num_labels

    @property
    def max_seq_length(self) -> int:
        """Pairs longer than this many tokens are truncated (longest first), or refused."""
        return self.tokens.max_length

    @property
    def device(self) -> torch.device:
        return self.net.device

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "num_labels": self.num_labels,
            "activation": self.activation,
            "max_seq_length": self.max_seq_length,
            "device": str(self.device),
        }

    def tokenize(self, query: str, docs: Sequence[str], truncate: bool = True) -> list[list[int]]:
        """The token ids the model sees for each (query, doc) pair (for usage counts)."""
        if not isinstance(query, str):
            raise InvalidArgument(f"query must be a str, not {type(query).__name__}")
        return self.tokens.encode([(query, d) for d in check_texts(docs, "documents")], truncate)[0]

    def predict(
        self, pairs: Sequence[tuple[str, str]], batch: int = 32, truncate: bool = True, activation: bool = True
    ) -> torch.Tensor:
        """Pairs (a, b) -> float32 CPU Tensor [len(pairs), num_labels] of activated scores (raw logits
        with `activation=False`). Raises InvalidArgument, ContextLengthExceeded (a pair longer than
        max_seq_length when `truncate` is False)."""
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs:
            raise InvalidArgument("pairs must be a non-empty list of (text, text) pairs")
        items = []
        for p in pairs:
            if not isinstance(p, (tuple, list)) or len(p) != 2 or not all(isinstance(t, str) for t in p):
                raise InvalidArgument("each pair must be two strings")
            items.append((p[0], p[1]))
        ids, types = self.tokens.encode(items, truncate)
        out = self._run(ids, types, batch)
        return ACTIVATIONS[self.activation](out) if activation else out

    @torch.inference_mode()
    def _run(self, ids: list[list[int]], types: list[list[int]], batch: int) -> torch.Tensor:
        out = torch.empty(len(ids), self.num_labels, dtype=torch.float32)
        for indices in plan([len(s) for s in ids], batch):
            lengths = [len(ids[i]) for i in indices]
            order, logits = run_split(lambda part: self._logits(ids, types, part), indices, lengths, self.device)
            out[torch.tensor(order)] = logits.float().cpu()
        return out

    def _logits(
        self, ids: list[list[int]], types: list[list[int]], indices: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        packed = pack(ids, types, indices, self.spec.pos_offset, self.device)
        # the head reads the first token only: the last layer's feed-forward runs on those rows alone
        return packed.order, self.head(self.net(packed, packed.first_rows()))

    def scores(
        self, query: str, docs: Sequence[str], batch: int = 32, truncate: bool = True
    ) -> list[float] | list[list[float]]:
        """The score of (query, doc) for each doc, in input order: one float per doc for a one-label
        model, a list of num_labels floats per doc otherwise."""
        if not isinstance(query, str):
            raise InvalidArgument(f"query must be a str, not {type(query).__name__}")
        docs = check_texts(docs, "documents")
        out = self.predict([(query, d) for d in docs], batch=batch, truncate=truncate)
        return out[:, 0].tolist() if self.num_labels == 1 else out.tolist()

    def rank(
        self, query: str, docs: Sequence[str], top: int | None = None, batch: int = 32, truncate: bool = True
    ) -> list[tuple[int, float]]:
        """(doc index, score) pairs, best first, equal scores in input order; the first `top` only if given.
        Needs a one-label model (UnsupportedModel otherwise)."""
        if self.num_labels != 1:
            raise UnsupportedModel(f"rank needs a one-label cross-encoder; {self.name} has {self.num_labels} labels")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
            raise InvalidArgument(f"top must be a positive integer, not {top!r}")
        s = self.scores(query, docs, batch=batch, truncate=truncate)
        order = sorted(range(len(s)), key=lambda i: -s[i])  # stable: ties keep input order
        return [(i, float(s[i])) for i in order[:top]]

    def __repr__(self) -> str:
        return f"CrossEncoder({self.name!r}, num_labels={self.num_labels}, activation={self.activation!r})"
