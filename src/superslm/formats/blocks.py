"""GGUF block types: the byte layout of each ggml tensor type and its vectorised dequantization.

One class per type, as gguf-py does: class attributes `type_id` (the ggml enum), `name`,
`block_size` (elements per block) and `type_size` (bytes per block), and classmethods
`dequantize(raw)` (uint8 bytes of whole blocks -> flat float32 values). The classes themselves are
the block types (they are never instantiated). Q4_0, Q4_1 and Q4_K are `Int4BlockType`s and also
offer `unpack_int4(raw)`, which exposes their 4-bit codes with one scale and one minimum per group
of 32 values so that packed int4 kernels can use GGUF weights without re-quantizing.

Arithmetic follows ggml (and gguf-py) operation for operation in float32, so values are bit-equal.
The grid-based IQ2/IQ3 types are declared here too; their decoders and lattice tables are in iq_blocks.py.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from superslm.errors import GGUFError, InvalidArgument
from superslm.formats import iq_blocks

QK_K = 256
# Dequantize this many raw bytes at a time: every temporary then stays in L2/L3 cache, which
# makes a 170 MB embedding several times faster than one whole-array pass per numpy op.
_CHUNK_BYTES = 1 << 18

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, k] packed bytes -> [n, 2k // 32, 32] values: per run of `width` bytes, low then high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> _NIBBLE_SHIFTS  # [n, k // width, 2, width]
    return (q & np.uint8(0x0F)).reshape(n, -1, 32)


class BlockType:
    """A ggml tensor type: how `block_size` values are stored in `type_size` bytes."""

    type_id: ClassVar[int]
    name: ClassVar[str]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init__(self) -> None:
        raise TypeError("block types are classes with classmethods; do not instantiate them")

    @classmethod
    def blocks(cls, raw: np.ndarray) -> np.ndarray:
        """View `raw` (uint8, whole blocks) as [n_blocks, type_size]."""
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
            raise InvalidArgument(f"{cls.name}: raw data must be a uint8 numpy array")
        if raw.size % cls.type_size:
            raise InvalidArgument(
                f"{cls.name}: {raw.size} bytes is not a whole number of {cls.type_size}-byte blocks"
            )
        # contiguous, so that the per-field .view() casts below are legal
        return np.ascontiguousarray(raw).reshape(-1, cls.type_size)  # [n_blocks, type_size]

    @classmethod
    def n_elements(cls, raw: np.ndarray) -> int:
        """How many values the bytes in `raw` hold."""
        return raw.size // cls.type_size * cls.block_size

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        """uint8 bytes of whole blocks -> a new flat float32 array of their values."""
        blocks = cls.blocks(raw)
        out = np.empty((blocks.shape[0], cls.block_size), dtype=np.float32)
        step = max(1, _CHUNK_BYTES // cls.type_size)
        # garbage scales in a malformed file give inf/nan values, not warnings
        with np.errstate(all="ignore"):
            for start in range(0, blocks.shape[0], step):
                cls._dequantize_into(blocks[start : start + step], out[start : start + step])
        return out.reshape(-1)

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        """Write the values of `blocks` [n, type_size] into `out` [n, block_size]."""
        raise NotImplementedError


class _Plain(BlockType):
    """One value per block, stored as a little-endian numpy scalar."""

    dtype: ClassVar[str]

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        blocks = cls.blocks(raw)
        # astype always copies, so the result never aliases a read-only memory map
        return blocks.reshape(-1).view(cls.dtype).astype(np.float32)


class F32(_Plain):
    type_id, name, block_size, type_size, dtype = 0, "F32", 1, 4, "<f4"


class F16(_Plain):
    type_id, name, block_size, type_size, dtype = 1, "F16", 1, 2, "<f2"


class I8(_Plain):
    type_id, name, block_size, type_size, dtype = 24, "I8", 1, 1, "i1"


class I16(_Plain):
    type_id, name, block_size, type_size, dtype = 25, "I16", 1, 2, "<i2"


class I32(_Plain):
    """int32 values; those above 2**24 in magnitude round to the nearest float32."""

    type_id, name, block_size, type_size, dtype = 26, "I32", 1, 4, "<i4"


class I64(_Plain):
    type_id, name, block_size, type_size, dtype = 27, "I64", 1, 8, "<i8"


class F64(_Plain):
    type_id, name, block_size, type_size, dtype = 28, "F64", 1, 8, "<f8"


class BF16(_Plain):
    type_id, name, block_size, type_size, dtype = 30, "BF16", 1, 2, "<u2"

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        bits = cls.blocks(raw).reshape(-1).view("<u2")
        # bfloat16 is the top half of a float32
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class Int4BlockType(BlockType):
    """A block type whose values are scale * code + minimum with 4-bit codes in groups of 32."""

    @classmethod
    def unpack_int4(cls, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uint8 bytes of whole blocks -> (codes uint8 [n_groups, 32], scale float32 [n_groups],
        minimum float32 [n_groups]), codes in the order of the dequantized values, such that
        dequantize(raw) == (scale[:, None] * codes + minimum[:, None]).reshape(-1) exactly in float32
        (value for value; only the sign of a zero may differ)."""
        blocks = cls.blocks(raw)
        groups = cls.block_size // 32
        n = blocks.shape[0] * groups
        codes = np.empty((n, 32), dtype=np.uint8)
        scale = np.empty(n, dtype=np.float32)
        minimum = np.empty(n, dtype=np.float32)
        step = max(1, _CHUNK_BYTES // cls.type_size)
        with np.errstate(all="ignore"):
            for start in range(0, blocks.shape[0], step):
                g = slice(start * groups, (start + step) * groups)
                cls._unpack_into(blocks[start : start + step], codes[g], scale[g], minimum[g])
        return codes, scale, minimum

    @classmethod
    def _unpack_into(
        cls, blocks: np.ndarray, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray
    ) -> None:
        raise NotImplementedError


class Q4_0(Int4BlockType):
    """32 values: f16 d, 16 bytes of nibbles (low nibbles are values 0-15); value = d * (q - 8)."""

    type_id, name, block_size, type_size = 2, "Q4_0", 32, 18

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        q = _nibbles(blocks[:, 2:], 16).reshape(-1, 32).astype(np.float32) - np.float32(8)
        np.multiply(_f16(blocks, 0), q, out=out)

    @classmethod
    def _unpack_into(
        cls, blocks: np.ndarray, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray
    ) -> None:
        codes[:] = _nibbles(blocks[:, 2:], 16).reshape(-1, 32)
        scale[:] = _f16(blocks, 0)[:, 0]
        # d*q and -8*d are exact in float32 (11-bit mantissa times 4 bits), so their sum is d*(q-8)
        minimum[:] = np.float32(-8) * scale


class Q4_1(Int4BlockType):
    """32 values: f16 d, f16 m, 16 bytes of nibbles; value = d * q + m."""

    type_id, name, block_size, type_size = 3, "Q4_1", 32, 20

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        q = _nibbles(blocks[:, 4:], 16).reshape(-1, 32).astype(np.float32)
        np.multiply(_f16(blocks, 0), q, out=out)
        out += _f16(blocks, 2)

    @classmethod
    def _unpack_into(
        cls, blocks: np.ndarray, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray
    ) -> None:
        codes[:] = _nibbles(blocks[:, 4:], 16).reshape(-1, 32)
        scale[:] = _f16(blocks, 0)[:, 0]
        minimum[:] = _f16(blocks, 2)[:, 0]


def _q5_codes(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit codes [n, 32] of Q5_0/Q5_1: nibbles plus bit i of the little-endian u32 qh as bit 4."""
    qh = np.unpackbits(blocks[:, qh_at : qh_at + 4], axis=-1, bitorder="little")  # [n, 32]
    return _nibbles(blocks[:, qh_at + 4 :], 16).reshape(-1, 32) | (qh << np.uint8(4))


class Q5_0(BlockType):
    """32 values: f16 d, u32 high bits, 16 bytes of nibbles; value = d * (q - 16)."""

    type_id, name, block_size, type_size = 6, "Q5_0", 32, 22

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        q = _q5_codes(blocks, 2).astype(np.float32) - np.float32(16)
        np.multiply(_f16(blocks, 0), q, out=out)


class Q5_1(BlockType):
    """32 values: f16 d, f16 m, u32 high bits, 16 bytes of nibbles; value = d * q + m."""

    type_id, name, block_size, type_size = 7, "Q5_1", 32, 24

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        np.multiply(_f16(blocks, 0), _q5_codes(blocks, 4).astype(np.float32), out=out)
        out += _f16(blocks, 2)


class Q8_0(BlockType):
    """32 values: f16 d, 32 int8; value = d * q."""

    type_id, name, block_size, type_size = 8, "Q8_0", 32, 34

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), out=out)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> 6-bit (scale, min) [n, 8] each, as float32."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # each [n, 4]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


class Q2_K(BlockType):
    """256 values: 16 bytes of 4-bit (scale, min), 64 bytes of 2-bit q, f16 d, f16 dmin."""

    type_id, name, block_size, type_size = 10, "Q2_K", QK_K, 84

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        scales = blocks[:, :16]
        dl = (_f16(blocks, 80) * (scales & 0x0F).astype(np.float32))[..., None]  # [n, 16, 1]
        ml = (_f16(blocks, 82) * (scales >> 4).astype(np.float32))[..., None]
        q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS) & np.uint8(3)  # [n, 2, 4, 32]
        q = q.reshape(n, 16, 16).astype(np.float32)
        np.subtract(dl * q, ml, out=out.reshape(n, 16, 16))


class Q3_K(BlockType):
    """256 values: 32 bytes high-bit mask, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, f16 d."""

    type_id, name, block_size, type_size = 11, "Q3_K", QK_K, 110

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        packed = blocks[:, 96:108]
        low = (packed[:, None, :8] >> _NIBBLE_SHIFTS[0, 0]).reshape(n, 16) & np.uint8(0x0F)
        high = (packed[:, None, 8:] >> _CRUMB_SHIFTS[0, 0]).reshape(n, 16) & np.uint8(0x03)
        scales = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
        dl = (_f16(blocks, 108) * scales)[..., None]  # [n, 16, 1]
        ql = (blocks[:, 32:96].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS) & np.uint8(3)  # [n, 2, 4, 32]
        hm = (blocks[:, :32].reshape(n, 1, 1, 32) >> _BIT_SHIFTS) & np.uint8(1)  # [n, 1, 8, 32]
        # a clear mask bit means "subtract 4"
        minus4 = ((hm.reshape(n, 16, 16) ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
        q = ql.reshape(n, 16, 16).astype(np.int8) - minus4
        np.multiply(dl, q.astype(np.float32), out=out.reshape(n, 16, 16))


class Q4_K(Int4BlockType):
    """256 values: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min), 128 bytes of nibbles.

    Sub-block j (32 values) is d*sc[j] * q - dmin*m[j]; sub-blocks 2i and 2i+1 are the low and the
    high nibbles of bytes 32i..32i+31.
    """

    type_id, name, block_size, type_size = 12, "Q4_K", QK_K, 144

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        sc, mn = _k_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], 32).astype(np.float32)
        o = out.reshape(n, 8, 32)
        np.multiply((_f16(blocks, 0) * sc)[..., None], q, out=o)
        o -= (_f16(blocks, 2) * mn)[..., None]

    @classmethod
    def _unpack_into(
        cls, blocks: np.ndarray, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray
    ) -> None:
        sc, mn = _k_scale_min(blocks[:, 4:16])
        codes[:] = _nibbles(blocks[:, 16:], 32).reshape(-1, 32)
        scale[:] = (_f16(blocks, 0) * sc).reshape(-1)
        # x + (-y) == x - y exactly in IEEE arithmetic
        minimum[:] = -(_f16(blocks, 2) * mn).reshape(-1)


class Q5_K(BlockType):
    """256 values: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min), 32 bytes high bits, 128 bytes nibbles."""

    type_id, name, block_size, type_size = 13, "Q5_K", QK_K, 176

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        sc, mn = _k_scale_min(blocks[:, 4:16])
        qh = (blocks[:, 16:48].reshape(n, 1, 1, 32) >> _BIT_SHIFTS) & np.uint8(1)  # [n, 1, 8, 32]
        q = _nibbles(blocks[:, 48:], 32) | (qh.reshape(n, 8, 32) << np.uint8(4))  # [n, 8, 32]
        o = out.reshape(n, 8, 32)
        np.multiply((_f16(blocks, 0) * sc)[..., None], q.astype(np.float32), out=o)
        o -= (_f16(blocks, 2) * mn)[..., None]


class Q6_K(BlockType):
    """256 values: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, f16 d; value = d*s*(q-32)."""

    type_id, name, block_size, type_size = 14, "Q6_K", QK_K, 210

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        d = (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32))[..., None]  # [n, 16, 1]
        ql = _nibbles(blocks[:, :128], 64)
        qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS) & np.uint8(3)  # [n, 2, 4, 32]
        q = (ql | (qh.reshape(n, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        np.multiply(d, q.reshape(n, 16, 16).astype(np.float32), out=out.reshape(n, 16, 16))


class Q8_K(BlockType):
    """256 values: f32 d, 256 int8, 16 int16 block sums (unused here); value = d * q."""

    type_id, name, block_size, type_size = 15, "Q8_K", QK_K, 292

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        np.multiply(blocks[:, 4:260].view(np.int8), blocks[:, :4].view("<f4"), out=out)


#: the 16 values of IQ4_NL's non-linear 4-bit codes (ggml's kvalues_iq4nl), shared by IQ4_XS
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


class IQ4_NL(BlockType):
    """32 values: f16 d, 16 bytes of 4-bit codes (low nibbles first); value = d * kvalues[code]."""

    type_id, name, block_size, type_size = 20, "IQ4_NL", 32, 18

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        q = _IQ4_VALUES[_nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], 32)]
        np.multiply(_f16(blocks, 0), q, out=out)


class IQ4_XS(BlockType):
    """256 values: f16 d, u16 high scale bits, 4 bytes low scale bits, 128 bytes codes; sub-block b of 32 values has
    the 6-bit scale ls_b and value = (d * (ls_b - 32)) * kvalues[code]."""

    type_id, name, block_size, type_size = 23, "IQ4_XS", QK_K, 136

    @classmethod
    def _dequantize_into(cls, blocks: np.ndarray, out: np.ndarray) -> None:
        n = blocks.shape[0]
        low = (blocks[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & np.uint8(0x0F)
        high = (blocks[:, 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)  # [n, 8]
        ls = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        dl = (_f16(blocks, 0) * ls.astype(np.float32))[..., None]  # [n, 8, 1]
        np.multiply(dl, _IQ4_VALUES[_nibbles(blocks[:, 8:], 16)], out=out.reshape(n, 8, 32))


# The grid-based IQ types: their byte layouts are described by their decoders in iq_blocks.py.


class IQ2_XXS(BlockType):
    """256 values in 66 bytes, about 2.06 bits each: 8-value grid points, 7-bit sign indices, a scale per 32."""

    type_id, name, block_size, type_size = 16, "IQ2_XXS", QK_K, 66
    _dequantize_into = staticmethod(iq_blocks.dequantize_iq2_xxs)


class IQ2_XS(BlockType):
    """256 values in 74 bytes, about 2.31 bits each: 9-bit grid indices with 7-bit sign indices, a scale per 16."""

    type_id, name, block_size, type_size = 17, "IQ2_XS", QK_K, 74
    _dequantize_into = staticmethod(iq_blocks.dequantize_iq2_xs)


class IQ2_S(BlockType):
    """256 values in 82 bytes, about 2.56 bits each: 10-bit grid indices, one sign bit per value, a scale per 16."""

    type_id, name, block_size, type_size = 22, "IQ2_S", QK_K, 82
    _dequantize_into = staticmethod(iq_blocks.dequantize_iq2_s)


class IQ3_XXS(BlockType):
    """256 values in 98 bytes, about 3.06 bits each: 4-value grid points, 7-bit sign indices, a scale per 32."""

    type_id, name, block_size, type_size = 18, "IQ3_XXS", QK_K, 98
    _dequantize_into = staticmethod(iq_blocks.dequantize_iq3_xxs)


class IQ3_S(BlockType):
    """256 values in 110 bytes, about 3.44 bits each: 9-bit grid indices, one sign bit per value, a scale per 32."""

    type_id, name, block_size, type_size = 21, "IQ3_S", QK_K, 110
    _dequantize_into = staticmethod(iq_blocks.dequantize_iq3_s)


BLOCK_TYPES: dict[int, type[BlockType]] = {
    t.type_id: t
    for t in (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS)
    + (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, I8, I16, I32, I64, F64, BF16)
}

# ggml types SuperSLM does not read, named so that a refusal says what the file holds
_UNSUPPORTED_NAMES = {
    9: "Q8_1", 19: "IQ1_S", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip


def block_type(type_id: int) -> type[BlockType]:
    """The block type of ggml type id `type_id`; GGUFError for ids SuperSLM does not know."""
    found = BLOCK_TYPES.get(type_id)
    if found is None:
        known = _UNSUPPORTED_NAMES.get(type_id)
        detail = f" (ggml {known}, not supported)" if known else ""
        raise GGUFError(f"unknown block type {type_id}{detail}")
    return found
