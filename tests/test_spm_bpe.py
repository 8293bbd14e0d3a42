"""The lean Gemma tokenizer (`spm_bpe.SentencePieceBPE`) against the `tokenizers` backend built from the
same GGUF metadata (itself checked against transformers in test_tokenizer.py): same ids, same text."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from superslm.errors import InvalidArgument, TokenizerError
from superslm.formats.gguf import GGUFFile
from superslm.tokenizer import Tokenizer
from superslm.tokenizer.spm_bpe import SentencePieceBPE

NORMAL, CONTROL, USER, BYTE = 1, 3, 4, 6


def _vocab(byte_tokens: bool = True, space: bool = True) -> dict[str, Any]:
    """A small Gemma-style vocabulary with the awkward cases: pieces that span a "▁" after another char
    ("a▁b", "b▁", ">▁<"), space-only pieces stored with spaces, overlapping added tokens, chars
    outside the vocabulary."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [CONTROL] * 4
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
    pieces = ["a", "b", "c", "<", ">", "/", "x", "é", "ab", "bc", "abc", "a▁b", "b▁", ">▁<", "▁▁▁", "ca",
              "bca", "cab", "aa", "aaa", "<x", "x>", "</", "é▁", "éé", "▁éé"]
    if space:
        pieces += ["▁", "▁a", "▁ab", "▁abc", "▁<", "▁b"]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    tokens += ["  ", "    ", "\n", "\n\n", "<x>", "<x><y>", "<y>", "<start_of_turn>"]
    types += [USER, USER, USER, USER, CONTROL, CONTROL, USER, CONTROL]
    return {
        "general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }  # fmt: skip


_ALPHABET = ["a", "b", "c", " ", "▁", "<", ">", "/", "x", "y", "é", "z", "☃", "\n", "  ", "<x>", "<x><y>", "<y>",
             "<start_of_turn>", "a▁b", ">▁<", "ab"]


def _random_texts(rng: random.Random, alphabet: list[str], count: int, longest: int) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, longest))) for _ in range(count)]


