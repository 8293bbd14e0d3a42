"""Block types against gguf-py's dequantize (random blocks and the real models) and direct loops."""

from __future__ import annotations

import ctypes
import importlib.util
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from superslm.errors import GGUFError, InvalidArgument
from superslm.formats import blocks, iq_blocks
from superslm.formats.blocks import BLOCK_TYPES, QK_K, BlockType, Int4BlockType, block_type
from superslm.formats.gguf import GGUFFile

# byte offsets of the float16 scale fields in each block (ggml's block_q* structs): random bytes there
# would be inf/nan, so the tests write finite values
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
    "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
}  # fmt: skip
# every other byte may be anything: each grid index field of the IQ2/IQ3 types is exactly as wide as its grid
# is long (test_iq_grids_cover_their_index_fields), and every bit of the rest is a sign or a scale
N_BLOCKS = 700  # more than one dequantize chunk for the 32-element types


def random_blocks(bt: type[BlockType], n: int = N_BLOCKS, seed: int = 0) -> np.ndarray:
    """n random blocks of `bt` as flat uint8, with finite scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, bt.type_size), dtype=np.uint8)
    for at in F16_FIELDS.get(bt.name, []):
        scales = (rng.standard_normal((n, 1)) * 10.0 ** rng.integers(-6, 2, (n, 1))).astype(np.float16)
        raw[:, at : at + 2] = scales.view(np.uint8)
    if bt.name in ("F16", "BF16"):
        raw = rng.standard_normal(n).astype(np.float16 if bt.name == "F16" else np.float32)
        raw = raw.view(np.uint8) if bt.name == "F16" else raw.view(np.uint16)[1::2].copy().view(np.uint8)
    return raw.reshape(-1)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_registry_matches_ggml_sizes() -> None:
    expected = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    expected |= {"Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS"}
    expected |= {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}
    assert {bt.name for bt in BLOCK_TYPES.values()} == expected
    for type_id, bt in BLOCK_TYPES.items():
        assert bt.type_id == type_id
        assert QT(type_id).name == bt.name
        assert (bt.block_size, bt.type_size) == gguf.GGML_QUANT_SIZES[QT(type_id)]
        assert block_type(type_id) is bt
        assert getattr(blocks, bt.name) is bt
    for bad in (99, 19, 29, -1, 2**32):
        with pytest.raises(GGUFError, match="unknown block type"):
            block_type(bad)


GGUF_PY_TYPES = ["F32", "F16", "BF16", *F16_FIELDS]


@pytest.mark.parametrize("name", GGUF_PY_TYPES)
def test_dequantize_matches_gguf_py_on_random_blocks(name: str) -> None:
    bt = BLOCK_TYPES[int(QT[name])]
    raw = random_blocks(bt)
    expected = gguf.quants.dequantize(raw, QT[name]).reshape(-1).astype(np.float32)
    same_bits(bt.dequantize(raw), expected)
    # a non-contiguous or multi-dimensional input is read the same way
    rows = np.stack([raw, np.zeros_like(raw)], axis=1)[:, 0].reshape(-1, bt.type_size)
    same_bits(bt.dequantize(rows), expected)


def ggml_base() -> ctypes.CDLL:
    """llama-cpp-python's libggml-base (ggml's own quantize and dequantize routines); skips without it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed")
    return ctypes.CDLL(str(Path(spec.origin).parent / "lib" / "libggml-base.so"))


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_dequantize_matches_ggml_on_random_blocks(name: str) -> None:
    """ggml's own dequantize_row_* (C, as llama.cpp runs it) gives the same bits as ours."""
    bt = BLOCK_TYPES[int(QT[name])]
    symbol = "dequantize_row_" + (name[:-2].lower() + "_K" if name.endswith("_K") else name.lower())
    dequantize_row = getattr(ggml_base(), symbol)
    dequantize_row.argtypes, dequantize_row.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    raw = random_blocks(bt, seed=5)
    expected = np.empty(bt.n_elements(raw), dtype=np.float32)
    dequantize_row(raw.ctypes.data, expected.ctypes.data, expected.size)
    same_bits(bt.dequantize(raw), expected)


