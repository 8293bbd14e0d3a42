"""tests/triton_interpret.py's shortcuts through the Triton interpreter give the interpreter's own answers."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from tests.triton_interpret import bf16_casts_by_shifts, np_dtypes_looked_up_once  # noqa: E402


def _float32_bits(seed: int, n: int) -> np.ndarray:
    """n random float32 bit patterns and the special ones (zeros, infinities, NaNs, extremes)."""
    rng = np.random.default_rng(seed)
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F800000, 0x00800000,
                0x7F7FFFFF, 0x00000001, 0x807FFFFF]  # fmt: skip
    return np.concatenate([rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32), np.array(specials, np.uint32)])


def test_bf16_casts_by_shifts_are_the_interpreters_casts() -> None:
    real = interpreter._convert_float
    with pytest.MonkeyPatch.context() as mp:
        bf16_casts_by_shifts(interpreter, mp)
        fast = interpreter._convert_float
        every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)  # every bfloat16 (subnormals: the fallback)
        normal = every[~(((every & 0x7F80) == 0) & ((every & 0x007F) != 0))]
        for x in (every.reshape(256, 256), normal, normal[::3]):
            want = real(x, tl.bfloat16, tl.float32, None)
            got = fast(x, tl.bfloat16, tl.float32, None)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        bits = _float32_bits(0, 200_000)
        normal32 = bits[~(((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0))]
        strided = normal32[:4000].view(np.float32).reshape(40, 100)[:, ::2]
        for x in (bits.view(np.float32), normal32.view(np.float32), strided):
            want = real(x, tl.float32, tl.bfloat16, None)
            got = fast(x, tl.float32, tl.bfloat16, None)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        # a rounding mode is the interpreter's own path
        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        x = normal32.view(np.float32)
        assert np.array_equal(fast(x, tl.float32, tl.bfloat16, rtne), real(x, tl.float32, tl.bfloat16, rtne))


def test_np_dtypes_looked_up_once_are_the_interpreters() -> None:
    real = interpreter._get_np_dtype
    kinds = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
             tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv, tl.pointer_type(tl.float32)]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        np_dtypes_looked_up_once(interpreter, mp)
        fast = interpreter._get_np_dtype
        for _ in range(2):  # asked, then remembered
            for t in kinds:
                assert fast(t) == real(t)
                assert fast(tl.block_type(t, [4, 8])) == real(tl.block_type(t, [4, 8]))
