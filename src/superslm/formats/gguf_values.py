"""GGUF metadata values read from the map: the value types and `Cursor`, bounds-checked little-endian
reads where every overrun is a GGUFError (formats/gguf.py parses the file with it).

A count or length read from the file is checked against the bytes left before it is used to allocate.
String values are decoded as UTF-8 with errors="replace"; arrays longer than LAZY_ITEMS stay in the map
(`gguf_array.GGUFArray`).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np

from superslm.errors import GGUFError
from superslm.formats.gguf_array import LAZY_ITEMS, GGUFArray

U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

#: GGUF metadata value type id -> name
VALUE_TYPE_NAMES = {
    0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
    7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64",
}  # fmt: skip
_STRING, ARRAY, _BOOL = 8, 9, 7
# fixed-size value types -> struct format, spelled out: numpy's 64-bit ints are the platform "l",
# which struct's "<" mode reads as 4 bytes
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_NUMERIC_STRUCT = {t: struct.Struct("<" + c) for t, c in _SCALAR_FORMATS.items()}
_NUMERIC = {t: np.dtype("<" + c) for t, c in _SCALAR_FORMATS.items()}

class Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun is a GGUFError."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0
        self._bytes: np.ndarray | None = None

    def view(self) -> np.ndarray:
        """The whole buffer as read-only uint8 (what lazy arrays keep)."""
        if self._bytes is None:
            self._bytes = np.frombuffer(self.buf, dtype=np.uint8, count=self.size)
        return self._bytes

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(
                f"truncated file: {what} needs {n} bytes at offset {self.pos}, "
                f"but only {self.size - self.pos} are left"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, strict: bool) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, what: str) -> Any:
        """One metadata value of type `vtype` as a plain Python value."""
        if vtype == _STRING:
            return self.string(what, strict=False)
        if vtype == ARRAY:
            return self.array(what)
        st = _NUMERIC_STRUCT.get(vtype)
        if st is None:
            raise GGUFError(f"{what}: unknown value type {vtype}")
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        if vtype == _BOOL:
            return self._bool(v, what)
        return v

    @staticmethod
    def _bool(v: int, what: str) -> bool:
        if v > 1:
            raise GGUFError(f"{what}: bool value byte is {v}, not 0 or 1")
        return bool(v)

    def array(self, what: str) -> list[Any] | GGUFArray:
        itype = self.u32(f"item type of {what}")
        n = self.u64(f"length of {what}")
        if itype == ARRAY:
            raise GGUFError(f"{what}: arrays of arrays are not supported")
        if itype == _STRING:
            return self.string_array(n, what)
        dtype = _NUMERIC.get(itype)
        if dtype is None:
            raise GGUFError(f"{what}: unknown array item type {itype}")
        if n * dtype.itemsize > self.left():
            raise GGUFError(
                f"truncated file: {what}: array of {n} {VALUE_TYPE_NAMES[itype]} needs "
                f"{n * dtype.itemsize} bytes, only {self.left()} are left"
            )
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
        self.pos += n * dtype.itemsize
        if itype == _BOOL and n and int(values.max()) > 1:
            raise GGUFError(f"{what}: bool array holds a byte other than 0 or 1")
        if n > LAZY_ITEMS:
            return GGUFArray.numbers(values, boolean=itype == _BOOL)
        return values.astype(bool).tolist() if itype == _BOOL else values.tolist()

    def string_array(self, n: int, what: str) -> list[str] | GGUFArray:
        # each string takes at least its 8-byte length: cap n before allocating the list
        if n * 8 > self.left():
            raise GGUFError(
                f"truncated file: {what}: array of {n} strings cannot fit in the {self.left()} bytes left"
            )
        buf, pos, end, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        lazy = n > LAZY_ITEMS
        # a long array keeps each string's start (read on access), a short one its decoded strings
        starts = np.empty(n if lazy else 0, dtype=np.int64)
        out: list[str] = [] if lazy else [""] * n
        for i in range(n):
            if end - pos < 8:
                raise GGUFError(f"truncated file: {what}: string {i} of {n} starts past the end")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > end - pos:
                raise GGUFError(
                    f"truncated file: {what}: string {i} of {n} has length {length}, "
                    f"only {end - pos} bytes are left"
                )
            if lazy:
                starts[i] = pos
            else:
                out[i] = buf[pos : pos + length].decode("utf-8", "replace")
            pos += length
        self.pos = pos
        return GGUFArray.strings(self.view(), starts, pos) if lazy else out


def type_name(vtype: int, item_type: int | None) -> str:
    name = VALUE_TYPE_NAMES[vtype]
    return f"ARRAY[{VALUE_TYPE_NAMES[item_type]}]" if item_type is not None else name
