"""The KV tensors: one flat array of slots per layer (slot = page * page_size + offset), and their page formats.

A page format says how keys and values are stored, each on its own (keys and values may differ: "k8v4" is int8
keys and 4-bit values):
- float pages ("bf16", "fp16", "fp32"; "auto" where the float pages fit, see `choose_format`):
  [layers, slots, kv_heads, head_dim] of that dtype;
- int8 rows ("int8" = "k8v8"): per token and kv head, head_dim int8 codes and their float32 scale packed in
  one row of head_dim + 4 bytes ([layers, slots, kv_heads, head_dim + 4], dtype int8), x = code * scale with
  scale = max |x| / 127;
- 4-bit rows ("k4v4" = "int4", and the 4-bit half of "k8v4" / "k4v8"): each head's vector rotated first,
  r = H (signs * x) with H the orthonormal block Walsh-Hadamard transform (`rotation_block`) and fixed
  random signs, so that an outlier channel spreads over the whole head; then head_dim / 2 bytes of codes
  (two a byte, element 2i in the low nibble, code = round(r / scale) + 8 in 1..15) and the float32 scale
  max |r| / 7 after them: [.., head_dim / 2 + 4], dtype uint8. H is orthogonal, so q . k = (R q) . (R k) and
  sum p v = R^T (sum p R v): the attention kernels rotate each query head once, attend over the rotated rows
  as they are, and rotate each output head back once (`read_stored`), never un-rotating a page.
The scale lives beside its codes so that whatever copies raw page rows (prefix handles, save / restore, page
moves) copies both, and a cache of one format never fits another's shape. The tensor's dtype names its format
to every reader: int8 rows are codes and a scale, uint8 rows rotated 4-bit codes and a scale, float rows values.
`write_rows` and `read_rows` take and give plain values in every format.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from superslm.errors import InvalidArgument

#: bytes of the float32 scale after each int8 or 4-bit row's codes
SCALE_BYTES = 4
#: the largest Hadamard block a head is rotated in (Gemma 3's 256-wide heads rotate whole)
MAX_BLOCK = 256
#: the seed of the rotation's signs: fixed, so pages written by one process read the same in another
ROTATION_SEED = 0x4B56
#: 4-bit rows need head_dim a multiple of this (the rotation's smallest block and the kernels' vectors)
Q4_MULTIPLE = 32

_FLOAT_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp32": torch.float32, "float32": torch.float32}
#: name -> (key bits, value bits) of the quantized formats
_QUANT_NAMES = {"int8": (8, 8), "k8v8": (8, 8), "k8v4": (8, 4), "k4v8": (4, 8), "k4v4": (4, 4), "int4": (4, 4)}
_CANONICAL = {(8, 8): "int8", (8, 4): "k8v4", (4, 8): "k4v8", (4, 4): "k4v4"}

# the unrotated 4-bit comparison of benchmarks/kv_quality.py flips this (and only that): not a user format,
# since plain 4-bit rows break sub-1B models; readers then see the same uint8 rows without the rotation
_ROTATE = True


@dataclass(frozen=True)
class KVFormat:
    """A KV page format: `key_bits` and `value_bits` 8 for int8 rows, 4 for rotated 4-bit rows, 0 for float
    rows of `dtype` (None: the model's dtype). Name "auto" is the format `choose_format` picks per engine."""

    name: str
    key_bits: int = 0
    value_bits: int = 0
    dtype: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        return bool(self.key_bits or self.value_bits)

    @property
    def auto(self) -> bool:
        return self.name == "auto"

    def storage(self, bits: int, head_dim: int, model_dtype: torch.dtype) -> tuple[torch.dtype, int]:
        """(dtype, last dimension) of the keys' (bits = key_bits) or the values' tensor."""
        if bits == 8:
            return torch.int8, head_dim + SCALE_BYTES
        if bits == 4:
            return torch.uint8, head_dim // 2 + SCALE_BYTES
        return (self.dtype or model_dtype), head_dim

    def row_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's key and value for one kv head."""
        total = 0
        for bits in (self.key_bits, self.value_bits):
            dtype, width = self.storage(bits, head_dim, model_dtype)
            total += width * torch.empty((), dtype=dtype).element_size()
        return total


def kv_format(kv: str | KVFormat | None) -> KVFormat:
    """The format named `kv`: "auto" (or None; see `choose_format`), "bf16", "fp16", "fp32", "int8" / "k8v8",
    "k8v4", "k4v8", "k4v4" / "int4" (kN: keys in N-bit rows, vM: values in M-bit rows)."""
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
    if name in _QUANT_NAMES:
        bits = _QUANT_NAMES[name]
        return KVFormat(_CANONICAL[bits], *bits)
    raise InvalidArgument(f"unknown KV format {kv!r}: one of auto, bf16, fp16, fp32, int8 (= k8v8), k8v4, k4v8, "
                          "k4v4 (= int4)")


def check_format(fmt: KVFormat, head_dim: int, device: torch.device | str) -> None:
    """Refuse `fmt` (InvalidArgument) where its rows cannot be built or read: a head_dim the rows cannot split,
    a device whose kernels do not read them."""
    if not fmt.quantized:
        return
    if head_dim % 4:
        raise InvalidArgument(f"int8 / 4-bit KV pages need a head_dim that is a multiple of 4, not {head_dim}")
    if 4 in (fmt.key_bits, fmt.value_bits) and head_dim % Q4_MULTIPLE:
        raise InvalidArgument(f"4-bit KV pages ({fmt.name}) rotate each head in Hadamard blocks of "
                              f"{Q4_MULTIPLE} or more: head_dim {head_dim} is not a multiple of {Q4_MULTIPLE}")
    if torch.device(device).type != "cpu":
        # the Triton kernels (and so the decode graphs) read float pages only: refused, not run wrong
        raise InvalidArgument(f"{fmt.name} KV pages run on the CPU for now, not on {torch.device(device).type}")


# --- int8 rows ------------------------------------------------------------------------------------------------


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


# --- the rotation of 4-bit rows ---------------------------------------------------------------------------------


def rotation_block(head_dim: int) -> int:
    """The Hadamard block a head of `head_dim` is rotated in: the largest power of two <= MAX_BLOCK dividing it."""
    b = 1
    while b * 2 <= MAX_BLOCK and head_dim % (b * 2) == 0:
        b *= 2
    return b


@functools.lru_cache(maxsize=8)
def rotation_signs(head_dim: int) -> torch.Tensor:
    """The rotation's ±1 float32 signs [head_dim]: seeded on the CPU generator, the same on every machine (the
    draw of kernels/hadamard.py random_signs)."""
    g = torch.Generator(device="cpu").manual_seed(ROTATION_SEED)
    bits = torch.randint(0, 2, (head_dim,), generator=g, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def _fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each run of `block` values of float32 x [..., D] (its own
    inverse). Butterflies, elementwise: a row's bits never depend on the other rows (a matmul's could)."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block, block)
    h = 1
    while h < block:
        v = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, c = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + c, a - c), -2).view(y.shape)
        h *= 2
    return (y * (1.0 / math.sqrt(block))).view(shape)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x per head for x [..., head_dim], in float32: signs, then the block Hadamard transform."""
    d = x.shape[-1]
    if not _ROTATE:
        return x.float()
    return _fwht(x.float() * rotation_signs(d).to(x.device), rotation_block(d))


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """R^T x per head (the inverse of `rotate`), in float32."""
    d = x.shape[-1]
    if not _ROTATE:
        return x.float()
    return _fwht(x.float(), rotation_block(d)) * rotation_signs(d).to(x.device)


# --- 4-bit rows ---------------------------------------------------------------------------------------------------


def quantize_rows4(r: torch.Tensor) -> torch.Tensor:
    """Rotated values r [..., D] -> 4-bit rows [..., D / 2 + 4] (uint8): codes round(r / scale) + 8 in 1..15,
    element 2i in byte i's low nibble and 2i + 1 in its high one, then scale = max |r| / 7 as float32 bytes. A row
    of zeros (or with a NaN scale) gets codes 8 (zero); a NaN quotient code 8."""
    rf = r.float()
    scale = rf.abs().amax(-1, keepdim=True) / 7
    scale = torch.where(scale.isnan(), torch.full_like(scale, float("nan")), scale)
    q = torch.where(scale > 0, rf / scale, 0.0).round().clamp(-7, 7).nan_to_num(0.0).to(torch.uint8) + 8
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return torch.cat([packed, scale.view(torch.uint8)], -1)


def dequantize_rows4(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """4-bit rows [..., D / 2 + 4] -> the rotated values [..., D] in `dtype` ((code - 8) * scale in float32)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    codes = rows[..., :-SCALE_BYTES]
    q = torch.stack(((codes & 15), (codes >> 4)), -1).flatten(-2).float() - 8
    return (q * scale).to(dtype)


