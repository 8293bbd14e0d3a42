"""`Encoder`: sentence embeddings as sentence-transformers computes them, without padding.

    from superslm.encoders import Encoder
    enc = Encoder.load("all-minilm-l6-v2")          # or a sentence-transformers folder
    v = enc.embed("A sentence.")                      # Tensor [dim]
    m = enc.embed_batch(["one", "two", "three"])      # Tensor [3, dim]
    q = enc.embed_batch(["a question"], prompt_name="query")   # a prompt of the folder (e5 / bge style)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from superslm.encoders.batching import TextTokens, check_ids, check_texts, pack, plan
from superslm.encoders.config import BertSpec, SentenceSpec, max_length, parse_pooling, read_json, read_sentence_spec
from superslm.encoders.net import BertNet, Weights, read_tensors
from superslm.encoders.pooling import Dense, finish, pool
from superslm.encoders.workers import run_split
from superslm.errors import InvalidArgument

if TYPE_CHECKING:
    from superslm.model import Model

DEFAULT_ENCODER = "all-minilm-l6-v2"


class Body(Protocol):
    """What computes an Encoder's vectors: a BERT-family net, or a decoder model (encoders.decoder)."""

    dim: int
    max_length: int
    vocab_size: int
    device: torch.device

    def encode(self, texts: Sequence[str], truncate: bool) -> tuple[list[list[int]], list[list[int]] | None]: ...

    def run(
        self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None, indices: Sequence[int]
    ) -> tuple[list[int], torch.Tensor]: ...


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """Encoders compute in float32 unless asked (they are small, and callers expect the reference's numbers)."""
    from superslm.devices import pick_dtype

    return torch.float32 if dtype is None else pick_dtype(dtype, torch.device("cpu"))


class BertBody:
    """A BERT / RoBERTa / XLM-R net with its pooling, Dense and Normalize modules."""

    def __init__(self, spec: BertSpec, net: BertNet, st: SentenceSpec, dense: list[Dense], tokens: TextTokens) -> None:
        self.spec, self.net, self.st, self.dense, self.tokens = spec, net, st, dense, tokens
        self.max_length = tokens.max_length
        self.vocab_size = min(tokens.vocab_size, spec.vocab)
        self.device = net.device
        self.dim = dense[-1].out_features if dense else spec.dim * len(st.pooling)

    def encode(self, texts: Sequence[str], truncate: bool) -> tuple[list[list[int]], list[list[int]] | None]:
        return self.tokens.encode(texts, truncate)

    def run(
        self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None, indices: Sequence[int]
    ) -> tuple[list[int], torch.Tensor]:
        lengths = [len(ids[i]) for i in indices]
        return run_split(lambda part: self._run(ids, types, part), indices, lengths, self.device)

    def _run(
        self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None, indices: Sequence[int]
    ) -> tuple[list[int], torch.Tensor]:
        packed = pack(ids, types, indices, self.spec.pos_offset, self.device)
        modes = self.st.pooling
        # cls / last-token pooling needs one row per sequence out of the last layer
        keep = packed.first_rows() if modes == ("cls",) else packed.last_rows() if modes == ("lasttoken",) else None
        h = self.net(packed, keep)
        x = h.float() if keep is not None else pool(h, packed, modes)
        return packed.order, finish(x, self.dense, self.st.normalize)


