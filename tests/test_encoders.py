"""Sentence encoders against sentence-transformers (the oracle): the packaged all-MiniLM-L6-v2, tiny
random-weight BERT / RoBERTa / XLM-R models with every pooling module, decoder embeddings, bad input.

The tiny-model builders live here; tests/test_encoders_cross.py imports them.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from superslm import errors
from superslm.encoders import Encoder, model_kind

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Search engines rank documents for a query. "
    "Zwölf Boxkämpfer jagen Viktor über den Deich. 東京 is a city; Paris is too! 3.14 42% $100 e-mail "
    "What is the capital of France? It is Paris, a city on the Seine river."
)
WORDS = (
    "the of and to in is was for on that with as by at from search engine retrieval vector embedding "
    "sentence model query document passage ranking neural network Paris London Tokyo river mountain "
    "coffee algorithm database latency kernel compiler économie naïve café Zürich Straße 東京 мир "
    "العربية 😀 3.14 2024 42% $100 e-mail co-operate don't HTTP/2 C++ x86_64 <tag> "
).split()


def varied_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of mixed length and script: words, numbers, emoji, whitespace oddities, a few too long."""
    r = random.Random(seed)
    fixed = ["", " ", "a", "Hello, World!", "tab\tand\nnewline", "  leading and trailing  ", "ÀÉÎÕÜ ß ﬁ", "\u00a0nbsp"]
    out = fixed[:n]
    while len(out) < n:
        # every 25th text runs past max_seq_length (256 tokens): truncation, kept rare to keep the test fast
        k = r.choice([r.randint(1, 8), r.randint(5, 30), r.randint(20, 60)])
        if len(out) % 25 == 0:
            k = r.randint(200, 320)
        words = [r.choice(WORDS) for _ in range(k)]
        if r.random() < 0.3:
            words = [w.upper() if r.random() < 0.5 else w.capitalize() for w in words]
        out.append(" ".join(words) + r.choice([".", "?", "!", "", " ..."]))
    return out


# --- tiny models (tokenizers trained on CORPUS, random weights through transformers) ---------------


def write_bert_tokenizer(folder: Path, max_len: int) -> int:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator([CORPUS] * 3, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials,
                                                                     show_progress=False))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "model_max_length": max_len, "do_lower_case": True, "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
    }))
    return tok.get_vocab_size()


def write_roberta_tokenizer(folder: Path, max_len: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 3, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "RobertaTokenizer", "model_max_length": max_len, "bos_token": "<s>", "eos_token": "</s>",
        "sep_token": "</s>", "cls_token": "<s>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
    }))
    return tok.get_vocab_size()


