"""A GGUF file whose metadata contradicts its tensors, names special tokens outside its vocabulary or holds
NaN weights is refused at load with FormatError (before: it loaded and answered nothing or NaN, or raised
torch's RuntimeError). Each case is the real default model's file with one field patched by gguf-py."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

import superslm
from superslm.errors import FormatError, UnsupportedModel


def variant(src: Path, dst: Path, fields: dict[str, int] | None = None, nan_tensor: str | None = None) -> Path:
    shutil.copy(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    for key, value in (fields or {}).items():
        field = r.fields[key]
        field.parts[field.data[0]][0] = value
    if nan_tensor is not None:
        t = next(t for t in r.tensors if t.name == nan_tensor)
        t.data.reshape(-1).view(np.uint8)[0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # a scale
    r.data.flush()
    del r
    return dst


CASES = {
    "heads that do not divide the width": ({"llama.attention.head_count": 7}, None, "not a multiple of 7 heads"),
    "a width the tensors do not have": ({"llama.embedding_length": 512}, None, "not a multiple of 9 heads"),
    "heads the tensors do not have": ({"llama.attention.head_count": 6}, None, "has shape"),
    "an ffn the tensors do not have": ({"llama.feed_forward_length": 1000}, None, "has shape"),
    "a bos outside the vocabulary": ({"tokenizer.ggml.bos_token_id": 10**6}, None, "special token id 1000000"),
    "an eos outside the vocabulary": ({"tokenizer.ggml.eos_token_id": 49152}, None, "special token id 49152"),
    "a NaN block scale in a layer": (None, "blk.3.ffn_down.weight", "NaN or infinite"),
    "a NaN block scale in the (tied) embedding": (None, "token_embd.weight", "NaN or infinite"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_contradicting_files_are_refused(smollm2_gguf: Path, tmp_path: Path, case: str) -> None:
    fields, nan_tensor, message = CASES[case]
    bad = variant(smollm2_gguf, tmp_path / "bad.gguf", fields, nan_tensor)
    with pytest.raises(FormatError, match=message):
        superslm.load(bad)
    with pytest.raises(FormatError, match=message):
        superslm.load(bad, quant=None)  # the dense path checks the same


def test_kv_heads_that_do_not_divide_are_unsupported(smollm2_gguf: Path, tmp_path: Path) -> None:
    bad = variant(smollm2_gguf, tmp_path / "bad.gguf", {"llama.attention.head_count_kv": 4})
    with pytest.raises(UnsupportedModel, match="multiple of kv heads"):
        superslm.load(bad)


def test_an_unpatched_copy_loads(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The patching itself breaks nothing: the same copy with a field written back unchanged answers."""
    same = variant(smollm2_gguf, tmp_path / "same.gguf", {"llama.attention.head_count": 9})
    assert superslm.load(same).engine(slots=1, context=64).complete("The capital of France is", 4)


def test_an_untied_embedding_is_checked_row_chunk_by_chunk() -> None:
    """The embedding of an untied model runs from its blocks (never dense): its check reads a few thousand rows
    at a time, and finds a NaN scale in the last chunk."""
    import torch

    from superslm.formats.blocks import Q8_0
    from superslm.quant.gguf_map import GGUFEmbedding

    rows, dim = 10, 64
    rng = np.random.default_rng(0)
    blocks = np.zeros((rows, dim // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, dim // 32, 32), dtype=np.uint8)
    table = GGUFEmbedding(blocks.reshape(-1), Q8_0, (rows, dim), torch.float32)
    assert table.all_finite(rows=3)
    blocks[9, 1, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    assert not GGUFEmbedding(blocks.reshape(-1), Q8_0, (rows, dim), torch.float32).all_finite(rows=3)
