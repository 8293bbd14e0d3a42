"""`GGUFArray`: a long GGUF metadata array left in the memory map and read on access.

A tokenizer's arrays are the bulk of a GGUF's metadata: Gemma 3's 262k token strings, scores and types
parsed into Python objects take ~40 MB for as long as the file is open, though a loader reads them
once. Arrays longer than `LAZY_ITEMS` are kept as this read-only sequence instead: the strings' start
offsets (8 bytes each) and a view of the map; each access decodes afresh and nothing is cached.
It compares equal to a list of the same values, so code that treats metadata as plain values works.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

#: arrays with more items than this stay in the map (small ones are plain lists)
LAZY_ITEMS = 4096


class GGUFArray(Sequence):
    """A metadata array of numbers or strings, read from the file's map on each access.

    Items are plain Python values (int, float, bool, str: strings decoded as UTF-8 with
    errors="replace"), exactly what the eager parse gives. `tolist()` materializes them.
    """

    def __init__(self, data: np.ndarray, dtype: np.dtype | None, starts: np.ndarray | None, end: int,
                 n: int, boolean: bool = False) -> None:
        # data: the map as uint8 (numbers: this array's bytes only); starts: each string's first byte
        self._data = data
        self._dtype = dtype
        self._starts = starts
        self._end = end
        self._n = n
        self._bool = boolean

    @classmethod
    def numbers(cls, values: np.ndarray, boolean: bool = False) -> GGUFArray:
        """A numeric array over `values` (a read-only view into the map)."""
        return cls(values, values.dtype, None, 0, len(values), boolean)

    @classmethod
    def strings(cls, data: np.ndarray, starts: np.ndarray, end: int) -> GGUFArray:
        """A string array: string i is data[starts[i] : starts[i + 1] - 8] (the next one's u64 length
        sits between them), the last one ends at `end`."""
        return cls(data, None, starts, end, len(starts))

    def __len__(self) -> int:
        return self._n

    def _span(self, i: int) -> tuple[int, int]:
        assert self._starts is not None
        start = int(self._starts[i])
        stop = int(self._starts[i + 1]) - 8 if i + 1 < self._n else self._end
        return start, stop

    def raw(self, i: int) -> bytes:
        """String i's stored bytes (not decoded)."""
        start, stop = self._span(i)
        return self._data[start:stop].tobytes()

    def _item(self, i: int) -> Any:
        if self._starts is None:
            v = self._data[i].item()
            return bool(v) if self._bool else v
        return self.raw(i).decode("utf-8", "replace")

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(self._n))]
        j = i.__index__()
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"GGUF array index {i} out of range ({self._n} items)")
        return self._item(j)

    def __iter__(self) -> Iterator[Any]:
        if self._starts is None:
            yield from self.tolist()
            return
        data, starts = self._data, self._starts
        bounds = np.append(starts[1:] - 8, self._end).tolist()
        for start, stop in zip(starts.tolist(), bounds, strict=True):
            yield data[start:stop].tobytes().decode("utf-8", "replace")

    def tolist(self) -> list[Any]:
        """Every item as a new list of plain Python values."""
        if self._starts is None:
            out = self._data.tolist()
            return [bool(v) for v in out] if self._bool else out
        return list(iter(self))

    def numpy(self) -> np.ndarray:
        """A numeric array's values (a read-only view into the map); strings raise TypeError."""
        if self._starts is not None:
            raise TypeError("a string array has no numpy view")
        return self._data.astype(bool) if self._bool else self._data

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GGUFArray):
            return self.tolist() == other.tolist()
        if isinstance(other, (list, tuple)):
            return len(other) == self._n and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-sequence semantics: unhashable like a list

    def __repr__(self) -> str:
        kind = "STRING" if self._starts is not None else str(self._dtype)
        return f"GGUFArray({kind}, {self._n} items)"
