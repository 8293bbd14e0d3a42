"""Which tokens a request may sample next beyond its grammar: min_tokens' ban on its stop tokens, and vLLM's
allowed_token_ids and bad_words. Plain Python over token ids; `apply_row` writes them into a grammar bitmask
row (int32 words, bit t % 32 of word t // 32 allows token t)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def bad_word_ids(words: Iterable[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's token sequences of bad words: each word as written, and with one leading space where that is
    another first token of the same length (a word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def banned_tokens(output: Sequence[int], params: Any, stop_ids: Iterable[int],
                  bad_words: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The tokens a sequence with `output` so far may not sample next: its stop tokens (EOS unless ignore_eos, and
    stop_token_ids) while it has fewer than min_tokens, and each bad word's last token where the output ends with
    the rest of that word (a one-token word always)."""
    out: list[int] = []
    if len(output) < params.min_tokens:
        out += params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *stop_ids)
    for ids in bad_words:
        n = len(ids) - 1
        if n == 0 or (len(output) >= n and tuple(output[len(output) - n :]) == ids[:-1]):
            out.append(ids[-1])
    return tuple(out)


def allowed_row(allowed: Iterable[int], words: int) -> torch.Tensor:
    """int32 [words]: a bitmask row with only `allowed`'s bits set."""
    row = [0] * words
    for token in allowed:
        row[token // 32] |= 1 << (token % 32)
    return torch.tensor([_int32(v) for v in row], dtype=torch.int32)


def apply_row(row: torch.Tensor, allowed: torch.Tensor | None, banned: Sequence[int]) -> None:
    """Narrow a bitmask row in place, in two stages that each give way only to the one before: to `allowed` (a row
    of allowed_row; where the grammar's row and it share nothing, the grammar wins), then without the `banned`
    tokens (where nothing would be left, e.g. a grammar or set that allows only a stop token, the bans give way)."""
    if allowed is not None:
        narrowed = row & allowed
        if narrowed.any():
            row.copy_(narrowed)
    if not banned:
        return
    kept = row.clone()
    for token in banned:
        word, bit = divmod(token, 32)
        row[word] = _int32(int(row[word]) & ~(1 << bit))
    if not row.any():
        row.copy_(kept)


def _int32(v: int) -> int:
    """A 32-bit pattern (any Python int) as the signed int32 an int32 tensor stores."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v
