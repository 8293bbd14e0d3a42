"""Tokenizer: ids and text against transformers' GGUF tokenizers (the oracle), plus API invariants."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import pre_tokenizers

from superslm.errors import InvalidArgument, ModelNotFound, TokenizerError, TokenOutOfRange
from superslm.formats.gguf import GGUFFile
from superslm.tokenizer import KNOWN_PRE_TYPES, Tokenizer
from tests.gguf_plain_maps import plain_maps

# English, code, emoji, CJK, Arabic, odd whitespace, special tokens written in the text, empty.
CORPUS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it? I'll say we've won.",
    "def f(x):\n    return {'a': x ** 2, \"b\": [1, 2, 3]}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "中文测试，你好世界。日本語のテキスト、한국어 텍스트",
    "مرحبا بالعالم، كيف حالك؟",
    "tabs\tand\t\ttabs",
    "   many     spaces   ",
    " leading space",
    "trailing space ",
    "\n",
    "\n\n\nx\n\n",
    "a\r\nb\r\n\r\n",
    "12345 3.14159 1,000,000 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<eos>",
    "Ünïcödé ÀÉÎõü ß ﬁ ½ ² ™ \u00a0nbsp \u200bzwsp \u2028ls",
    "HTTPServer CamelCaseWords snake_case_words kebab-case-words",
]

MODELS = [pytest.param(name, marks=pytest.mark.slow) for name in ("smollm2", "gemma3")]  # real models' tokenizers


def _transformers(path: Path) -> Any:
    from transformers import AutoTokenizer

    with plain_maps():  # the same tokenizer, its GGUF read ~3x faster (Gemma's: ~13 -> ~4.5 s)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# transformers ignores tokenizer.ggml.pre "smollm" and splits with plain GPT-2 rules; SmolLM2's own
# tokenizer.json (and llama.cpp) first isolate every numeric character. We follow the model's own, so
# the oracle gets that one pre-tokenizer back; everything else stays transformers' GGUF loader.
SMOLLM_PRE = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
)


def _pair(path: Path) -> tuple[Tokenizer, Any]:
    md = GGUFFile(path).metadata
    ref = _transformers(path)
    if md.get("tokenizer.ggml.pre") == "smollm":
        ref.backend_tokenizer.pre_tokenizer = SMOLLM_PRE
    return Tokenizer.from_gguf(md), ref


# Built once per module: Gemma's transformers tokenizer takes seconds to build.
@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf: Path) -> tuple[Tokenizer, Any]:
    return _pair(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma3_pair(gemma3_gguf: Path) -> tuple[Tokenizer, Any]:
    return _pair(gemma3_gguf)


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    """(name, ours, transformers') for each real model."""
    ours, ref = request.getfixturevalue(f"{request.param}_pair")
    return request.param, ours, ref


def test_gguf_encode_decode_match_transformers(model: tuple[str, Tokenizer, Any]) -> None:
    _, ours, ref = model
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for special in (True, False):
        want = [ref.encode(t, add_special_tokens=special) for t in CORPUS]
        assert ours.encode_batch(CORPUS, add_special_tokens=special) == want


def test_smollm_differs_from_plain_gpt2_split_only_on_numerals(smollm2_pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = smollm2_pair
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    try:
        for text in CORPUS:
            same = ours.encode(text) == ref.encode(text)
            assert same or any(c.isnumeric() and not c.isascii() for c in text), text
    finally:
        ref.backend_tokenizer.pre_tokenizer = SMOLLM_PRE


def test_special_tokens_match_transformers(model: tuple[str, Tokenizer, Any]) -> None:
    name, ours, ref = model
    assert ours.vocab_size == len(ref)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.add_bos == (ref.encode("x")[:1] == [ref.bos_token_id])
    assert ours.special_ids == {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.chat_template == ref.chat_template
    # stop ids: eos and the end-of-turn token the chat format closes a turn with
    eot = {"smollm2": "<|im_end|>", "gemma3": "<end_of_turn>"}[name]
    assert ours.eos_id in ours.stop_ids and ours.token_to_id(eot) in ours.stop_ids
    assert ours.stop_ids <= ours.special_ids


def test_vocabulary_lookups(model: tuple[str, Tokenizer, Any]) -> None:
    _, ours, ref = model
    rng = random.Random(0)
    sample = rng.sample(range(ours.vocab_size), 2000)
    assert [ours.id_to_token(i) for i in sample] == ref.convert_ids_to_tokens(sample)
    assert all(ours.token_to_id(ours.id_to_token(i)) == i for i in sample)
    assert ours.token_to_id("no such token \u2603\u2603") is None
    for bad in (-1, ours.vocab_size):
        with pytest.raises(TokenOutOfRange):
            ours.id_to_token(bad)
        with pytest.raises(TokenOutOfRange):
            ours.decode([5, bad])
        with pytest.raises(TokenOutOfRange):
            ours.token_bytes(bad)
    with pytest.raises(InvalidArgument):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ours.encode_batch(["ok", None])  # type: ignore[list-item]


def test_token_bytes_make_the_text(model: tuple[str, Tokenizer, Any]) -> None:
    name, ours, _ = model
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(ours.token_bytes(i) for i in ids) == ours.decode(ids).encode("utf-8")
    # one token alone: where it decodes to whole characters, its bytes are that text
    table = ours.all_token_bytes()
    assert len(table) == ours.vocab_size
    for i in random.Random(1).sample(range(ours.vocab_size), 20000):
        text = ours.decode([i])
        assert table[i] == ours.token_bytes(i)
        if "\ufffd" not in text:
            assert table[i] == text.encode("utf-8"), (i, ours.id_to_token(i))
    if name == "gemma3":
        assert ours.token_bytes(ours.token_to_id("<0xF0>")) == b"\xf0"
        assert ours.token_bytes(ours.token_to_id("▁the")) == b" the"


def test_gemma_build_is_fast(gemma3_gguf: Path) -> None:
    md = GGUFFile(gemma3_gguf).metadata
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(md)
    elapsed = time.perf_counter() - start
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    assert elapsed < 5.0, f"building the 262k Gemma vocabulary took {elapsed:.1f} s"


def test_a_cached_gguf_tokenizer_equals_the_built_one(gemma3_pair: tuple[Tokenizer, Any], gemma3_gguf: Path,
                                                      tmp_path: Path) -> None:
    """The built `tokenizers` backend is stored once (tokenizer.json + facts) and read back equal to the lean
    backend Gemma loads with: ids, text, specials; a damaged entry is rebuilt, never an error."""
    from superslm.tokenizer import gguf_cache

    built = gemma3_pair[0]
    g = GGUFFile(gemma3_gguf)
    folder = tmp_path / gguf_cache.cache_key(g.metadata_digest())
    first = Tokenizer.from_gguf(g.metadata, cache=folder, lean=False)
    assert (folder / "facts.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]
    cached = Tokenizer.from_gguf({}, cache=folder)  # no metadata needed: the entry is complete
    for tok in (first, cached):
        for text in CORPUS:
            assert tok.encode(text) == built.encode(text)
            assert tok.decode(built.encode(text)) == built.decode(built.encode(text))
        for attr in ("kind", "bos_id", "eos_id", "pad_id", "unk_id", "eot_id", "eom_id", "add_bos", "add_eos",
                     "chat_template", "stop_ids", "special_ids", "vocab_size", "byte_fallback_ids"):
            assert getattr(tok, attr) == getattr(built, attr), attr
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf({}, cache=folder)  # damaged and no metadata to rebuild from
    assert Tokenizer.from_gguf(g.metadata, cache=folder, lean=False).encode(CORPUS[2]) == built.encode(CORPUS[2])
    assert Tokenizer.from_gguf({}, cache=folder).encode(CORPUS[2]) == built.encode(CORPUS[2])  # rewritten


# --- other GGUF tokenizer kinds, written as small GGUF files and checked against transformers ------


def _write_gguf(path: Path, md: dict[str, Any]) -> None:
    """A tensor-less GGUF holding `md` (gguf-py's writer; the arrays typed as llama.cpp writes them)."""
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    for key, value in md.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif value and isinstance(value[0], float):
            w.add_array(key, [float(v) for v in value])
        elif value and isinstance(value[0], int):
            w.add_array(key, [int(v) for v in value])
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_against_transformers(path: Path) -> None:
    ours, ref = Tokenizer.from_gguf(GGUFFile(path).metadata), _transformers(path)
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == ref.decode(ids)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(pre: str, smollm2_gguf: Path, tmp_path: Path) -> None:
    md = dict(GGUFFile(smollm2_gguf).metadata, **{"tokenizer.ggml.pre": pre})
    _write_gguf(tmp_path / "model.gguf", md)
    _check_against_transformers(tmp_path / "model.gguf")


def llama_spm_metadata(gemma: dict[str, Any], n: int = 20000) -> dict[str, Any]:
    """Tokenizer metadata of a Llama-style SentencePiece vocabulary (prefix space, merges ranked by
    score): Gemma's first `n` pieces and every one-character piece (Gemma keeps those at the end)."""
    tokens = gemma["tokenizer.ggml.tokens"]
    keep = [i for i, t in enumerate(tokens) if i < n or len(t) == 1]
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "llama"}
    for key in ("tokens", "scores", "token_type"):
        values = gemma[f"tokenizer.ggml.{key}"]
        md[f"tokenizer.ggml.{key}"] = [values[i] for i in keep]
    md.update(
        {
            "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3,
        }
    )
    return md


def test_llama_sentencepiece_matches_transformers(smollm2_gguf: Path, gemma3_gguf: Path, tmp_path: Path) -> None:
    md = {k: v for k, v in GGUFFile(smollm2_gguf).metadata.items() if not k.startswith("tokenizer.")}
    md.update(llama_spm_metadata(GGUFFile(gemma3_gguf).metadata))
    _write_gguf(tmp_path / "model.gguf", md)
    _check_against_transformers(tmp_path / "model.gguf")


# One name per distinct split rule: every rule compiles and byte-level BPE stays lossless under it.
@pytest.mark.parametrize(
    "pre",
    "gpt-2 default smollm llama-bpe dbrx qwen2 qwen35 tekken gpt-4o deepseek-llm deepseek-coder deepseek-v3 "
    "falcon bloom viking".split(),
)
def test_every_pre_tokenizer_round_trips(pre: str, smollm2_gguf: Path) -> None:
    assert pre in KNOWN_PRE_TYPES
    tok = Tokenizer.from_gguf(dict(GGUFFile(smollm2_gguf).metadata, **{"tokenizer.ggml.pre": pre}))
    for text in CORPUS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_bad_gguf_metadata_is_refused(smollm2_gguf: Path) -> None:
    md = GGUFFile(smollm2_gguf).metadata
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_gguf(dict(md, **{"tokenizer.ggml.pre": "no-such-pre"}))
    with pytest.raises(TokenizerError, match="bert"):
        Tokenizer.from_gguf(dict(md, **{"tokenizer.ggml.model": "bert"}))
    without = {k: v for k, v in md.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf(without)
    with pytest.raises(TokenizerError, match="token types"):
        Tokenizer.from_gguf(dict(md, **{"tokenizer.ggml.token_type": [1, 1]}))
    dup = list(md["tokenizer.ggml.tokens"])
    dup[100] = dup[101]
    with pytest.raises(TokenizerError, match="duplicate"):
        Tokenizer.from_gguf(dict(md, **{"tokenizer.ggml.tokens": dup}))


# --- Hugging Face folders --------------------------------------------------------------------------


def test_from_folder_matches_transformers(model: tuple[str, Tokenizer, Any], tmp_path: Path) -> None:
    # the folder transformers writes for its tokenizer must load into the same tokenizer
    _, gguf_tok, ref = model
    ref.save_pretrained(tmp_path)
    ours = Tokenizer.from_folder(tmp_path)
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (gguf_tok.bos_id, gguf_tok.eos_id, gguf_tok.add_bos)
    assert ours.special_ids == gguf_tok.special_ids and ours.kind == gguf_tok.kind
    assert ours.chat_template == ref.chat_template


def test_from_folder_reads_the_config_files(smollm2_pair: tuple[Tokenizer, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _, ref = smollm2_pair
    ref.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # tokenizer.json's post-processor outranks add_bos_token (as in transformers 5); named templates
    # give "default"; generation_config adds stop ids
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config.update(add_bos_token=True, chat_template=templates)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    ours, saved = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("hi") == saved.encode("hi") and not ours.add_bos
    assert ours.stop_ids == {0, 2}
    assert ours.chat_template == "D"
    # without a post-processor the config's flags are what there is
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.add_bos and ours.encode("hi") == [ours.bos_id, *ours.encode("hi", add_special_tokens=False)]

    with pytest.raises(ModelNotFound):
        Tokenizer.from_folder(tmp_path / "missing")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_a_long_text_encodes_with_the_gil_released(smollm2_pair: tuple[Tokenizer, Any]) -> None:
    """Encoding a 4 MB chat held the GIL for seconds: a server's /health and every stream waited. A long text
    goes through the Rust library's batch call, which releases it (the same ids as transformers'), so a thread
    that wakes every 5 ms keeps waking."""
    import threading
    import time

    tok, ref = smollm2_pair
    text = "The quick brown fox, 12 times; jumps over\n the lazy dog. " * 20000  # 1.2 MB
    gaps: list[float] = []
    done = threading.Event()

    def beat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    th = threading.Thread(target=beat)
    th.start()
    start = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    took = time.perf_counter() - start
    done.set()
    th.join()
    assert ids == ref.encode(text, add_special_tokens=False)
    assert max(gaps) < max(0.5 * took, 0.1), (max(gaps), took)