def build_bert_family(
    folder: Path, family: str = "bert", head: bool = False, labels: int = 1, act: str = "gelu", max_len: int = 40,
    seed: int = 0, config: dict[str, Any] | None = None,
) -> Any:
    """A tiny random-weight BertModel / RobertaModel / XLMRobertaModel (or its ForSequenceClassification
    with `head`), saved with its tokenizer to `folder`; returns the transformers model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = (write_bert_tokenizer if family == "bert" else write_roberta_tokenizer)(folder, max_len)
    kw: dict[str, Any] = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=48, hidden_act=act, num_labels=labels, max_position_embeddings=64)
    if family != "bert":
        kw.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    kw.update(config or {})
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[family]
    cfg = getattr(transformers, prefix + "Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + ("ForSequenceClassification" if head else "Model"))(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # LayerNorms and biases too, so a skipped one shows
            # the head gets more, or the logits of a random model hardly differ between pairs
            p.add_(torch.randn_like(p) * (0.5 if "classifier" in name or "pooler" in name else 0.05))
    model.eval()
    model.save_pretrained(folder)
    return model


def build_sentence_model(folder: Path, family: str, pooling: Any, dense: bool, normalize: bool, act: str) -> Path:
    """A sentence-transformers folder saved by sentence-transformers itself around a tiny model."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    base = folder.parent / (folder.name + "-base")
    build_bert_family(base, family, act=act)
    modules: list[Any] = [Transformer(str(base), max_seq_length=30), Pooling(32, pooling_mode=pooling)]
    if dense:
        modules.append(Dense(modules[1].get_embedding_dimension(), 16, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    shutil.rmtree(base)
    return folder


SHORT_TEXTS = ["Paris is the capital.", "The quick brown fox " * 12, "東京 is a city", "", "a",
               "search engines rank documents for a query " * 3, "Zwölf Boxkämpfer", "What is the capital?"]


# --- all-MiniLM-L6-v2 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(minilm_folder: Path) -> tuple[Encoder, Any]:
    from sentence_transformers import SentenceTransformer

    return Encoder.load(minilm_folder, device="cpu"), SentenceTransformer(str(minilm_folder), device="cpu")


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm: tuple[Encoder, Any]) -> None:
    ours, st = minilm
    texts = varied_texts(200)
    want = torch.from_numpy(st.encode(texts, batch_size=32))
    lengths = [len(ids) for ids in ours.tokenize(texts)]
    assert max(lengths) == ours.max_seq_length == 256 and min(lengths) == 2  # truncation and "" both exercised
    batched = ours.embed_batch(texts, batch=32)
    single = torch.stack([ours.embed(t) for t in texts])
    for got in (batched, single):
        assert got.shape == want.shape == (200, 384)
        assert F.cosine_similarity(got, want).min().item() >= 0.99999
    # Normalize module: unit vectors
    assert torch.allclose(batched.norm(dim=1), torch.ones(200), atol=1e-5)


@pytest.mark.slow
def test_minilm_by_name_and_token_ids(minilm: tuple[Encoder, Any]) -> None:
    ours, st = minilm
    by_name = Encoder.load("all-minilm-l6-v2", device="cpu")
    texts = varied_texts(12, seed=3)
    ids = by_name.tokenize(texts)
    assert ids == [st.tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in texts]
    a, b = by_name.embed_batch(texts, batch=5), ours.embed_tokens(ids, batch=3)
    assert (a - b).abs().max().item() <= 1e-5
    assert model_kind("all-minilm-l6-v2") == "encoder"
    # OpenAI's `dimensions`: the first entries, normalized again since the model normalizes
    short = by_name.embed_batch(texts, dimensions=64)
    assert (short - F.normalize(a[:, :64], dim=1)).abs().max().item() <= 1e-6
    # sentence-transformers' truncate_dim cuts after Normalize: same directions, not unit length
    st_cut = torch.from_numpy(st.encode(texts, truncate_dim=64))
    assert F.cosine_similarity(short, st_cut).min().item() >= 0.99999 and st_cut.norm(dim=1).max().item() < 0.99
    for bad in (0, 385, 1.5):
        with pytest.raises(errors.InvalidArgument):
            by_name.embed_batch(texts, dimensions=bad)  # type: ignore[arg-type]


def edit_json(path: Path, **keys: Any) -> None:
    """Set `keys` in a JSON file of a folder copied with its files linked (never written through)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    path.unlink(missing_ok=True)
    path.write_text(json.dumps({**data, **keys}))


@pytest.mark.slow
def test_minilm_prompts_match_sentence_transformers(minilm_folder: Path, tmp_path: Path) -> None:
    """An e5 / bge-style folder: config_sentence_transformers.json's default prompt goes before every text."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "prompted"
    shutil.copytree(minilm_folder, folder, copy_function=os.symlink)
    edit_json(folder / "config_sentence_transformers.json", default_prompt_name="query",
              prompts={"query": "query: ", "passage": "passage: ", "empty": None})
    st, ours = SentenceTransformer(str(folder), device="cpu"), Encoder.load(folder, device="cpu")
    texts = [*varied_texts(10, seed=5), "word " * 300]  # "", whitespace, and one truncated with its prompt
    assert ours.tokenize(texts) == [st.tokenizer("query: " + t, truncation=True, max_length=256)["input_ids"]
                                    for t in texts]
    plain = torch.from_numpy(st.encode(texts, prompt=""))
    for kw in ({}, {"prompt_name": "passage"}, {"prompt_name": "empty"}, {"prompt": ""}, {"prompt": "Find: "}):
        want = torch.from_numpy(st.encode(texts, batch_size=4, **kw))
        got = ours.embed_batch(texts, batch=4, **kw)  # type: ignore[arg-type]
        assert F.cosine_similarity(got, want).min().item() >= 0.99999, kw
        if kw.get("prompt_name") != "empty" and kw.get("prompt") != "":
            assert F.cosine_similarity(got, plain).min().item() < 0.99  # the prompt did change the vectors
    assert F.cosine_similarity(ours.embed(texts[4]), plain[4], dim=0).item() < 0.99
    assert ours.info()["default_prompt_name"] == "query"
    for bad in ({"prompt_name": "nope"}, {"prompt": 3}, {"prompt": "a", "prompt_name": "query"}):
        with pytest.raises(errors.InvalidArgument):
            ours.embed_batch(texts, **bad)  # type: ignore[arg-type]


# --- tiny models with every pooling module --------------------------------------------------------


@pytest.mark.parametrize(
    "family,pooling,dense,normalize,act",
    [
        ("bert", "mean", False, True, "gelu"),
        ("bert", ("cls", "max"), True, False, "gelu_new"),
        ("bert", "cls", False, False, "gelu"),
        ("roberta", "mean_sqrt_len_tokens", False, False, "gelu"),
        ("roberta", "lasttoken", False, True, "gelu_new"),
        ("xlm-roberta", "weightedmean", True, True, "relu"),
        ("xlm-roberta", "max", False, False, "gelu"),
    ],
)
def test_tiny_sentence_models_match(family: str, pooling: Any, dense: bool, normalize: bool, act: str,
                                    tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = build_sentence_model(tmp_path / "st", family, pooling, dense, normalize, act)
    want = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(SHORT_TEXTS, batch_size=3))
    ours = Encoder.load(folder, device="cpu")
    assert ours.max_seq_length == 30  # set through the Transformer module, saved in tokenizer_config.json
    got = ours.embed_batch(SHORT_TEXTS, batch=3)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    assert want.std().item() > 0.05  # not trivially flat
    assert model_kind(folder) == "encoder"


def test_plain_transformers_folder_mean_pools(tmp_path: Path) -> None:
    """No modules.json: mean pooling, no normalization (sentence-transformers' fallback)."""
    from sentence_transformers import SentenceTransformer

    hf = build_bert_family(tmp_path, "roberta")
    # sentence-transformers reads prompts only beside modules.json: this default prompt is not used
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"q": "query: "}, "default_prompt_name": "q"}))
    ours = Encoder.load(tmp_path, device="cpu")
    assert ours.pooling == ("mean",) and not ours.normalize and ours.max_seq_length == 40
    got = ours.embed_batch(SHORT_TEXTS, batch=4)
    want = torch.from_numpy(SentenceTransformer(str(tmp_path), device="cpu").encode(SHORT_TEXTS))
    assert (got - want).abs().max().item() <= 1e-5
    # and by hand from transformers' hidden states: positions start at pad_token_id + 1
    ids = ours.tokenize(SHORT_TEXTS[:2])
    with torch.no_grad():
        h = [hf(torch.tensor([s])).last_hidden_state[0].mean(0) for s in ids]
    assert (got[:2] - torch.stack(h)).abs().max().item() <= 1e-5