def _assert_same(lean: Tokenizer, ref: Tokenizer, texts: list[str], id_lists: list[list[int]]) -> None:
    assert isinstance(lean.backend, SentencePieceBPE) and not isinstance(ref.backend, SentencePieceBPE)
    for text in texts:
        for special in (True, False):
            assert lean.encode(text, special) == ref.encode(text, special), repr(text)
    for ids in id_lists:
        for skip in (False, True):
            assert lean.decode(ids, skip) == ref.decode(ids, skip), ids
    for attr in ("kind", "bos_id", "eos_id", "pad_id", "unk_id", "eot_id", "add_bos", "add_eos", "stop_ids",
                 "special_ids", "vocab_size", "byte_fallback_ids"):
        assert getattr(lean, attr) == getattr(ref, attr), attr
    for i in range(0, lean.vocab_size, max(1, lean.vocab_size // 5000)):
        piece = ref.id_to_token(i)
        assert lean.id_to_token(i) == piece and lean.token_to_id(piece) == ref.token_to_id(piece), i
        assert lean.token_bytes(i) == ref.token_bytes(i), i
    for probe in ("  ", "nope", "", "▁▁", "<x>"):
        assert lean.token_to_id(probe) == ref.token_to_id(probe), probe


@pytest.mark.parametrize(("byte_tokens", "space"), [(True, True), (False, True), (True, False)])
def test_small_vocabularies_match_tokenizers(byte_tokens: bool, space: bool) -> None:
    """Merges that span a "▁" (so words may not be cut there), chars spelled by byte pieces or by one fused
    unknown token, a vocabulary without "▁", leftmost-longest added tokens."""
    md = _vocab(byte_tokens, space)
    lean, ref = Tokenizer.from_gguf(md), Tokenizer.from_gguf(md, lean=False)
    rng = random.Random(0)
    texts = _random_texts(rng, _ALPHABET, 1500, 30) + ["", " ", "a b", "ab  abc", "zz☃z", "<x><y><x>", "a\n\n\nb"]
    n = lean.vocab_size
    id_lists = [[rng.randrange(n) for _ in range(rng.randint(0, 12))] for _ in range(300)]
    if byte_tokens:
        # byte runs: valid UTF-8 (é, ☃), invalid, cut short, between other tokens
        byte = {b: 4 + b for b in range(256)}
        id_lists += [[byte[0xC3], byte[0xA9]], [byte[0xE2], byte[0x98]], [byte[0xE2], byte[0x98], byte[0x83], 264 + 1],
                     [byte[0xFF], 264, byte[0x41]], [2, byte[0xC3], 1, byte[0xA9]]]
    _assert_same(lean, ref, texts, id_lists)


def test_odd_vocabularies_match_tokenizers() -> None:
    """A few byte pieces only (an unknown token is held back behind byte pieces and fused across them), an
    unknown piece that joins a "▁" ("UNK▁": no cut after an unknown char), no unknown token (the char is
    dropped), pieces spelled like bytes with a sign ("<0x+1>" decodes as byte 1, as Rust parses it)."""
    tokens = ["<pad>", "<eos>", "<bos>", "UNK", "<0xE2>", "<0x98>", "<0x83>", "a", "b", "▁", "▁a", "UNK▁", "a▁",
              "<0x+1>", "<0x 1>", "<0xé>", "ab", "▁b"]
    md = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [CONTROL] * 3 + [NORMAL] * (len(tokens) - 3),
          "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3}
    rng = random.Random(2)
    texts = _random_texts(rng, ["a", "b", "z", "☃", " ", "▁", "é"], 1500, 12) + ["z☃", "z☃z", "z a", "☃ a"]
    ids = [[rng.randrange(len(tokens)) for _ in range(rng.randint(0, 8))] for _ in range(400)]
    for unk in (True, False):
        if not unk:
            del md["tokenizer.ggml.unknown_token_id"]
        _assert_same(Tokenizer.from_gguf(md), Tokenizer.from_gguf(md, lean=False), texts, ids)


def test_refusals_match_the_tokenizers_build() -> None:
    md = _vocab()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:-1] + ["ab"]
    for lean in (True, False):
        with pytest.raises(TokenizerError, match="duplicate token 'ab'"):
            Tokenizer.from_gguf(md, lean=lean)
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        Tokenizer.from_gguf(_vocab()).encode("a\ud800b")


def test_long_words_are_not_cached() -> None:
    tok = Tokenizer.from_gguf(_vocab())
    tok.encode("ab" * 1000 + "c abc")  # cut before "▁abc" (after "c": no piece joins "c▁")
    assert all(len(w) <= 256 for w in tok.backend._cache) and "▁abc" in tok.backend._cache


def test_gemma3_lean_tokenizer_matches_tokenizers(gemma3_gguf: Path) -> None:
    md = GGUFFile(gemma3_gguf).metadata
    lean, ref = Tokenizer.from_gguf(md), Tokenizer.from_gguf(md, lean=False)
    rng = random.Random(1)
    src = Path(__file__).read_text() + Path(__file__).with_name("test_tokenizer.py").read_text()
    alphabet = list("ab <>/\n\t▁é日本☃🤖.,'\"")
    alphabet += ["  ", "<start_of_turn>", "<end_of_turn>", "</", ">▁</", "\n\n", "\t\t", "<table>", "<0x41>", "the"]
    texts = [src, src.upper(), " ".join(src.split()[::-1])] + _random_texts(rng, alphabet, 400, 60)
    texts += ["".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(200)) for _ in range(20)]
    n = lean.vocab_size
    id_lists = [lean.encode(t) for t in texts[:60]] + [[rng.randrange(n) for _ in range(40)] for _ in range(200)]
    id_lists += [[rng.randrange(256, 512) for _ in range(6)] for _ in range(100)]  # byte pieces: valid or not
    _assert_same(lean, ref, texts, id_lists)


def test_gemma3_tokenizer_memory(gemma3_gguf: Path) -> None:
    """Opening Gemma 3's GGUF leaves its 262k-token arrays in the map, and the lean tokenizer is small: the
    `tokenizers` backend plus parsed arrays took ~140 MB resident, ~480 MB at its peak."""
    code = f"""
import json, resource
from superslm.formats.gguf import GGUFFile
from superslm.tokenizer import Tokenizer
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) / 1024
a = rss(); f = GGUFFile({str(gemma3_gguf)!r}); b = rss()
tok = Tokenizer.from_gguf(f.metadata); tok.encode('warm up the word cache ' * 10); c = rss()
print(json.dumps([b - a, c - b]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    opened, built = json.loads(out.strip().splitlines()[-1])
    assert opened < 20, f"opening the GGUF took {opened:.0f} MB"
    assert built < 60, f"the Gemma 3 tokenizer took {built:.0f} MB"
