"""A hardened GGUF reader: everything is parsed and validated up front, tensor data stays memory-mapped.

Layout (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata entries (string key, u32 value type, value); tensor infos (string name, u32 n_dims,
u64 ne[n_dims], u32 ggml type, u64 offset into the data section); padding up to `general.alignment`
(default 32); the data section. A string is a u64 byte length and that many bytes.

Every malformed file is refused with `GGUFError` from the constructor, before any count or length
read from the file is used to allocate: counts and lengths are first checked against the bytes left.
Metadata string values are decoded as UTF-8 with errors="replace" (a model with a stray invalid byte
in one token still loads); metadata keys and tensor names must be valid UTF-8.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from superslm.errors import GGUFError, InvalidArgument, ModelNotFound
from superslm.formats.blocks import BlockType, block_type
from superslm.formats.gguf_values import ARRAY, U32, VALUE_TYPE_NAMES, Cursor, type_name

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# the fewest bytes a metadata entry (u64 key length, u32 type, 1-byte value) and a tensor info
# (u64 name length, u32 n_dims, one u64 dim, u32 type, u64 offset) can take
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class FileRows:
    """Rows of one tensor read with pread into buffers of ours. Reading scattered rows through the map
    faults whole page-cache folios into the process (about 1 MB of RSS a row, measured on a 150k-row
    embedding); pread copies just the row and the page cache stays outside the process's RSS. Owns its
    file descriptor (opened on the mapped file itself, so a file replaced later is not read)."""

    def __init__(self, fd: int, offset: int, row_bytes: int, rows: int) -> None:
        self.offset, self.row_bytes, self.rows = offset, row_bytes, rows
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        """Rows idx (int, each in 0..rows - 1) -> uint8 [len(idx), row_bytes]."""
        out = np.empty((len(idx), self.row_bytes), dtype=np.uint8)
        for i, r in enumerate(idx.tolist()):
            if not 0 <= r < self.rows:
                raise InvalidArgument(f"row {r} is outside 0..{self.rows - 1}")
            if os.preadv(self.fd, [out[i]], self.offset + r * self.row_bytes) != self.row_bytes:
                raise GGUFError(f"short read of row {r}: the file changed size under its map")
        return out

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    #: torch order: the reverse of ggml's ne, so shape[-1] == ne[0] (the contiguous axis)
    shape: tuple[int, ...]
    type_id: int
    block: type[BlockType]
    #: absolute byte offset of the tensor's data in the file
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        """Number of values in the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """A GGUF file, parsed and validated on construction, its tensor data memory-mapped.

    Use as a context manager or call `close()`. Arrays from `raw()` are read-only views into the map
    and stay valid after `close()` (the mapping lives until the last view is gone).
    """

    version: int
    alignment: int
    #: key -> plain Python value (int, float, bool, str, or a list of one of those; arrays longer than
    #: LAZY_ITEMS are a `GGUFArray`, read from the map on access), in file order
    metadata: dict[str, Any]
    #: key -> GGUF value type name: "UINT32", "STRING", "ARRAY[INT32]", ...
    metadata_types: dict[str, str]
    #: name -> TensorInfo, in file order
    tensors: dict[str, TensorInfo]
    #: absolute byte offset of the data section (tensor offsets in the file are relative to it)
    data_offset: int
    file_size: int

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._map: mmap.mmap | None = None
        self._data: np.ndarray | None = None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                self.file_size = st.st_size
                self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if self.file_size < 4 + 4 + 8 + 8:
                    head = f.read(4)
                    if len(head) == 4 and head != GGUF_MAGIC:
                        raise GGUFError(f"{self.path}: not a GGUF file (magic {head!r})")
                    raise GGUFError(
                        f"{self.path}: truncated file: {self.file_size} bytes, shorter than a header"
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelNotFound(f"no GGUF file at {self.path}") from None
        except OSError as e:
            raise GGUFError(f"cannot read {self.path}: {e}") from None
        try:
            self._parse(Cursor(self._map, self.file_size))
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None
        except BaseException:
            self.close()
            raise
        self._data = np.frombuffer(self._map, dtype=np.uint8)

    # --- parsing ---------------------------------------------------------------------------------

    def _parse(self, cur: Cursor) -> None:
        magic = bytes(cur.buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise GGUFError("big-endian GGUF files are not supported")
            raise GGUFError(f"unsupported GGUF version {version} (SuperSLM reads versions 2 and 3)")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_kv * _MIN_KV_BYTES > cur.left():
            raise GGUFError(f"truncated file: metadata count {n_kv} cannot fit in {cur.left()} bytes")
        if n_tensors * _MIN_TENSOR_INFO_BYTES > cur.left():
            raise GGUFError(f"truncated file: tensor count {n_tensors} cannot fit in {cur.left()} bytes")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > cur.left():
            raise GGUFError(
                f"truncated file: metadata count {n_kv} and tensor count {n_tensors} cannot fit "
                f"in the {cur.left()} bytes left"
            )
        self._parse_metadata(cur, n_kv)
        self.alignment = self._check_alignment()
        infos = [self._parse_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self._check_tensors(infos)

    def _parse_metadata(self, cur: Cursor, n_kv: int) -> None:
        self.metadata = {}
        self.metadata_types = {}
        start = cur.pos
        for i in range(n_kv):
            key = cur.string(f"key of metadata entry {i}", strict=True)
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r}")
            vtype = cur.u32(f"value type of metadata {key!r}")
            if vtype not in VALUE_TYPE_NAMES:
                raise GGUFError(f"metadata {key!r} has unknown value type {vtype}")
            item_type = None
            if vtype == ARRAY:
                # peek at the item type for metadata_types; array() validates it again
                cur.need(4, f"item type of metadata {key!r}")
                (item_type,) = U32.unpack_from(cur.buf, cur.pos)
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
            self.metadata_types[key] = type_name(vtype, item_type)
        self._metadata_span = (start, cur.pos)

    def metadata_digest(self) -> str:
        """sha256 (hex) of the file's metadata section as stored: a content key for what is built from the
        metadata alone (the loader caches the tokenizer under it)."""
        if self._map is None:
            raise GGUFError(f"{self.path}: the file is closed")
        start, end = self._metadata_span
        return hashlib.sha256(self._map[start:end]).hexdigest()

    def _check_alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        if self.metadata_types["general.alignment"] != "UINT32":
            raise GGUFError(
                f"general.alignment has type {self.metadata_types['general.alignment']}, expected UINT32"
            )
        alignment = self.metadata["general.alignment"]
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment} is not a power of two")
        return alignment

    def _parse_tensor_info(self, cur: Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        """-> (name, ne, type_id, offset relative to the data section)."""
        name = cur.string(f"name of tensor {i}", strict=True)
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has n_dims {n_dims}, expected 1 to {MAX_DIMS}")
        ne = tuple(cur.u64(f"dims of tensor {name!r}") for _ in range(n_dims))
        if min(ne) < 1:
            raise GGUFError(f"tensor {name!r} has a dimension of 0 (ne={list(ne)})")
        type_id = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"offset of tensor {name!r}")
        return name, ne, type_id, offset

    def _check_tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        self.tensors = {}
        for name, ne, type_id, rel in infos:
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor name {name!r}")
            try:
                block = block_type(type_id)
            except GGUFError as e:
                raise GGUFError(f"tensor {name!r}: {e}") from None
            if ne[0] % block.block_size:
                raise GGUFError(
                    f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                    f"{block.name} block size {block.block_size}"
                )
            n_elements = 1
            for d in ne:
                n_elements *= d
            nbytes = n_elements // block.block_size * block.type_size
            if rel % self.alignment:
                raise GGUFError(f"tensor {name!r}: data offset {rel} is not aligned to {self.alignment}")
            start = self.data_offset + rel
            if start + nbytes > self.file_size:
                raise GGUFError(
                    f"tensor {name!r}: data [{start}, {start + nbytes}) runs past the end of the "
                    f"file ({self.file_size} bytes)"
                )
            self.tensors[name] = TensorInfo(name, tuple(reversed(ne)), type_id, block, start, nbytes)
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_offset, by_offset[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(f"tensors {a.name!r} and {b.name!r} overlap")

    # --- public API ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """general.architecture, e.g. "llama" or "gemma3"."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture is missing or not a string")
        return arch

    @property
    def closed(self) -> bool:
        return self._data is None

    def _info(self, name: str) -> TensorInfo:
        if self._data is None:
            raise InvalidArgument(f"{self.path} is closed")
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name`: a read-only uint8 view into the memory map."""
        info = self._info(name)
        assert self._data is not None
        return self._data[info.offset : info.offset + info.nbytes]

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` as a new torch tensor of `dtype`, shaped `tensors[name].shape`."""
        info = self._info(name)
        values = info.block.dequantize(self.raw(name)).reshape(info.shape)
        t = torch.from_numpy(values)
        return t if dtype == torch.float32 else t.to(dtype)

    def rows_reader(self, raw: np.ndarray, row_bytes: int) -> FileRows | None:
        """A reader of whole rows of `row_bytes` bytes of `raw` (a view `raw()` handed out) through pread, or
        None where it cannot read them (no preadv here, the view is not this map's, the file at this path
        is no longer the one mapped)."""
        if self._data is None or not hasattr(os, "preadv") or raw.ndim != 1 or row_bytes <= 0:
            return None
        start = raw.ctypes.data - self._data.ctypes.data
        if not (0 <= start and start + raw.size <= self._data.size) or raw.size % row_bytes:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
            os.close(fd)
            return None
        return FileRows(fd, start, row_bytes, raw.size // row_bytes)

    def release_pages(self) -> None:
        """Drop the map's touched pages from this process's RSS once a load has copied what it needs
        (MADV_DONTNEED on a read-only file map loses nothing: a later read faults the page back in)."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError, ValueError):  # only a memory-use hint
                self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drop the memory map; views handed out by `raw()` keep their pages alive."""
        self._data = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a raw() view still exports the buffer; the map is unmapped when it dies
            self._map = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"GGUFFile({self.path!r}, v{getattr(self, 'version', '?')}, {state})"
