"""The KV tensors: one flat array of slots per layer (slot = page * page_size + offset), and their page formats.

A page format says how keys and values are stored, each on its own (keys and values may differ):
- float pages ("auto": the model's dtype, or "bf16", "fp16", "fp32"): [layers, slots, kv_heads, head_dim];
- int8 pages ("int8" = "k8v8"): per token and kv head, head_dim int8 codes and their float32 scale packed in
  one row of head_dim + 4 bytes ([layers, slots, kv_heads, head_dim + 4], dtype int8), x = code * scale with
  scale = max |x| / 127. The scale lives beside its codes so that whatever copies raw page rows (prefix
  handles, save / restore, page moves) copies both, and a cache of one format never fits another's shape.
The tensor's dtype names its format to every reader: int8 rows are codes and a scale, float rows are values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from superslm.errors import InvalidArgument

#: bytes of the float32 scale after each int8 row's codes
SCALE_BYTES = 4

_FLOAT_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp32": torch.float32, "float32": torch.float32}
#: formats with 4-bit rows: they need a Hadamard rotation of each head first (outliers), which is not built yet
_FOUR_BIT = ("k8v4", "k4v4", "k4v8", "int4")


@dataclass(frozen=True)
class KVFormat:
    """A KV page format: `key_bits` and `value_bits` 8 for int8 rows, 0 for float rows of `dtype` (None: the
    model's dtype)."""

    name: str
    key_bits: int = 0
    value_bits: int = 0
    dtype: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        return bool(self.key_bits or self.value_bits)

    def storage(self, bits: int, head_dim: int, model_dtype: torch.dtype) -> tuple[torch.dtype, int]:
        """(dtype, last dimension) of the keys' (bits = key_bits) or the values' tensor."""
        if bits == 8:
            return torch.int8, head_dim + SCALE_BYTES
        return (self.dtype or model_dtype), head_dim

    def row_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's key and value for one kv head."""
        total = 0
        for bits in (self.key_bits, self.value_bits):
            dtype, width = self.storage(bits, head_dim, model_dtype)
            total += width * torch.empty((), dtype=dtype).element_size()
        return total


def kv_format(kv: str | KVFormat | None) -> KVFormat:
    """The format named `kv`: "auto" (or None; the model's dtype), "bf16", "fp16", "fp32", "int8" / "k8v8"."""
    if isinstance(kv, KVFormat):
        return kv
    if kv is None:
        return KVFormat("auto")
    if not isinstance(kv, str):
        raise InvalidArgument(f"kv must be a format name, got {kv!r}")
    name = kv.strip().lower()
    if name == "auto":
        return KVFormat("auto")
    if name in _FLOAT_NAMES:
        return KVFormat(name, dtype=_FLOAT_NAMES[name])
    if name in ("int8", "k8v8"):
        return KVFormat("int8", 8, 8)
    if name in _FOUR_BIT:
        raise InvalidArgument(f"KV format {kv!r}: 4-bit pages need a rotation of each head that is not built yet; "
                              "use 'int8' (or a float format)")
    raise InvalidArgument(f"unknown KV format {kv!r}: one of auto, bf16, fp16, fp32, int8 (= k8v8)")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 rows [..., D + 4]: D codes round(x / scale) in -127..127, then scale = max |x| / 127
    as float32 bytes. A row of zeros (or one with a NaN scale) gets codes 0; a NaN quotient (inf / inf) code 0.
    decode_layers.cpp quantize_row computes the same bits."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    # one NaN bit pattern whatever the input's payload (the C++ plan writes the same)
    scale = torch.where(scale.isnan(), torch.full_like(scale, float("nan")), scale)
    q = torch.where(scale > 0, xf / scale, 0.0).round().clamp(-127, 127).nan_to_num(0.0)
    return torch.cat([q.to(torch.int8), scale.view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] -> values [..., D] in `dtype` (code * scale in float32, then one cast)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, kv_heads, D] into cache [slots, kv_heads, width] at `slots`, in the cache's format."""
    cache.index_copy_(0, slots, quantize_rows(x) if cache.dtype == torch.int8 else x.to(cache.dtype))


def read_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of cache [slots, ..., width] at `index` (any shape of slot ids) in `dtype`: only those rows
    are gathered and, int8 rows, dequantized."""
    rows = cache[index]
    return dequantize_rows(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)


def slot_mapping(block_table: list[int] | tuple[int, ...], start: int, end: int, page_size: int) -> list[int]:
    """The KV slots of positions start..end-1 of a sequence with this block table."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


class KVCache:
    """Keys and values of every layer: k[layer], v[layer] are [num_pages * page_size, kv_heads, width], width
    head_dim for float pages, head_dim + 4 for int8 rows (`kv`: the page format, see kv_format)."""

    def __init__(
        self,
        layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv: str | KVFormat | None = "auto",
    ) -> None:
        fmt = kv_format(kv)
        if fmt.quantized:
            if head_dim % 4:
                raise InvalidArgument(f"int8 KV pages need a head_dim that is a multiple of 4, not {head_dim}")
            if torch.device(device).type != "cpu":
                # the Triton kernels (and so the decode graphs) read float pages only: refused, not run wrong
                raise InvalidArgument(f"int8 KV pages run on the CPU for now, not on {torch.device(device).type}")
        self.layers, self.num_pages, self.page_size, self.format = layers, num_pages, page_size, fmt
        self.head_dim = head_dim
        kd, kw = fmt.storage(fmt.key_bits, head_dim, dtype)
        vd, vw = fmt.storage(fmt.value_bits, head_dim, dtype)
        self.k = torch.zeros((layers, num_pages * page_size, kv_heads, kw), dtype=kd, device=device)
        self.v = torch.zeros((layers, num_pages * page_size, kv_heads, vw), dtype=vd, device=device)

    @staticmethod
    def page_bytes(layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv: str | KVFormat | None = "auto") -> int:
        """Bytes one page takes across all layers, keys and values, in format `kv`."""
        return layers * page_size * kv_heads * kv_format(kv).row_bytes(head_dim, dtype)
