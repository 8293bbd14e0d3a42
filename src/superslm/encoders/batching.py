"""Texts to packed rows: tokenization with sentence-transformers' truncation, and packing sequences
so that those of equal token count sit together (no token is ever padding)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import normalizers

from superslm.errors import ContextLengthExceeded, InvalidArgument, TokenOutOfRange
from superslm.tokenizer import Tokenizer


@dataclass
class Packed:
    """Sequences laid end to end as flat rows; sequences of equal length are contiguous."""

    #: [N] token ids, token type ids and position ids of every row
    ids: torch.Tensor
    types: torch.Tensor
    positions: torch.Tensor
    #: (first row, number of sequences, their length): rows start .. start + count * length
    groups: tuple[tuple[int, int, int], ...]
    #: the caller's index of each packed sequence, in packed order
    order: list[int]

    def first_rows(self) -> torch.Tensor:
        """[S] the row of each sequence's first token, in packed order."""
        return torch.cat([torch.arange(c, device=self.ids.device) * n + s for s, c, n in self.groups])

    def last_rows(self) -> torch.Tensor:
        """[S] the row of each sequence's last token, in packed order."""
        return self.first_rows() + torch.tensor(
            [n - 1 for _, c, n in self.groups for _ in range(c)], device=self.ids.device
        )


def plan(lengths: Sequence[int], batch: int) -> list[list[int]]:
    """Indices sorted by length, longest first (ties in input order), cut into steps of `batch`."""
    if not isinstance(batch, int) or batch < 1:
        raise InvalidArgument(f"batch must be a positive integer, not {batch!r}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def pack(
    ids: Sequence[Sequence[int]],
    types: Sequence[Sequence[int]] | None,
    indices: Sequence[int],
    pos_offset: int,
    device: torch.device,
) -> Packed:
    """Pack the sequences `indices` of `ids` (and `types`, zeros when None), grouped by length."""
    order = sorted(indices, key=lambda i: -len(ids[i]))
    groups = []
    start = 0
    for length, run in itertools.groupby(order, key=lambda i: len(ids[i])):
        count = len(list(run))
        groups.append((start, count, length))
        start += count * length
    flat = torch.tensor(list(itertools.chain.from_iterable(ids[i] for i in order)), dtype=torch.long)
    if types is None:
        tt = torch.zeros_like(flat)
    else:
        tt = torch.tensor(list(itertools.chain.from_iterable(types[i] for i in order)), dtype=torch.long)
    pos = torch.cat([torch.arange(pos_offset, pos_offset + n).repeat(c) for _, c, n in groups])
    return Packed(flat.to(device), tt.to(device), pos.to(device), tuple(groups), list(order))


def check_texts(texts: Sequence[str], what: str = "texts") -> list[str]:
    """A non-empty list of strings, or InvalidArgument."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise InvalidArgument(f"{what} must be a list of strings")
    out = list(texts)
    if not out:
        raise InvalidArgument(f"{what} is empty")
    for t in out:
        if not isinstance(t, str):
            raise InvalidArgument(f"{what} must be strings, not {type(t).__name__}")
    return out


def check_ids(seqs: Sequence[Sequence[int]], vocab: int, limit: int, truncate: bool) -> list[list[int]]:
    """Token id lists checked against the vocabulary and the length limit (cut to it with `truncate`)."""
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence) or not seqs:
        raise InvalidArgument("token ids must be a non-empty list of lists of integers")
    out = []
    for seq in seqs:
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or not seq:
            raise InvalidArgument("each token id list must be a non-empty list of integers")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in seq):
            raise InvalidArgument("token ids must be integers")
        bad = next((i for i in seq if not 0 <= i < vocab), None)
        if bad is not None:
            raise TokenOutOfRange(f"token id {bad} is outside the vocabulary (size {vocab})")
        if len(seq) > limit:
            if not truncate:
                raise ContextLengthExceeded(f"{len(seq)} tokens, the model takes at most {limit}")
            seq = seq[:limit]
        out.append(list(seq))
    return out


def _lowercases(backend: object) -> bool:
    spec = json.loads(backend.to_str()).get("normalizer") or {}  # type: ignore[attr-defined]
    text = json.dumps(spec)
    return '"Lowercase"' in text or '"lowercase": true' in text


class TextTokens:
    """Texts and text pairs to token ids as sentence-transformers tokenizes them: the model's specials,
    truncation to `max_length` (longest_first for pairs), never padding."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, zero_types: bool, lowercase: bool = False) -> None:
        # our own copy of the backend: tokenizer.json may carry padding and truncation settings
        self.backend = type(tokenizer.backend).from_str(tokenizer.backend.to_str())
        self.backend.no_padding()
        self.backend.enable_truncation(max_length, strategy="longest_first")
        if lowercase and not _lowercases(self.backend):
            # sentence_bert_config.json's do_lower_case, as sentence-transformers applies it
            current = self.backend.normalizer
            self.backend.normalizer = normalizers.Sequence(
                [normalizers.Lowercase()] + ([current] if current is not None else [])
            )
        self.max_length = max_length
        self.zero_types = zero_types
        self.vocab_size = tokenizer.vocab_size

    def encode(
        self, items: Sequence[str] | Sequence[tuple[str, str]], truncate: bool
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(ids, type ids) of each text or (text, text) pair; ContextLengthExceeded if one is too long and
        `truncate` is False."""
        encs = self.backend.encode_batch(list(items), add_special_tokens=True)
        if not truncate:
            for i, e in enumerate(encs):
                if e.overflowing:
                    raise ContextLengthExceeded(
                        f"input {i} has more than {self.max_length} tokens (the model's max_seq_length)"
                    )
        ids = [e.ids for e in encs]
        types = [[0] * len(e.ids) for e in encs] if self.zero_types else [e.type_ids for e in encs]
        return ids, types
