"""Embeddings from a decoder model: our paged forward pass over a throwaway KV cache, then pooling
of the final-norm hidden states (last token or mean)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from superslm.cache.kv import KVCache
from superslm.encoders.batching import pack
from superslm.encoders.pooling import finish, pool
from superslm.errors import ContextLengthExceeded, InvalidArgument, UnsupportedModel
from superslm.kernels.attention import AttnMetadata

if TYPE_CHECKING:
    from superslm.model import Model

_PAGE = 16


class DecoderBody:
    """A loaded decoder `Model` as an encoder body (see encoder.Body)."""

    def __init__(self, model: Model, modes: tuple[str, ...], normalize: bool, max_length: int | None) -> None:
        if not getattr(model.net, "has_head", False):
            raise UnsupportedModel(f"{model.name} was loaded without all its layers (no final norm)")
        self.model, self.modes, self.normalize = model, modes, normalize
        self.net = model.net
        self.dim = model.arch.dim * len(modes)
        limit = model.arch.context
        if max_length is not None:
            if not isinstance(max_length, int) or max_length < 1:
                raise InvalidArgument(f"max_length must be a positive integer, not {max_length!r}")
            limit = min(limit, max_length)
        self.max_length = limit
        self.vocab_size = min(model.tokenizer.vocab_size, model.arch.vocab)
        self.device = model.device

    def encode(self, texts: Sequence[str], truncate: bool) -> tuple[list[list[int]], None]:
        ids = self.model.tokenizer.encode_batch(texts)
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidArgument(f"text {i} has no tokens (the model adds no BOS)")
            if len(seq) > self.max_length:
                if not truncate:
                    raise ContextLengthExceeded(f"text {i} has {len(seq)} tokens, at most {self.max_length} fit")
                ids[i] = seq[: self.max_length]
        return ids, None

    def run(
        self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]] | None, indices: Sequence[int]
    ) -> tuple[list[int], torch.Tensor]:
        packed = pack(ids, None, indices, 0, self.device)
        a = self.net.arch
        lengths = [n for _, c, n in packed.groups for _ in range(c)]
        # each sequence gets its own run of pages, in packed order
        pages = [(n + _PAGE - 1) // _PAGE for n in lengths]
        firsts = [sum(pages[:i]) for i in range(len(pages))]
        kv = KVCache(len(self.net.layers), sum(pages), _PAGE, a.kv_heads, a.head_dim, self.net.dtype, self.device)
        slots = torch.cat([torch.arange(n) + p * _PAGE for n, p in zip(lengths, firsts)]).to(self.device)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        meta = AttnMetadata(
            positions=packed.positions,
            slot_mapping=slots,
            query_start=tuple(starts),
            seq_lens=tuple(lengths),
            block_tables=tuple(tuple(range(p, p + k)) for p, k in zip(firsts, pages)),
            page_size=_PAGE,
        )
        h = self.net.final_norm(self.net.run_layers(self.net.embed(packed.ids), meta, kv.k, kv.v))
        return packed.order, finish(pool(h, packed, self.modes), (), self.normalize)