class Encoder:
    """A sentence encoder: texts -> float32 vectors, equal to sentence-transformers' within float error.

    Build it with `Encoder.load` (a sentence-transformers folder or a known name) or
    `Encoder.from_model` (a decoder `superslm.Model` with last-token or mean pooling).

    Texts get a prompt put before them as sentence-transformers' encode does: `prompt` if given, else
    the folder's prompt named `prompt_name`, else its `default_prompt_name`'s, else none.
    """

    def __init__(
        self, body: Body, name: str, path: Path | None, pooling: tuple[str, ...], normalize: bool,
        prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
    ) -> None:
        self.body = body
        self.name = name
        self.path = path
        self.pooling = pooling
        self.normalize = normalize
        self.prompts = dict(prompts or {})
        self.default_prompt_name = default_prompt_name

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path_or_name: str | Path = DEFAULT_ENCODER,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> Encoder:
        """Load a sentence-transformers folder (or a plain BERT / RoBERTa / XLM-R transformers folder:
        mean pooling, no normalization) or a known model name such as "all-minilm-l6-v2".

        `device` defaults to cuda when present, else cpu; `dtype` to float32. Raises ModelNotFound,
        FormatError, UnsupportedModel (a family or module SuperSLM does not run, or a Pooling module with
        `include_prompt: false`), TokenizerError. config_sentence_transformers.json's `prompts` and
        `default_prompt_name` are kept (see the class).
        """
        from superslm.devices import pick_device
        from superslm.hub import resolve_path
        from superslm.tokenizer import Tokenizer

        folder = resolve_path(path_or_name)
        dev, dt = pick_device(device), resolve_dtype(dtype)
        st = read_sentence_spec(folder)
        spec = BertSpec.from_config(read_json(st.model_dir / "config.json"), st.model_dir)
        tokenizer = Tokenizer.from_folder(st.model_dir)
        # the RoBERTa family's tokenizers give no token type ids (the model adds zeros)
        zero_types = spec.type_vocab == 1 or spec.family != "bert"
        tokens = TextTokens(tokenizer, max_length(spec, st.model_dir, st.max_seq_length), zero_types,
                            st.do_lower_case)
        net = BertNet(spec, Weights(read_tensors(st.model_dir), st.model_dir, dt, dev))
        dense = [Dense(d, dev) for d in st.dense]
        name = folder.name if Path(str(path_or_name)).exists() else str(path_or_name)
        return cls(BertBody(spec, net, st, dense, tokens), name, folder, st.pooling, st.normalize,
                   st.prompts, st.default_prompt_name)

    @classmethod
    def from_model(
        cls, model: Model, pooling: str = "last", normalize: bool = False, max_length: int | None = None
    ) -> Encoder:
        """Embed with a decoder model (a loaded `superslm.Model`): the final-norm hidden state of the
        last token ("last") or the mean over all tokens ("mean"), L2-normalized if `normalize`.
        Texts are tokenized with the model's specials (its BOS where it adds one)."""
        from superslm.encoders.decoder import DecoderBody

        modes = parse_pooling(pooling, "from_model")
        body = DecoderBody(model, modes, normalize, max_length)
        return cls(body, model.name, Path(model.source.path), modes, normalize)

    # --- properties -----------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Length of the vectors."""
        return self.body.dim

    @property
    def max_seq_length(self) -> int:
        """Texts longer than this many tokens (with the specials) are truncated, or refused."""
        return self.body.max_length

    @property
    def device(self) -> torch.device:
        return self.body.device

    def info(self) -> dict[str, Any]:
        """What `superslm embed --info` prints (and a server may report)."""
        return {
            "name": self.name,
            "path": str(self.path) if self.path else None,
            "dim": self.dim,
            "max_seq_length": self.max_seq_length,
            "pooling": list(self.pooling),
            "normalize": self.normalize,
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
            "device": str(self.device),
        }

    # --- embedding ------------------------------------------------------------------------------

    def resolve_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text put before every text: `prompt`, else the prompt named `prompt_name`, else the
        default prompt, else "". InvalidArgument for an unknown name, a non-string, or both given."""
        if prompt is not None:
            if prompt_name is not None:
                raise InvalidArgument("give prompt or prompt_name, not both")
            if not isinstance(prompt, str):
                raise InvalidArgument(f"prompt must be a str, not {type(prompt).__name__}")
            return prompt
        name = self.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return ""
        if not isinstance(name, str) or name not in self.prompts:
            raise InvalidArgument(f"unknown prompt_name {name!r} (this model has: {sorted(self.prompts)})")
        return self.prompts[name]

    def tokenize(
        self, texts: Sequence[str], truncate: bool = True, prompt_name: str | None = None, prompt: str | None = None
    ) -> list[list[int]]:
        """The token ids the model sees for each text, its prompt put before it (see `resolve_prompt`),
        with its specials, truncated to max_seq_length (ContextLengthExceeded for a longer text when
        `truncate` is False)."""
        return self._encode(texts, truncate, prompt_name, prompt)[0]

    def embed(
        self, text: str, truncate: bool = True, prompt_name: str | None = None, prompt: str | None = None
    ) -> torch.Tensor:
        """One text -> its vector, a float32 CPU Tensor [dim]."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, not {type(text).__name__}")
        return self.embed_batch([text], truncate=truncate, prompt_name=prompt_name, prompt=prompt)[0]

    def embed_batch(
        self, texts: Sequence[str], batch: int = 32, truncate: bool = True, dimensions: int | None = None,
        prompt_name: str | None = None, prompt: str | None = None,
    ) -> torch.Tensor:
        """Texts -> float32 CPU Tensor [len(texts), dim], in input order.

        Texts are sorted by token count and run `batch` at a time; within a step, texts of equal
        token count are attended together, so no token is padding. With `dimensions`, the vectors
        are cut to their first `dimensions` entries (and L2-normalized again if the model normalizes,
        as OpenAI's `dimensions`; sentence-transformers' truncate_dim does not normalize again).
        `prompt_name` / `prompt`: see `resolve_prompt` (the folder's default prompt applies unless given).
        Raises InvalidArgument for an empty or non-string input, ContextLengthExceeded as `tokenize`.
        """
        self._check_dimensions(dimensions)
        ids, types = self._encode(texts, truncate, prompt_name, prompt)
        return self._run(ids, types, batch, dimensions)

    def _encode(
        self, texts: Sequence[str], truncate: bool, prompt_name: str | None, prompt: str | None
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        texts = check_texts(texts)
        # sentence-transformers joins the strings before tokenizing (and truncates the whole)
        head = self.resolve_prompt(prompt_name, prompt)
        return self.body.encode([head + t for t in texts] if head else texts, truncate)

    def embed_tokens(
        self, ids: Sequence[Sequence[int]], batch: int = 32, truncate: bool = True, dimensions: int | None = None
    ) -> torch.Tensor:
        """Token id lists, taken as the whole model input (no specials or prompt added) -> Tensor [len(ids), dim]
        (`dimensions` as in embed_batch). Raises TokenOutOfRange, ContextLengthExceeded (past
        max_seq_length without `truncate`)."""
        self._check_dimensions(dimensions)
        return self._run(self.check_tokens(ids, truncate), None, batch, dimensions)

    def check_tokens(self, ids: Sequence[Sequence[int]], truncate: bool = True) -> list[list[int]]:
        """Token id lists as `embed_tokens` takes them: checked against the vocabulary, cut to max_seq_length
        with `truncate` (TokenOutOfRange, ContextLengthExceeded, InvalidArgument otherwise)."""
        return check_ids(ids, self.body.vocab_size, self.max_seq_length, truncate)

    def truncate_dim(self, vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """Vectors [n, dim] cut to their first `dimensions` entries (None: all), L2-normalized again if the
        model normalizes, as OpenAI's `dimensions` (sentence-transformers' truncate_dim cuts after its
        Normalize module and does not normalize again)."""
        self._check_dimensions(dimensions)
        if dimensions is None or dimensions == vectors.shape[-1]:
            return vectors
        out = vectors[..., :dimensions].contiguous()
        return torch.nn.functional.normalize(out, p=2.0, dim=-1) if self.normalize else out

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and (
            not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= self.dim
        ):
            raise InvalidArgument(f"dimensions must be an integer from 1 to {self.dim}, not {dimensions!r}")

    @torch.inference_mode()
    def _run(
        self, ids: list[list[int]], types: list[list[int]] | None, batch: int, dimensions: int | None = None
    ) -> torch.Tensor:
        steps = plan([len(s) for s in ids], batch)
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        for indices in steps:
            order, vectors = self.body.run(ids, types, indices)
            out[torch.tensor(order)] = vectors.float().cpu()
        return self.truncate_dim(out, dimensions)

    def __repr__(self) -> str:
        return f"Encoder({self.name!r}, dim={self.dim}, pooling={self.pooling}, normalize={self.normalize})"
