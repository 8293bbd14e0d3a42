"""Our forward pass against transformers on tiny random-weight models of every family."""

from __future__ import annotations

import pytest
import torch

from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from tests.tiny_models import CONFIGS, SingleSequence, build_hf_model


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_transformers(family: str, tmp_path) -> None:
    hf = build_hf_model(family, tmp_path)
    src = open_source(tmp_path)
    net = Transformer(src.arch, materialize(src, torch.float32))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, src.arch.vocab, (20,), generator=g).tolist()
    decode = torch.randint(0, src.arch.vocab, (16,), generator=g).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + decode])).logits[0].float()
        seq = SingleSequence(net)
        got = [seq.step(prompt)]
        got += [seq.step([t]) for t in decode]
    got_all = torch.cat(got)
    assert got_all.shape == want.shape
    diff = (got_all - want).abs().max().item()
    assert diff <= 1e-4, f"{family}: max abs diff {diff}"
    # the logits are not trivially flat: a wrong model would not pass by accident
    assert want.std().item() > 0.05


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole(chunk: int, tmp_path) -> None:
    build_hf_model("gemma3", tmp_path)
    src = open_source(tmp_path)
    net = Transformer(src.arch, materialize(src))
    tokens = torch.randint(0, src.arch.vocab, (30,)).tolist()
    with torch.no_grad():
        whole = SingleSequence(net).step(tokens)
        seq = SingleSequence(net, seed=5)
        parts = [seq.step(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-5
