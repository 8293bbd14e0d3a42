"""Helpers for the malformed-GGUF tests: a small valid file written by gguf-py, and where its fields are.

Field positions are found by searching the bytes for the (unique) key and tensor names and stepping
over the fixed-size fields that follow them, as the GGUF spec lays them out; tensor data ranges come
from gguf-py's GGUFReader. Nothing here uses superslm's reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# names chosen unique in the file, equal lengths so that one can be renamed to another in place
KEY_A = "test.key_aaaa"
KEY_B = "test.key_bbbb"
KEY_STR = "test.str_value"
KEY_INTS = "test.int_array"
KEY_STRS = "test.str_array"
KEY_BOOL = "test.flag_bool"
TENSOR_A = "tensor_alpha"
TENSOR_B = "tensor_bravo"
TENSOR_C = "tensor_charl"
STRINGS = ["hello", "wörld", "", "<0x0A>"]


def write_small_gguf(path: Path, alignment: int | None = None) -> Path:
    """A valid GGUF v3 file with a few metadata kinds and F32 / Q4_0 / F16 tensors."""
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32(KEY_A, 7)
    w.add_uint32(KEY_B, 9)
    w.add_string(KEY_STR, "a string value")
    w.add_float32("test.float_value", 0.5)
    w.add_bool(KEY_BOOL, True)
    w.add_array(KEY_INTS, [1, -2, 3, 40000])
    w.add_array(KEY_STRS, STRINGS)
    w.add_array("test.float_array", [0.25, -1.5])
    w.add_tensor(TENSOR_A, rng.standard_normal((4, 8)).astype(np.float32))
    q4 = rng.integers(0, 256, size=(3, 2 * 18), dtype=np.uint8)
    q4.reshape(3, 2, 18)[:, :, :2] = rng.standard_normal((3, 2, 1)).astype(np.float16).view(np.uint8)
    w.add_tensor(TENSOR_B, q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor(TENSOR_C, rng.standard_normal(16).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


VT = gguf.GGUFValueType
# two values of every metadata value type
VALUE_SAMPLES = {
    VT.UINT8: [0, 255], VT.INT8: [-128, 127], VT.UINT16: [0, 65535], VT.INT16: [-32768, 7],
    VT.UINT32: [2**32 - 1, 1], VT.INT32: [-(2**31), 5], VT.FLOAT32: [0.1, -3.5],
    VT.BOOL: [True, False], VT.STRING: ["é", "tab\t"], VT.UINT64: [2**64 - 1, 0],
    VT.INT64: [-(2**63), 2**63 - 1], VT.FLOAT64: [1e300, -0.25],
}  # fmt: skip


def write_all_types_gguf(path: Path) -> Path:
    """A GGUF file without tensors holding "scalar.<TYPE>" and "array.<TYPE>" for every value type."""
    w = gguf.GGUFWriter(path, arch="llama")
    for t, values in VALUE_SAMPLES.items():
        w.add_key_value(f"scalar.{t.name}", values[0], t)
        w.add_key_value(f"array.{t.name}", values, VT.ARRAY, sub_type=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class TensorFields:
    name_len_at: int
    n_dims_at: int
    dims_at: int
    type_at: int
    offset_at: int
    offset: int  # relative to the data section, as stored
    data_start: int  # absolute
    nbytes: int


@dataclass
class Layout:
    data: bytes
    n_tensors_at: int
    n_kv_at: int
    data_offset: int
    tensors: dict[str, TensorFields]

    def key_len_at(self, key: str) -> int:
        return self._find(key) - 8

    def value_type_at(self, key: str) -> int:
        return self._find(key) + len(key)

    def value_at(self, key: str) -> int:
        return self.value_type_at(key) + 4

    def _find(self, name: str) -> int:
        needle = name.encode()
        at = self.data.find(needle)
        assert at > 0 and self.data.find(needle, at + 1) == -1, name
        return at

    @property
    def header_end(self) -> int:
        """End of the last tensor info."""
        return max(t.offset_at for t in self.tensors.values()) + 8

    @property
    def data_end(self) -> int:
        """End of the last tensor's data (the file may go on with padding)."""
        return max(t.data_start + t.nbytes for t in self.tensors.values())


def layout(path: Path) -> Layout:
    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        at = data.find(t.name.encode())
        n_dims = len(t.shape)
        dims_at = at + len(t.name) + 4
        type_at = dims_at + 8 * n_dims
        (offset,) = struct.unpack_from("<Q", data, type_at + 4)
        start, nbytes = int(t.data_offset), int(t.n_bytes)
        name_at = at - 8
        tensors[t.name] = TensorFields(
            name_at, at + len(t.name), dims_at, type_at, type_at + 4, offset, start, nbytes
        )
    return Layout(data, 8, 16, int(reader.data_offset), tensors)


def patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    """`data` with the struct field `fmt` (little-endian unless it says ">") at `at` set to `value`."""
    out = bytearray(data)
    struct.pack_into(fmt if fmt[0] in "<>" else "<" + fmt, out, at, value)
    return bytes(out)


def spliced(data: bytes, at: int, new: bytes) -> bytes:
    """`data` with the bytes at `at` overwritten by `new`."""
    return data[:at] + new + data[at + len(new) :]
