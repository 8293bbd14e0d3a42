"""The formats inside a real model: SmolLM2-135M-Instruct Q4_1 with its linears swapped.

References: the fp32 model (every weight the GGUF's own dequantized values) and, for the GGUF-native
path, the file's weights dequantized by gguf-py.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

import superslm
from superslm.cache.kv import KVCache
from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.kernels.attention import AttnMetadata
from superslm.models.llama import unpermute_qk
from superslm.quant import (
    GGUFInt4Linear,
    Int4Linear,
    Int8Linear,
    linear_summary,
    quantize_from_source,
    quantize_linears,
    row_permutation,
)

pytestmark = pytest.mark.slow

TEXT = (
    "The sun rose over the quiet village. Children walked to school along the river, and the baker "
    "opened his shop early, as he had done every morning for thirty years. In the afternoon it began to rain."
)
U = 2.0**-8


def prefill_logits(net, tokens: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of every position of one sequence, in one prefill step."""
    a, n, ps = net.arch, len(tokens), 16
    pages = (n + ps - 1) // ps
    kv = KVCache(len(net.layers), pages, ps, a.kv_heads, a.head_dim, net.dtype)
    meta = AttnMetadata.one_prompt(n, ps)
    with torch.no_grad():
        return net.logits(net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v)).float()


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    model = superslm.load(smollm2_gguf)
    tokens = model.tokenizer.encode(TEXT)
    return model, tokens, prefill_logits(model.net, tokens)


def closeness(logits: torch.Tensor, ref: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    target = torch.tensor(tokens[1:])
    nll = F.cross_entropy(logits[:-1], target).item()
    ref_nll = F.cross_entropy(ref[:-1], target).item()
    return {
        "rel": float((logits - ref).norm() / ref.norm()),
        "top1": float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
        "ppl_ratio": float(torch.tensor(nll - ref_nll).exp()),
    }


def test_gguf_native_linears_equal_the_files_weights(smollm2_gguf, reference) -> None:
    _, tokens, ref = reference
    model = superslm.load(smollm2_gguf, dtype="bf16")
    dense = prefill_logits(model.net, tokens)
    swapped = quantize_from_source(model.net, model.source)
    assert all(isinstance(getattr(layer, n), GGUFInt4Linear) for layer in model.net.layers
               for n in ("qkv", "o", "gate_up", "down"))  # fmt: skip
    assert "from Q4_1" in swapped["layers.0.qkv"] and "from Q8_0" in swapped["head"]
    summary = linear_summary(model.net)
    assert sum(summary.values()) == 4 * len(model.net.layers) + 1 and len(summary) == 2, summary
    # llama's q/k unpermute is a row permutation the blocks can follow; gate needs none
    assert row_permutation(model.source, "q", model.arch.dim) is not None
    assert row_permutation(model.source, "gate", model.arch.ffn) is None
    # layer 0's fused qkv against gguf-py's dequantization of q, k, v, q and k unpermuted
    g, arch = model.source.gguf, model.arch
    parts = []
    for key in ("q", "k", "v"):
        name = f"blk.0.attn_{key}.weight"
        raw = g.raw(name).reshape(g.tensors[name].shape[0], -1)
        w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1)).float()
        parts.append(unpermute_qk(key, w, arch))
    w = torch.cat(parts)
    qkv = model.net.layers[0].qkv
    x = torch.randn(4, arch.dim).bfloat16()
    _, scale, zero = qkv._params()
    per_weight = (8 * scale.double().abs() + zero.double().abs()).repeat_interleave(32, dim=1)
    tol = U * (x.abs().double() @ (per_weight + 2 * w.abs().double()).t())  # params, then the output
    assert ((qkv(x).double() - x.double() @ w.double().t()).abs() <= tol + 1e-6).all()
    # the whole model: as close to fp32 as the plain bf16 model is
    native = closeness(prefill_logits(model.net, tokens), ref, tokens)
    plain = closeness(dense, ref, tokens)
    print("gguf-native", native, "bf16 dense", plain)
    assert native["rel"] < 1.5 * plain["rel"] and native["top1"] >= plain["top1"] - 0.1
    assert abs(native["ppl_ratio"] - 1) < 0.03


