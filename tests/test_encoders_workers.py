"""Step workers (superslm.encoders.workers): a step split across single-threaded worker threads gives
the vectors and scores sentence-transformers gives, and torch's thread settings stay as they were."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from superslm.encoders import CrossEncoder, Encoder, workers
from tests.test_encoders import build_bert_family, varied_texts


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def split_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many shards each split step had (the real `shards`, observed)."""
    seen: list[int] = []
    real = workers.shards

    def observed(lengths: Any, parts: int) -> list[tuple[int, int]]:
        out = real(lengths, parts)
        seen.append(len(out))
        return out

    monkeypatch.setattr(workers, "shards", observed)
    return seen


def test_shards_cover_the_step_in_balanced_runs() -> None:
    cases = [([256] * 32, 2), ([100] * 32, 4), (list(range(126, 94, -1)), 2), ([200, 10, 10, 10], 2), ([5, 5], 3)]
    for lengths, parts in cases:
        runs = workers.shards(lengths, parts)
        assert 1 <= len(runs) <= parts
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
        assert all(a < b for a, b in runs) and all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
    assert workers.shards([256] * 32, 2) == [(0, 16), (16, 32)]
    assert workers.shards([100] * 32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert workers.shards([200, 10, 10, 10], 2) == [(0, 1), (1, 4)]  # the long one alone
    # mixed lengths: the two halves' costs within one sequence's cost of each other
    lengths = list(range(126, 94, -1))
    (a, b), (c, d) = workers.shards(lengths, 2)
    cost = [n * (1 + n / 512) for n in lengths]
    assert abs(sum(cost[a:b]) - sum(cost[c:d])) <= 2 * max(cost)


@pytest.mark.slow
def test_minilm_split_steps_match_sentence_transformers(
    minilm_folder: Path, two_threads: None, split_count: list[int]
) -> None:
    from sentence_transformers import SentenceTransformer

    ours, st = Encoder.load(minilm_folder, device="cpu"), SentenceTransformer(str(minilm_folder), device="cpu")
    texts = varied_texts(96, seed=3)
    want = torch.from_numpy(st.encode(texts, batch_size=32))
    split = ours.embed_batch(texts, batch=32)
    assert split_count and all(n >= 2 for n in split_count)  # the steps really were split
    workers.USE_WORKERS = False
    try:
        whole = ours.embed_batch(texts, batch=32)
    finally:
        workers.USE_WORKERS = True
    assert F.cosine_similarity(split, want).min().item() >= 0.99999
    assert (split - whole).abs().max().item() <= 1e-5
    # the workers' one-thread setting stays theirs: this thread and a new one keep torch's count
    assert torch.get_num_threads() == 2
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [2]


def test_cross_encoder_split_steps_match(tmp_path: Path, two_threads: None, split_count: list[int]) -> None:
    from sentence_transformers import CrossEncoder as STCrossEncoder

    build_bert_family(tmp_path, "bert", head=True, labels=3)
    ours, st = CrossEncoder.load(tmp_path, device="cpu"), STCrossEncoder(str(tmp_path), device="cpu")
    # pairs past the tiny model's 40 tokens, so a step of 32 has the rows to split
    docs = [t + " search engines rank documents" * 4 for t in varied_texts(40, seed=5)]
    pairs = [("What is the capital of France?", d) for d in docs]
    got = ours.predict(pairs, batch=32, activation=False)
    assert split_count and all(n >= 2 for n in split_count)
    raw = torch.as_tensor(st.predict(pairs, batch_size=32, activation_fn=torch.nn.Identity())).reshape(got.shape)
    assert (got - raw).abs().max().item() <= 1e-5
    assert raw.std().item() > 0.01