def test_iq_grids_cover_their_index_fields() -> None:
    """Each grid has exactly 2**bits points for its index field's bits, all of finite positive magnitudes, so a
    block's every bit pattern decodes; the implied eighth sign of a 7-bit sign index keeps minus signs even."""
    grids = {"IQ2_XXS": (iq_blocks.IQ2XXS_GRID, 8, 8), "IQ2_XS": (iq_blocks.IQ2XS_GRID, 9, 8),
             "IQ2_S": (iq_blocks.IQ2S_GRID, 10, 8), "IQ3_XXS": (iq_blocks.IQ3XXS_GRID, 8, 4),
             "IQ3_S": (iq_blocks.IQ3S_GRID, 9, 4)}  # fmt: skip
    for name, (grid, bits, width) in grids.items():
        assert grid.shape == (2**bits, width) and grid.dtype == np.float32, name
        assert (grid > 0).all() and np.isfinite(grid).all(), name
        assert len(np.unique(grid, axis=0)) == len(grid), name
    assert iq_blocks.KSIGNS.shape == (128, 8)
    assert ((iq_blocks.KSIGNS < 0).sum(axis=1) % 2 == 0).all()
    assert (iq_blocks.SIGNS[0] == 1).all() and (iq_blocks.SIGNS[0x81] == [-1, 1, 1, 1, 1, 1, 1, -1]).all()
    # a block of all-ones bits (d = 1) reads the last grid point with every sign negative at scale 15
    factor = {"IQ2_XXS": 15.5 / 4, "IQ2_XS": 15.5 / 4, "IQ2_S": 15.5 / 4, "IQ3_XXS": 15.5 / 2, "IQ3_S": 31.0}
    for name, (grid, _, width) in grids.items():
        bt = BLOCK_TYPES[int(QT[name])]
        raw = np.full(bt.type_size, 0xFF, dtype=np.uint8)
        raw[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        expected = np.tile(grid[-1], QK_K // width) * np.float32(-factor[name])
        same_bits(bt.dequantize(raw), expected)


@pytest.mark.parametrize(
    "name,dtype", [("F64", "<f8"), ("I8", "i1"), ("I16", "<i2"), ("I32", "<i4"), ("I64", "<i8")]
)
def test_plain_types_match_numpy(name: str, dtype: str) -> None:
    bt = BLOCK_TYPES[int(QT[name])]
    rng = np.random.default_rng(1)
    if dtype.endswith("f8"):
        values = rng.standard_normal(1000)
    else:
        info = np.iinfo(np.dtype(dtype))
        values = rng.integers(info.min, info.max, 1000, dtype=np.dtype(dtype), endpoint=True)
    raw = values.astype(dtype).view(np.uint8)
    same_bits(bt.dequantize(raw), values.astype(np.float32))


def test_q8_k_matches_a_direct_loop() -> None:
    rng = np.random.default_rng(2)
    n = 20
    raw = rng.integers(0, 256, size=(n, 292), dtype=np.uint8)
    raw[:, :4] = rng.standard_normal((n, 1)).astype("<f4").view(np.uint8)
    expected = []
    for block in raw:
        (d,) = struct.unpack("<f", block[:4].tobytes())
        expected += [np.float32(d) * np.float32(int(q)) for q in block[4:260].view(np.int8)]
    same_bits(blocks.Q8_K.dequantize(raw.reshape(-1)), np.array(expected, dtype=np.float32))


def test_dequantize_refuses_bad_input() -> None:
    with pytest.raises(InvalidArgument, match="whole number"):
        blocks.Q4_K.dequantize(np.zeros(143, dtype=np.uint8))
    for bt in (blocks.IQ2_XXS, blocks.IQ2_XS, blocks.IQ2_S, blocks.IQ3_XXS, blocks.IQ3_S):
        for size in (bt.type_size - 1, 3 * bt.type_size + 5):  # a cut block, and whole ones with a tail
            with pytest.raises(InvalidArgument, match="whole number"):
                bt.dequantize(np.zeros(size, dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="uint8"):
        blocks.Q4_0.dequantize(np.zeros(18, dtype=np.int8))
    with pytest.raises(TypeError):
        blocks.Q4_0()
    assert blocks.Q4_0.dequantize(np.zeros(0, dtype=np.uint8)).shape == (0,)


INT4_TYPES = ["Q4_0", "Q4_1", "Q4_K"]


def check_unpack_int4(bt: type[BlockType], raw: np.ndarray) -> None:
    assert issubclass(bt, Int4BlockType)
    codes, scale, minimum = bt.unpack_int4(raw)
    n_groups = raw.size // bt.type_size * bt.block_size // 32
    assert codes.shape == (n_groups, 32) and codes.dtype == np.uint8 and int(codes.max()) <= 15
    assert scale.shape == minimum.shape == (n_groups,)
    assert scale.dtype == minimum.dtype == np.float32
    rebuilt = (scale[:, None] * codes.astype(np.float32) + minimum[:, None]).reshape(-1)
    # exact float32 equality; Q4_0 gives +0.0 where d * (8 - 8) is -0.0 for a negative d
    values = bt.dequantize(raw)
    assert np.isfinite(values).all()
    np.testing.assert_array_equal(rebuilt, values, strict=True)


@pytest.mark.parametrize("name", INT4_TYPES)
def test_unpack_int4_rebuilds_dequantize(name: str) -> None:
    bt = BLOCK_TYPES[int(QT[name])]
    raw = random_blocks(bt, seed=3)
    check_unpack_int4(bt, raw)
    codes, scale, minimum = bt.unpack_int4(raw)
    if name == "Q4_0":
        np.testing.assert_array_equal(minimum, np.float32(-8) * scale)
    # codes follow ggml's nibble order: value 0 is the low nibble of the first quant byte; its high
    # nibble is value 16 (Q4_0/Q4_1) or the first value of the second 32-group (Q4_K)
    first_qs = {"Q4_0": 2, "Q4_1": 4, "Q4_K": 16}[name]
    assert codes[0, 0] == raw[first_qs] & 0x0F
    high = codes[1, 0] if name == "Q4_K" else codes[0, 16]
    assert high == raw[first_qs] >> 4
    assert not any(issubclass(BLOCK_TYPES[int(QT[n])], Int4BlockType) for n in ("Q5_0", "Q8_0", "Q6_K"))


# --- the real models -----------------------------------------------------------------------------


def _sample(path: Path, per_type: int = 2, max_bytes: int = 8_000_000) -> list[tuple[str, int, np.ndarray]]:
    """Up to `per_type` tensors of each block type in the file, cut to whole rows under max_bytes."""
    out: list[tuple[str, int, np.ndarray]] = []
    counts: dict[int, int] = {}
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            if counts.get(info.type_id, 0) >= per_type:
                continue
            counts[info.type_id] = counts.get(info.type_id, 0) + 1
            rows = f.raw(name).reshape(-1, info.shape[-1] // info.block.block_size * info.block.type_size)
            keep = max(1, max_bytes // rows.shape[1])
            out.append((name, info.type_id, np.array(rows[:keep])))
    return out


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_dequantize_matches_gguf_py_on_real_tensors(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    seen = set()
    for _name, type_id, rows in _sample(path):
        seen.add(QT(type_id).name)
        bt = block_type(type_id)
        expected = gguf.quants.dequantize(rows, QT(type_id)).reshape(-1)
        same_bits(bt.dequantize(rows), expected.astype(np.float32))
        if issubclass(bt, Int4BlockType):
            check_unpack_int4(bt, rows)
    wanted = {"smollm2_gguf": {"F32", "Q4_1", "Q8_0"}, "gemma3_gguf": {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}}
    assert seen == wanted[fixture]