def test_quantized_model_still_talks(smollm2_gguf, reference) -> None:
    _, tokens, ref = reference
    model = superslm.load(smollm2_gguf, dtype="bf16")
    # int4 g32 re-quantizes this Q4_1 file's groups of 32 almost exactly; the head is int8
    quantize_linears(model.net, body="int4", head="int8", group=32, rotate=False)
    assert isinstance(model.net.layers[3].down, Int4Linear) and isinstance(model.net.head, Int8Linear)
    got = closeness(prefill_logits(model.net, tokens), ref, tokens)
    print("int4 g32 + int8 head", got)
    assert got["top1"] >= 0.9 and abs(got["ppl_ratio"] - 1) < 0.05
    text = model.engine(slots=1, context=256).complete("The capital of France is", 8)
    assert "Paris" in text


def mapped_kb(view: np.ndarray) -> int:
    """kB of the process's RSS in the maps that hold `view`'s bytes (/proc/self/smaps)."""
    lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
    total, here = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                here = a < hi and lo < b
            elif here and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_a_file_replaced_after_load_is_not_read_by_pread(smollm2_gguf, tmp_path) -> None:
    """The pread reader holds the file it was opened on, checked to be the mapped one: once another file has
    taken the path, the reader still reads the loaded file, and a new reader is refused (rows from the map)."""
    path = tmp_path / "m.gguf"
    shutil.copy(smollm2_gguf, path)
    model = superslm.load(path)
    reader = model.net.embed_rows.read
    assert reader is not None
    ids = torch.tensor([3, 500, 49000])
    before = model.net.embed(ids)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"\0" * path.stat().st_size)
    os.replace(other, path)
    assert torch.equal(model.net.embed(ids), before)
    gguf = model.source.gguf
    raw = model.net.embed_rows.rows.reshape(-1)
    assert gguf.rows_reader(raw, model.net.embed_rows.rows.shape[1]) is None
    model.net.embed_rows.read = None  # as a load after the replace would have it
    assert torch.equal(model.net.embed(ids), before)
    with pytest.raises(InvalidArgument):
        reader(np.array([model.net.arch.vocab]))


def test_embedding_rows_come_from_the_file(smollm2_gguf) -> None:
    # the default GGUF load keeps no dense embedding table: each step's rows are dequantized from the map
    model = superslm.load(smollm2_gguf)
    net, src = model.net, model.source
    assert net.embed_weight.numel() == 0 and net.embed_rows is not None
    name = next(n for n in src.gguf.tensors if n.startswith("token_embd"))
    dense = src.gguf.dequantize(name).to(torch.bfloat16)  # the whole table at once
    ids = torch.tensor([0, 7, 49151, 7, 12345])
    assert torch.equal(net.embed(ids), dense[ids])
    assert net.embed(ids[:0]).shape == (0, net.arch.dim)
    with pytest.raises(TokenOutOfRange):
        net.embed(torch.tensor([-1]))
    # rows come by pread: no page of the file enters the process (through the map a scattered row faulted
    # in a whole page-cache folio, ~1 MB of RSS a row)
    assert net.embed_rows.read is not None
    src.gguf.release_pages()
    many = (torch.arange(200) * 7919 % net.arch.vocab).reshape(50, 4)  # a decode step's rows, 50 times
    assert all(torch.equal(net.embed(step), dense[step]) for step in many)
    assert mapped_kb(src.gguf._data) == 0
    # without pread: the file's pages go every RELEASE_ROWS rows, and the rows read after a release are the same
    net.embed_rows.read = None
    calls = []
    net.embed_rows.release = lambda: (calls.append(1), src.gguf.release_pages())
    rows = net.embed_rows.RELEASE_ROWS
    big = torch.arange(rows + 5) * 97 % net.arch.vocab
    assert torch.equal(net.embed(big), dense[big]) and len(calls) == 1
    for _ in range(rows // 4):
        net.embed(ids)
    assert len(calls) == 1 + (rows // 4 * len(ids)) // rows == 2
    assert torch.equal(net.embed(big), dense[big])
