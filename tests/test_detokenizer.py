"""StreamDecoder: the pushed text, joined, is exactly the tokenizer's decode of all ids."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.formats.gguf import GGUFFile
from superslm.tokenizer import StreamDecoder, Tokenizer
from tests.test_tokenizer import CORPUS, llama_spm_metadata


@pytest.fixture(scope="module")
def tokenizers(smollm2_gguf: Path, gemma3_gguf: Path) -> dict[str, Tokenizer]:
    gemma = GGUFFile(gemma3_gguf).metadata
    llama_spm = llama_spm_metadata(gemma)  # its decoder strips the prefix space
    return {
        "smollm2": Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata),
        "gemma3": Tokenizer.from_gguf(gemma),
        "llama_spm": Tokenizer.from_gguf(llama_spm),
    }


NAMES = ["smollm2", "gemma3", "llama_spm"]


def _stream(tok: Tokenizer, ids: list[int], skip: bool, rng: random.Random | None = None) -> list[str]:
    """Push every id; with `rng`, save and restore the decoder (through JSON) at random points."""
    dec = StreamDecoder(tok, skip_special_tokens=skip)
    out = []
    for i in ids:
        out.append(dec.push(i))
        if rng is not None and rng.random() < 0.2:
            dec = StreamDecoder.from_state(tok, json.loads(json.dumps(dec.state())))
    out.append(dec.flush())
    return out


@pytest.fixture(scope="module")
def pools(tokenizers: dict[str, Tokenizer]) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per tokenizer, the hard cases: special tokens, single-byte tokens, tokens starting with a space."""
    out = {}
    for name, tok in tokenizers.items():
        table = tok.all_token_bytes()
        singles = [i for i, b in enumerate(table) if len(b) == 1]
        spaces = [i for i, b in enumerate(table[:50000]) if b.startswith(b" ")][:500]
        out[name] = (sorted(tok.special_ids)[:64], singles, spaces)
    return out


def _random_ids(tok: Tokenizer, pools: tuple[list[int], list[int], list[int]], rng: random.Random) -> list[int]:
    specials, singles, spaces = pools
    ids = []
    for _ in range(rng.randint(0, 40)):
        r = rng.random()
        pool = specials if r < 0.12 else singles if r < 0.5 else spaces if r < 0.65 else None
        ids.append(rng.choice(pool) if pool else rng.randrange(tok.vocab_size))
    return ids


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_random_sequences_stream_to_decode(
    name: str, skip: bool, tokenizers: dict[str, Tokenizer], pools: dict
) -> None:
    tok = tokenizers[name]
    rng = random.Random(f"{name}-{skip}")
    for _ in range(150):
        ids = _random_ids(tok, pools[name], rng)
        assert "".join(_stream(tok, ids, skip, rng)) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("name", NAMES)
def test_corpus_streams_to_its_text(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[name]
    for text in CORPUS:
        ids = tok.encode(text)
        for skip in (False, True):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            # valid UTF-8 in, so no piece may carry a broken character
            if "\ufffd" not in text:
                assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("name", NAMES)
def test_a_token_brings_its_leading_space(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[name]
    ids = tok.encode("Hello world, the end of the day", add_special_tokens=False)
    dec = StreamDecoder(tok)
    spaced = 0
    for k, i in enumerate(ids):
        piece, raw = dec.push(i), tok.token_bytes(i)
        # a whole-character token after the first comes out as exactly its text, space included
        if k > 0 and raw.startswith(b" ") and i not in tok.byte_fallback_ids:
            assert piece == raw.decode("utf-8"), (tok.id_to_token(i), piece)
            spaced += 1
    assert spaced >= 3


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_window_stays_small(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers[name]
    ids = tok.encode(" ".join(CORPUS) * 4, add_special_tokens=False)
    dec = StreamDecoder(tok)
    longest = 0
    for i in ids:
        dec.push(i)
        longest = max(longest, len(dec.state()["window"]))
    assert longest <= 12, f"window grew to {longest} tokens over {len(ids)}"


def test_runs_of_invalid_bytes_stay_bounded(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["smollm2"]
    # lone UTF-8 continuation bytes and a lead byte that is never finished: all invalid
    bad = [i for i in range(tok.vocab_size) if len(b := tok.token_bytes(i)) == 1 and 0x80 <= b[0] < 0xC0]
    ids = [bad[k % len(bad)] for k in range(200)] + [bad[0], tok.encode("ok", add_special_tokens=False)[0]]
    dec = StreamDecoder(tok)
    pieces = []
    for i in ids:
        pieces.append(dec.push(i))
        assert len(dec.state()["window"]) <= 40  # a constant: the forced emission keeps it bounded
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids)


def test_bad_input_is_refused(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["smollm2"]
    dec = StreamDecoder(tok)
    with pytest.raises(TokenOutOfRange):
        dec.push(tok.vocab_size)
    with pytest.raises(TokenOutOfRange):
        dec.push(-1)
    with pytest.raises(InvalidArgument):
        dec.push("a")  # type: ignore[arg-type]
    good = dec.state()
    for state in ({}, {**good, "read": 5}, {**good, "window": ["x"]}):
        with pytest.raises(InvalidArgument):
            StreamDecoder.from_state(tok, state)
    with pytest.raises(TokenOutOfRange):
        StreamDecoder.from_state(tok, {**good, "window": [tok.vocab_size]})


@pytest.mark.parametrize("name", NAMES)
def test_pieces_are_single_token_decodes(name: str, tokenizers: dict[str, Tokenizer]) -> None:
    """`Tokenizer.piece`, the detokenizer's remembered context, is decode([id]) with special tokens kept,
    for ordinary, special and byte-fallback ids alike, on every call."""
    tok = tokenizers[name]
    rng = random.Random(5)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)] + sorted(tok.special_ids)[:20]
    ids += sorted(tok.byte_fallback_ids)[:20]
    for _ in range(2):  # the second pass reads what the first remembered
        assert [tok.piece(i) for i in ids] == [tok.backend.decode([i], skip_special_tokens=False) for i in ids]