def rotated(cache: torch.Tensor) -> bool:
    """Whether `read_stored` gives this cache's rows in the rotated basis (4-bit rows)."""
    return cache.dtype == torch.uint8 and _ROTATE


# --- every format -----------------------------------------------------------------------------------------------


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, kv_heads, D] (values) into cache [slots, kv_heads, width] at `slots`, in the cache's format."""
    if cache.dtype == torch.int8:
        rows = quantize_rows(x)
    elif cache.dtype == torch.uint8:
        rows = quantize_rows4(rotate(x))
    else:
        rows = x.to(cache.dtype)
    cache.index_copy_(0, slots, rows)


def read_stored(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of cache [slots, ..., width] at `index` in `dtype`, in the cache's own basis: the values of float
    and int8 rows, the rotated values of 4-bit rows (`rotated`). Only those rows are gathered and dequantized."""
    rows = cache[index]
    if cache.dtype == torch.int8:
        return dequantize_rows(rows, dtype)
    if cache.dtype == torch.uint8:
        return dequantize_rows4(rows, dtype)
    return rows.to(dtype)


def read_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of cache [slots, ..., width] at `index` (any shape of slot ids) in `dtype`, in every format:
    only those rows are gathered and dequantized (4-bit rows also rotated back)."""
    if cache.dtype == torch.uint8:
        return unrotate(read_stored(cache, index, torch.float32)).to(dtype)
    return read_stored(cache, index, dtype)


def values_dtype(k_cache: torch.Tensor) -> torch.dtype:
    """The dtype of the values beside a KVCache's keys `k_cache` (a mixed format's differs); the keys' own for a
    tensor KVCache did not make."""
    return getattr(k_cache, "kv_values_dtype", k_cache.dtype)


def slot_mapping(block_table: list[int] | tuple[int, ...], start: int, end: int, page_size: int) -> list[int]:
    """The KV slots of positions start..end-1 of a sequence with this block table."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


# --- "auto" -------------------------------------------------------------------------------------------------------

#: measured perplexity loss (perplexity over the model dtype's pages', minus 1) of each quantized format by model
#: size class: benchmarks/kv_quality.py, 20,480 tokens, the worse of SmolLM2-135M and Gemma-3-270M (docs/
#: benchmarks.md, "KV page formats"). A 4-bit format without a figure for a class is never picked for it
MEASURED_LOSS: dict[str, dict[str, float]] = {
    "<1B": {"int8": 0.0032, "k8v4": 0.0159, "k4v4": 0.3101},
}
#: "auto" never picks a format whose measured loss is above this
AUTO_MAX_LOSS = 0.03
#: the quantized formats "auto" tries after the model dtype's pages, most precise first
AUTO_ORDER = ("int8", "k8v4", "k4v4")


def size_class(parameters: int) -> str:
    """The MEASURED_LOSS class of a model with this many parameters."""
    if parameters < 1_000_000_000:
        return "<1B"
    return "1-4B" if parameters < 4_000_000_000 else ">=4B"


def auto_allowed(name: str, parameters: int) -> bool:
    """Whether "auto" may pick quantized format `name` for a model of `parameters`: a measured loss within
    AUTO_MAX_LOSS; 8-bit rows also where that size is not measured (their loss shrinks as models grow), 4-bit
    rows never unmeasured (plain 4-bit breaks sub-1B models; rotated, each size class is measured first)."""
    loss = MEASURED_LOSS.get(size_class(parameters), {}).get(name)
    if loss is None:
        return 4 not in _QUANT_NAMES[name]
    return loss <= AUTO_MAX_LOSS


def choose_format(parameters: int, head_dim: int, device: torch.device | str, fits) -> KVFormat:
    """The format "auto" stands for: the model dtype's float pages where `fits(format)` (the slots' whole contexts
    fit the KV budget in it), else the first of AUTO_ORDER that `auto_allowed` and this head_dim and device take
    and that fits; where none fits, the allowed one holding the most tokens (the last); float pages where none
    is allowed (a GPU, whose kernels read float pages only)."""
    floats = KVFormat("auto")
    if fits(floats):
        return floats
    allowed = []
    for name in AUTO_ORDER:
        fmt = kv_format(name)
        try:
            check_format(fmt, head_dim, device)
        except InvalidArgument:
            continue
        if not auto_allowed(name, parameters):
            continue
        if fits(fmt):
            return fmt
        allowed.append(fmt)
    return allowed[-1] if allowed else floats


class KVCache:
    """Keys and values of every layer: k[layer], v[layer] are [num_pages * page_size, kv_heads, width]: width
    head_dim for float pages, head_dim + 4 for int8 rows, head_dim / 2 + 4 for 4-bit rows (`kv`: the page
    format, see kv_format; "auto" here is the model dtype's pages, the engine resolves it first)."""

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
        check_format(fmt, head_dim, device)
        self.layers, self.num_pages, self.page_size, self.format = layers, num_pages, page_size, fmt
        self.head_dim = head_dim
        kd, kw = fmt.storage(fmt.key_bits, head_dim, dtype)
        vd, vw = fmt.storage(fmt.value_bits, head_dim, dtype)
        self.k = torch.zeros((layers, num_pages * page_size, kv_heads, kw), dtype=kd, device=device)
        self.v = torch.zeros((layers, num_pages * page_size, kv_heads, vw), dtype=vd, device=device)
        # readers handed the keys alone (the C++ plan's `usable`) learn the values' format from them
        self.k.kv_values_dtype = vd

    @staticmethod
    def page_bytes(layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv: str | KVFormat | None = "auto") -> int:
        """Bytes one page takes across all layers, keys and values, in format `kv`."""
        return layers * page_size * kv_heads * kv_format(kv).row_bytes(head_dim, dtype)
