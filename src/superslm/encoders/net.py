"""The BERT-family forward pass over packed rows: no padding token is ever computed.

A step's sequences are packed into flat rows [N, dim] (see `batching.Packed`): every linear layer runs
once over all rows, and attention runs once per group of sequences of equal length, each group a dense
[count, heads, length, head_dim] batch needing no mask. Post-LN layers as BERT, RoBERTa and XLM-R define.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from superslm.encoders.batching import Packed
from superslm.encoders.config import BertSpec
from superslm.errors import FormatError, UnsupportedModel

#: use oneDNN's fused linear (+ activation) kernel on the CPU where it works; the benchmark measured it
#: 2-4x faster than the default fp32 matmul at these shapes (docs/encoders.md)
USE_MKLDNN = True

# oneDNN post-op names and algorithms of our activations
_POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


@cache
def _mkldnn_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here and agrees with F.linear (probed once per dtype)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=g).to(dtype) for s in ((5, 16), (24, 16), (24,)))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        y = op(x, w, b, "gelu", [], "none")
        ok = torch.allclose(y.float(), F.gelu(F.linear(x, w, b)).float(), rtol=tol, atol=tol)
        z = op.binary(x, y, w, b, "add")
        return bool(ok and torch.allclose(z.float(), (F.linear(x, w, b) + y).float(), rtol=tol, atol=tol))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class Linear:
    """y = act(x W^T + b) on rows [N, in]; on the CPU one fused oneDNN call where it works."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act: str = "identity") -> None:
        self.weight, self.bias, self.act = weight, bias, act
        self.fast = USE_MKLDNN and weight.device.type == "cpu" and _mkldnn_works(weight.dtype)
        # None: an activation oneDNN does not fuse (applied after the matmul)
        self.post = ("none", "") if act == "identity" else _POST_OPS.get(act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and self.post is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.post[0], [], self.post[1])
        return ACTIVATIONS[self.act](F.linear(x, self.weight, self.bias))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x W^T + b + residual (no activation), the add fused into the matmul where oneDNN runs."""
        if self.fast:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + residual


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors file(s) (model.safetensors, or the shards of its index)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{index}: malformed safetensors index ({e})") from e
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise FormatError(f"{folder}: no model.safetensors (pytorch_model.bin is not read)")
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            with safe_open(str(folder / shard), framework="pt") as h:
                for name in h.keys():
                    out[name] = h.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise FormatError(f"{folder / shard}: not a readable safetensors file ({e})") from e
    return out


class Weights:
    """Tensors by their transformers names, with the model prefix ("bert.", "roberta.") taken off."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: Path, dtype: torch.dtype, device: torch.device):
        anchor = [k for k in tensors if k.endswith("embeddings.word_embeddings.weight")]
        if not anchor:
            raise FormatError(f"{where}: no embeddings.word_embeddings.weight (not a BERT-family checkpoint)")
        self.prefix = min(anchor, key=len)[: -len("embeddings.word_embeddings.weight")]
        # checkpoints of the TF era name LayerNorm parameters gamma / beta
        self.t = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
                  for k, v in tensors.items()}
        self.where, self.dtype, self.device = where, dtype, device

    def has(self, name: str, body: bool = True) -> bool:
        return (self.prefix + name if body else name) in self.t

    def get(self, name: str, shape: tuple[int, ...], body: bool = True) -> torch.Tensor:
        key = self.prefix + name if body else name
        t = self.t.get(key)
        if t is None:
            raise FormatError(f"{self.where}: missing tensor {key}")
        if tuple(t.shape) != shape:
            raise FormatError(f"{self.where}: {key} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=self.dtype).contiguous()


class EncoderLayer:
    """Self-attention then the feed-forward block, each followed by residual add and LayerNorm (post-LN)."""

    def __init__(self, s: BertSpec, w: Weights, i: int) -> None:
        p, d = f"encoder.layer.{i}.", s.dim
        self.spec = s

        def pair(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            # (weight, bias) of a linear layer or (gamma, beta) of a LayerNorm
            return w.get(p + name + ".weight", shape), w.get(p + name + ".bias", shape[:1])

        # q, k, v fused into one matmul
        q, k, v = (pair(f"attention.self.{n}", (d, d)) for n in ("query", "key", "value"))
        self.qkv = Linear(torch.cat([q[0], k[0], v[0]]), torch.cat([q[1], k[1], v[1]]))
        self.o = Linear(*pair("attention.output.dense", (d, d)))
        self.ln1 = pair("attention.output.LayerNorm", (d,))
        self.up = Linear(*pair("intermediate.dense", (s.ffn, d)), s.act)
        self.down = Linear(*pair("output.dense", (d, s.ffn)))
        self.ln2 = pair("output.LayerNorm", (d,))

    def __call__(self, h: torch.Tensor, packed: Packed, keep: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, dim] -> [N, dim], or only the rows `keep` (every row still serves as a key)."""
        s = self.spec
        a = attention(self.qkv(h), packed, s.heads, s.head_dim)
        if keep is not None:
            a, h = a[keep], h[keep]
        h = F.layer_norm(self.o.add(a, h), (s.dim,), *self.ln1, eps=s.eps)
        return F.layer_norm(self.down.add(self.up(h), h), (s.dim,), *self.ln2, eps=s.eps)


def attention(qkv: torch.Tensor, packed: Packed, heads: int, head_dim: int) -> torch.Tensor:
    """Bidirectional attention within each sequence: qkv [N, 3 * heads * head_dim] -> [N, heads * head_dim]."""
    outs = []
    for start, count, length in packed.groups:
        x = qkv[start : start + count * length].view(count, length, 3, heads, head_dim)
        x = x.permute(2, 0, 3, 1, 4)  # [3, g, H, L, D]
        o = F.scaled_dot_product_attention(x[0], x[1], x[2])  # [g, H, L, D]
        # the CPU kernel lays its output out like q (rows-major here): this reshape is usually free
        outs.append(o.transpose(1, 2).reshape(count * length, heads * head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class BertNet:
    """Embeddings and encoder layers of a BERT-family model; `__call__` gives the last hidden rows."""

    def __init__(self, spec: BertSpec, w: Weights) -> None:
        d = spec.dim
        self.spec = spec
        self.word = w.get("embeddings.word_embeddings.weight", (spec.vocab, d))
        self.pos = w.get("embeddings.position_embeddings.weight", (spec.max_positions, d))
        self.type = w.get("embeddings.token_type_embeddings.weight", (spec.type_vocab, d))
        self.ln = (w.get("embeddings.LayerNorm.weight", (d,)), w.get("embeddings.LayerNorm.bias", (d,)))
        self.layers = [EncoderLayer(spec, w, i) for i in range(spec.layers)]

    @property
    def device(self) -> torch.device:
        return self.word.device

    @property
    def dtype(self) -> torch.dtype:
        return self.word.dtype

    def __call__(self, packed: Packed, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Packed sequences -> hidden rows [N, dim] after the last layer (only the rows `keep` if given:
        the last layer's feed-forward then runs on those alone)."""
        s = self.spec
        h = F.embedding(packed.ids, self.word) + F.embedding(packed.types, self.type)
        h = F.layer_norm(h + F.embedding(packed.positions, self.pos), (s.dim,), *self.ln, eps=s.eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, packed, keep if i == last else None)
        return h


class ClassifierHead:
    """The first token's row -> label logits: BERT's pooler (dense, tanh) then classifier, or the
    RoBERTa-family head (dense, tanh, out_proj); the same computation under two sets of names."""

    def __init__(self, spec: BertSpec, w: Weights) -> None:
        d, n = spec.dim, spec.num_labels
        if w.has("classifier.out_proj.weight", body=False):
            names = ("classifier.dense", False), ("classifier.out_proj", False)
        elif w.has("classifier.weight", body=False) and w.has("pooler.dense.weight"):
            names = ("pooler.dense", True), ("classifier", False)
        else:
            raise UnsupportedModel(
                f"{w.where}: no sequence-classification head (BERT pooler + classifier, or RoBERTa "
                "classifier.dense + classifier.out_proj); not a cross-encoder"
            )
        (dn, db), (on, ob) = names
        self.dense = Linear(w.get(dn + ".weight", (d, d), db), w.get(dn + ".bias", (d,), db))
        self.out = Linear(w.get(on + ".weight", (n, d), ob), w.get(on + ".bias", (n,), ob))

    def __call__(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[n, dim] -> logits [n, num_labels]."""
        return self.out(torch.tanh(self.dense(first_rows)))
