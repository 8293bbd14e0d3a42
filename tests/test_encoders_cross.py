"""Cross-encoders against sentence-transformers' CrossEncoder (the oracle): tiny random-weight BERT,
RoBERTa and XLM-R sequence classifiers with one and three labels, activations, ranking, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from superslm import errors
from superslm.encoders import CrossEncoder, model_kind
from tests.test_encoders import build_bert_family

QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog " * 6,  # past max_seq_length 40: longest-first truncation
    "東京 is a city",
    "",
    "Search engines rank documents for a query.",
    "Zwölf Boxkämpfer jagen Viktor über den Deich.",
    "It is Paris, a city on the Seine river. " * 3,
]


def _oracle(folder: Path, **kwargs: Any) -> Any:
    from sentence_transformers import CrossEncoder as STCrossEncoder

    return STCrossEncoder(str(folder), device="cpu", **kwargs)


@pytest.mark.parametrize("family,labels,act", [
    ("bert", 1, "gelu"), ("bert", 3, "gelu_new"), ("roberta", 1, "gelu"), ("roberta", 3, "relu"),
    ("xlm-roberta", 1, "gelu_new"),
])
def test_scores_match_sentence_transformers(family: str, labels: int, act: str, tmp_path: Path) -> None:
    build_bert_family(tmp_path, family, head=True, labels=labels, act=act)
    st, ours = _oracle(tmp_path), CrossEncoder.load(tmp_path, device="cpu")
    assert ours.num_labels == labels and ours.activation == ("sigmoid" if labels == 1 else "identity")
    pairs = [(QUERY, d) for d in DOCS]
    assert ours.tokenize(QUERY, DOCS) == st.tokenizer([QUERY] * len(DOCS), DOCS, truncation="longest_first",
                                                      max_length=st.max_seq_length)["input_ids"]
    want = torch.as_tensor(st.predict(pairs, batch_size=3)).reshape(len(DOCS), labels)
    got = ours.predict(pairs, batch=3)
    assert (got - want).abs().max().item() <= 1e-5
    # raw logits too (sigmoid squashes differences): sentence-transformers with an identity activation
    raw = torch.as_tensor(st.predict(pairs, batch_size=3, activation_fn=torch.nn.Identity())).reshape(got.shape)
    assert (ours.predict(pairs, activation=False) - raw).abs().max().item() <= 1e-5
    assert raw.std().item() > 0.01  # not trivially flat
    scores = ours.scores(QUERY, DOCS, batch=2)
    if labels == 1:
        assert torch.allclose(torch.tensor(scores), want[:, 0], atol=1e-5)
        ranked = ours.rank(QUERY, DOCS)
        st_ranked = st.rank(QUERY, DOCS)
        assert [i for i, _ in ranked] == [r["corpus_id"] for r in st_ranked]
        assert ours.rank(QUERY, DOCS, top=2) == ranked[:2]
    else:
        assert torch.allclose(torch.tensor(scores), want, atol=1e-5)
        with pytest.raises(errors.UnsupportedModel):
            ours.rank(QUERY, DOCS)
    assert model_kind(tmp_path) == "cross-encoder"


def test_activation_from_config(tmp_path: Path) -> None:
    build_bert_family(tmp_path, "bert", head=True, labels=1)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()),
                               "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}))
    st, ours = _oracle(tmp_path), CrossEncoder.load(tmp_path, device="cpu")
    assert ours.activation == "identity"
    want = torch.as_tensor(st.predict([(QUERY, d) for d in DOCS]))
    assert torch.allclose(torch.tensor(ours.scores(QUERY, DOCS)), want, atol=1e-5)
    assert ((want < 0) | (want > 1)).any()  # really not a sigmoid


def test_saved_by_sentence_transformers(tmp_path: Path) -> None:
    """A folder written by CrossEncoder.save (modules.json, activation in config_sentence_transformers.json)."""
    build_bert_family(tmp_path / "hf", "roberta", head=True, labels=1)
    _oracle(tmp_path / "hf", activation_fn=torch.nn.Tanh()).save(str(tmp_path / "st"))
    st, ours = _oracle(tmp_path / "st"), CrossEncoder.load(tmp_path / "st", device="cpu")
    assert ours.activation == "tanh" and model_kind(tmp_path / "st") == "cross-encoder"
    want = torch.as_tensor(st.predict([(QUERY, d) for d in DOCS]))
    assert torch.allclose(torch.tensor(ours.scores(QUERY, DOCS)), want, atol=1e-5)


def test_rank_keeps_ties_in_input_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_bert_family(tmp_path, "bert", head=True, labels=1)
    ours = CrossEncoder.load(tmp_path, device="cpu")
    fixed = [0.5, 0.9, 0.5, 0.1, 0.9, 0.5]
    monkeypatch.setattr(ours, "scores", lambda *a, **k: fixed)
    want = sorted(range(len(fixed)), key=lambda i: (-fixed[i], i))
    assert [i for i, _ in ours.rank(QUERY, ["d"] * 6)] == want == [1, 4, 0, 2, 5, 3]
    assert ours.rank(QUERY, ["d"] * 6, top=3) == [(1, 0.9), (4, 0.9), (0, 0.5)]


def test_bad_input_is_refused(tmp_path: Path) -> None:
    build_bert_family(tmp_path / "ce", "bert", head=True, labels=1, max_len=16)
    ours = CrossEncoder.load(tmp_path / "ce", device="cpu")
    with pytest.raises(errors.InvalidArgument):
        ours.scores(QUERY, [])
    with pytest.raises(errors.InvalidArgument):
        ours.scores(None, ["doc"])  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        ours.rank(QUERY, ["doc"], top=0)
    with pytest.raises(errors.InvalidArgument):
        ours.predict([("only one",)])  # type: ignore[list-item]
    with pytest.raises(errors.ContextLengthExceeded):
        ours.scores(QUERY, ["short", DOCS[1]], truncate=False)
    assert len(ours.scores(QUERY, ["short", DOCS[1]])) == 2  # truncated by default
    # a model without a classification head is not a cross-encoder
    build_bert_family(tmp_path / "plain", "bert")
    with pytest.raises(errors.UnsupportedModel):
        CrossEncoder.load(tmp_path / "plain", device="cpu")


def test_cli_rerank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from superslm.cli import main

    build_bert_family(tmp_path, "bert", head=True, labels=1)
    ours = CrossEncoder.load(tmp_path, device="cpu")
    assert main(["embed", "-m", str(tmp_path), "--rerank", QUERY, "--top", "3", *DOCS[:5]]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["index"], pytest.approx(r["score"], abs=1e-6)) for r in rows] == ours.rank(QUERY, DOCS[:5], top=3)
    assert main(["embed", "-m", str(tmp_path), "text"]) == 2  # a cross-encoder needs --rerank
    # decoder-model options, and vectors to a file, do not apply to a reranking
    for extra in (["--pooling", "mean"], ["--normalize"], ["-o", str(tmp_path / "v.npy")]):
        assert main(["embed", "-m", str(tmp_path), "--rerank", QUERY, *extra, "text"]) == 2
        assert not (tmp_path / "v.npy").exists()
