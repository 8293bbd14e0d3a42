"""The KV tensors: one flat array of slots per layer (slot = page * page_size + offset)."""

from __future__ import annotations

import torch


def slot_mapping(block_table: list[int] | tuple[int, ...], start: int, end: int, page_size: int) -> list[int]:
    """The KV slots of positions start..end-1 of a sequence with this block table."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


class KVCache:
    """Keys and values of every layer: k[layer], v[layer] are [num_pages * page_size, kv_heads, head_dim]."""

    def __init__(
        self,
        layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layers, self.num_pages, self.page_size = layers, num_pages, page_size
        shape = (layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def page_bytes(layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page takes across all layers, keys and values."""
        return 2 * layers * page_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
