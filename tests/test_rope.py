"""Rotary tables: a table of every position (Transformer._rope_rows, computed in one call) gives each position the
values a call for that position alone gives, so a decode step may index it instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from superslm.kernels.rope import rope_cos_sin
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from tests.tiny_models import build_hf_model


@pytest.mark.parametrize("rot", [12, 32, 64, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_one_position_calls(rot: int, dtype: torch.dtype) -> None:
    inv = 1.0 / (1e6 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = rope_cos_sin(torch.arange(9000), inv, 0.7, dtype)
    g = torch.Generator().manual_seed(rot)
    for p in torch.randint(0, 9000, (64,), generator=g).tolist() + [0, 8999]:
        c, s = rope_cos_sin(torch.tensor([p]), inv, 0.7, dtype)
        assert torch.equal(c[0], cos[p]) and torch.equal(s[0], sin[p]), p
    pos = torch.randint(0, 9000, (13,), generator=g)
    c, s = rope_cos_sin(pos, inv, 0.7, dtype)
    assert torch.equal(c, cos[pos]) and torch.equal(s, sin[pos])


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_transformer_tables_equal_direct_calls(family: str, tmp_path: Path) -> None:
    """Gemma-3's two rope keys (global and local) and a plain one, the table grown past its first size, positions
    past ROPE_TABLE_ROWS computed, and after .to() the new dtype's table."""
    build_hf_model(family, tmp_path)
    src = open_source(tmp_path)
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    g = torch.Generator().manual_seed(3)
    for positions in ([5], [0, 255, 256], torch.randint(0, 3000, (7,), generator=g).tolist(), [9000, 3]):
        pos = torch.tensor(positions)
        got = net.rope_table_list(pos)
        for kind in (k for k in net._kinds if k != 2):
            inv, scale = net._inv_freq[kind]
            c, s = rope_cos_sin(pos, inv, scale, net.dtype)
            assert torch.equal(got[kind][0], c) and torch.equal(got[kind][1], s), (positions, kind)
    kinds = [k for k in net._kinds if k != 2]
    assert len(kinds) == (2 if family == "gemma3" else 1)
    assert sorted(net._rope_rows_cache) == kinds and all(t[0].shape[0] == 4096 for t in net._rope_rows_cache.values())
    net.float()
    got = net.rope_table_list(torch.tensor([17]))
    assert got[0][0].dtype == torch.float32