def test_plain_torch_path_and_bfloat16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The F.linear path (the GPU's, or a CPU without oneDNN) gives the oneDNN path's numbers; bf16 is close."""
    from superslm.encoders import net

    build_bert_family(tmp_path, "bert", act="gelu_new")
    fast = Encoder.load(tmp_path, device="cpu")
    half = Encoder.load(tmp_path, device="cpu", dtype="bfloat16").embed_batch(SHORT_TEXTS, batch=3)
    monkeypatch.setattr(net, "USE_MKLDNN", False)
    plain = Encoder.load(tmp_path, device="cpu")
    assert not plain.body.net.layers[0].up.fast  # type: ignore[attr-defined]
    a, b = fast.embed_batch(SHORT_TEXTS, batch=3), plain.embed_batch(SHORT_TEXTS, batch=3)
    assert (a - b).abs().max().item() <= 1e-5
    assert half.dtype == torch.float32 and F.cosine_similarity(half, a).min().item() >= 0.99


# --- decoder models -------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_match_transformers(pooling: str, tmp_path: Path) -> None:
    import transformers

    import superslm
    from tests.tiny_models import build_hf_model

    build_hf_model("qwen3", tmp_path)
    model = superslm.load(tmp_path, device="cpu")
    enc = Encoder.from_model(model, pooling=pooling, normalize=True)
    texts = ["The quick brown fox", "def main():\n    return 42", "Zwölf", "a b c d e f g h i j", "The quick"]
    got = enc.embed_batch(texts, batch=3)
    base = transformers.AutoModel.from_pretrained(tmp_path).eval()
    want = []
    for t in texts:
        with torch.no_grad():
            h = base(torch.tensor([model.tokenizer.encode(t)])).last_hidden_state[0]
        want.append(F.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0))
    assert (got - torch.stack(want)).abs().max().item() <= 1e-5
    assert model_kind(tmp_path) == "decoder"
    from superslm.cli import main

    out = tmp_path / "v.npy"
    assert main(["embed", "-m", str(tmp_path), "--pooling", pooling, "--normalize", "-o", str(out), *texts]) == 0
    import numpy as np

    assert (torch.from_numpy(np.load(out)) - got).abs().max().item() <= 1e-5


# --- refusals -------------------------------------------------------------------------------------


def test_bad_input_is_refused(tmp_path: Path) -> None:
    build_bert_family(tmp_path, "bert", max_len=16)
    enc = Encoder.load(tmp_path, device="cpu")
    long_text = "the quick brown fox " * 10
    with pytest.raises(errors.InvalidArgument):
        enc.embed_batch([])
    with pytest.raises(errors.InvalidArgument):
        enc.embed_batch("not a list")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        enc.embed_batch(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(errors.InvalidArgument):
        enc.embed(None)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        enc.embed_batch(["ok"], batch=0)
    with pytest.raises(errors.ContextLengthExceeded):
        enc.embed_batch(["short", long_text], truncate=False)
    with pytest.raises(errors.ContextLengthExceeded):
        enc.embed_tokens([[2] * 17], truncate=False)
    with pytest.raises(errors.TokenOutOfRange):
        enc.embed_tokens([[2, 10_000, 3]])
    with pytest.raises(errors.InvalidArgument):
        enc.embed_tokens([[]])
    # allowed truncation gives the first max_seq_length tokens' vector
    assert torch.equal(enc.embed(long_text), enc.embed_tokens([enc.tokenize([long_text])[0]])[0])
    with pytest.raises(errors.ModelNotFound):
        Encoder.load(tmp_path / "missing")


def test_unsupported_models_are_refused(tmp_path: Path) -> None:
    from tests.tiny_models import build_hf_model

    build_hf_model("llama", tmp_path / "llama")
    with pytest.raises(errors.UnsupportedModel):
        Encoder.load(tmp_path / "llama")
    build_bert_family(tmp_path / "rel", config={"position_embedding_type": "relative_key"})
    with pytest.raises(errors.UnsupportedModel):
        Encoder.load(tmp_path / "rel")
    st = build_sentence_model(tmp_path / "st", "bert", "mean", False, False, "gelu")
    cfg = st / "1_Pooling" / "config.json"
    kept = cfg.read_text()
    # sentence-transformers would pool without the prompt's tokens: refused, not computed otherwise
    edit_json(cfg, include_prompt=False)
    with pytest.raises(errors.UnsupportedModel, match="include_prompt"):
        Encoder.load(st)
    cfg.write_text(kept)
    for bad in ({"prompts": {"q": "query: "}, "default_prompt_name": "p"}, {"prompts": ["query: "]}):
        (st / "config_sentence_transformers.json").write_text(json.dumps(bad))
        with pytest.raises(errors.FormatError):
            Encoder.load(st)
    (st / "config_sentence_transformers.json").unlink()
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_mode": "median"}))
    with pytest.raises(errors.UnsupportedModel):
        Encoder.load(st)
    (st / "modules.json").write_text("[{")
    with pytest.raises(errors.FormatError):
        Encoder.load(st)
    import superslm

    with pytest.raises(errors.UnsupportedModel):
        Encoder.from_model(superslm.load(tmp_path / "llama", device="cpu"), pooling="median")


def test_cli_embed(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from superslm.cli import main

    build_bert_family(tmp_path / "m", "bert")
    enc = Encoder.load(tmp_path / "m", device="cpu")
    assert main(["embed", "--model", str(tmp_path / "m"), "--device", "cpu", "one text", "two"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    want = enc.embed_batch(["one text", "two"])
    assert (torch.tensor([r["embedding"] for r in rows]) - want).abs().max().item() <= 1e-6
    # every line is a text, blank ones too (indices are line numbers); only "\n" ends a line
    lines = ["one text", "", "  ", "two\u2028three\x0c", "two"]
    want = enc.embed_batch(lines)
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "v"  # written as given: np.save(path) would have made v.npy
    assert main(["embed", "-m", str(tmp_path / "m"), "--file", str(tmp_path / "texts.txt"), "-o", str(out)]) == 0
    assert f"to {out}\n" in capsys.readouterr().err and not (tmp_path / "v.npy").exists()
    import numpy as np

    assert (torch.from_numpy(np.load(out)) - want).abs().max().item() <= 1e-6
    monkeypatch.setattr("sys.stdin", io.StringIO("a\n\nb"))
    assert main(["embed", "-m", str(tmp_path / "m")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (torch.tensor([r["embedding"] for r in rows]) - enc.embed_batch(["a", "", "b"])).abs().max() <= 1e-6
    assert main(["embed", "-m", str(tmp_path / "m"), "--no-truncate", "word " * 60]) == 2
    assert "tokens" in capsys.readouterr().err
    # options for decoder models or for --rerank are refused, not ignored
    for extra in (["--pooling", "last"], ["--pooling", "mean"], ["--normalize"], ["--top", "1"]):
        assert main(["embed", "-m", str(tmp_path / "m"), *extra, "x"]) == 2
        err = capsys.readouterr().err
        assert extra[0] in err and len(err.strip().splitlines()) == 1
