"""GGUFFile against gguf-py's GGUFReader on the real models, and against a zoo of malformed files."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from superslm.errors import FormatError, GGUFError, InvalidArgument, ModelNotFound
from superslm.formats.gguf import GGUFFile
from tests.gguf_fuzz import (
    KEY_A,
    KEY_B,
    KEY_BOOL,
    KEY_INTS,
    KEY_STR,
    KEY_STRS,
    STRINGS,
    TENSOR_A,
    TENSOR_B,
    TENSOR_C,
    VALUE_SAMPLES,
    Layout,
    layout,
    patched,
    spliced,
    write_all_types_gguf,
    write_small_gguf,
)
from tests.gguf_plain_maps import plain_maps

MODELS = ["smollm2_gguf", "gemma3_gguf"]
_READERS: dict[Path, gguf.GGUFReader] = {}


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> tuple[GGUFFile, gguf.GGUFReader]:
    path: Path = request.getfixturevalue(request.param)
    if path not in _READERS:  # GGUFReader takes seconds on Gemma's vocab: build it once, over a plain view
        with plain_maps():
            _READERS[path] = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        yield f, _READERS[path]


# --- real files against gguf-py ------------------------------------------------------------------


def test_metadata_matches_gguf_py(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    f, reader = model
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    for key, field in fields.items():
        assert f.metadata[key] == field.contents(), key
        types = [t.name for t in field.types]
        expected = f"ARRAY[{types[1]}]" if types[0] == "ARRAY" else types[0]
        assert f.metadata_types[key] == expected, key
    assert f.version == reader.fields["GGUF.version"].contents()
    assert f.architecture == fields["general.architecture"].contents()
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) > 40000 and all(isinstance(t, str) for t in tokens)


def test_tensor_infos_match_gguf_py(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    f, reader = model
    assert f.alignment == reader.alignment
    assert f.data_offset == reader.data_offset
    assert list(f.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.type_id == int(t.tensor_type)
        assert info.block.name == t.tensor_type.name
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        assert info.n_elements == t.n_elements


def test_raw_and_dequantize_match_gguf_py(model: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    f, reader = model
    seen: set[int] = set()
    for t in reader.tensors:
        if int(t.tensor_type) in seen or t.n_bytes > 50_000_000:  # Gemma's embedding: its own test
            continue
        seen.add(int(t.tensor_type))
        raw = f.raw(t.name)
        assert not raw.flags.writeable
        assert raw.tobytes() == np.ascontiguousarray(t.data).view(np.uint8).tobytes()
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f.tensors[t.name].shape)
        got = f.dequantize(t.name)
        assert got.dtype == torch.float32 and got.shape == f.tensors[t.name].shape
        np.testing.assert_array_equal(got.numpy(), expected)
        # other dtypes are the float32 values, rounded once
        assert torch.equal(f.dequantize(t.name, torch.bfloat16), got.to(torch.bfloat16))
    assert len(seen) >= 3 if "gemma" in f.path else len(seen) == 3


def test_embedding_dequantize_is_fast_and_right(gemma3_gguf: Path) -> None:
    with GGUFFile(gemma3_gguf) as f:
        info = f.tensors["token_embd.weight"]
        start = time.perf_counter()
        emb = f.dequantize("token_embd.weight")
        elapsed = time.perf_counter() - start
        assert emb.shape == (262144, 640) == info.shape
        # a vectorised path is ~1 s here (mostly page faults); a per-block loop would take minutes
        assert elapsed < 6.0, elapsed
        rows = f.raw("token_embd.weight").reshape(info.shape[0], -1)  # [vocab, bytes per row]
        for lo in (0, 131072, 262144 - 64):
            expected = gguf.quants.dequantize(rows[lo : lo + 64], gguf.GGMLQuantizationType(info.type_id))
            np.testing.assert_array_equal(emb[lo : lo + 64].numpy(), expected)


def test_metadata_parses_fast(gemma3_gguf: Path, smollm2_gguf: Path) -> None:
    for path in (gemma3_gguf, smollm2_gguf):
        start = time.perf_counter()
        GGUFFile(path).close()
        assert time.perf_counter() - start < 1.0, path


def test_lifecycle_and_lookups(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "ok.gguf")
    with pytest.raises(ModelNotFound):
        GGUFFile(tmp_path / "missing.gguf")
    f = GGUFFile(path)
    view = f.raw(TENSOR_A)
    with pytest.raises(GGUFError, match="no tensor named"):
        f.raw("nope")
    f.close()
    assert f.closed
    # views handed out before close stay readable
    assert view.view(np.float32).shape == (32,)
    with pytest.raises(InvalidArgument, match="closed"):
        f.dequantize(TENSOR_A)
    f.close()  # twice is fine


def test_small_file_values(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "ok.gguf")
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        assert f.metadata[KEY_INTS] == [1, -2, 3, 40000]
        assert f.metadata[KEY_STRS] == STRINGS
        assert f.metadata[KEY_BOOL] is True
        assert f.metadata["test.float_array"] == [0.25, -1.5]
        for t in reader.tensors:
            expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f.tensors[t.name].shape)
            np.testing.assert_array_equal(f.dequantize(t.name).numpy(), expected)


IQ_GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def test_iq_tensors_read_as_gguf_py_reads_them_and_cut_ones_are_refused(tmp_path: Path) -> None:
    """A file of IQ2/IQ3 tensors (random blocks, each type's every bit pattern is valid but d's) dequantizes as
    gguf-py's reader does; cut anywhere inside the tensor data, the file is a GGUFError (a FormatError)."""
    rng = np.random.default_rng(4)
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(path, arch="llama")
    for name in IQ_GRID_TYPES:
        qt = gguf.GGMLQuantizationType[name]
        raw = rng.integers(0, 256, (3, 2 * gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)  # [3 rows, 2 blocks]
        raw.reshape(6, -1)[:, :2] = (rng.standard_normal((6, 1)) * 0.01).astype(np.float16).view(np.uint8)
        w.add_tensor(f"t.{name}", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f:
        for t in gguf.GGUFReader(path).tensors:
            assert f.tensors[t.name].shape == (3, 512) and f.tensors[t.name].block.name == t.tensor_type.name
            expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(3, 512)
            np.testing.assert_array_equal(f.dequantize(t.name).numpy(), expected)
        ends = sorted(t.offset + t.nbytes for t in f.tensors.values())
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in ends:
        for short in (1, 37):
            cut.write_bytes(data[: end - short])
            with pytest.raises(FormatError, match="past the end"):
                GGUFFile(cut)


def test_every_value_type_matches_gguf_py(tmp_path: Path) -> None:
    path = write_all_types_gguf(tmp_path / "types.gguf")
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        for t in VALUE_SAMPLES:
            for key in (f"scalar.{t.name}", f"array.{t.name}"):
                value, expected = f.metadata[key], reader.fields[key].contents()
                assert value == expected and type(value) is type(expected), key
            assert f.metadata_types[f"scalar.{t.name}"] == t.name
            assert f.metadata_types[f"array.{t.name}"] == f"ARRAY[{t.name}]"
        assert type(f.metadata["scalar.BOOL"]) is bool and type(f.metadata["scalar.FLOAT32"]) is float
        assert type(f.metadata["array.UINT64"][0]) is int


def test_version_2_and_empty_arrays(tmp_path: Path) -> None:
    path = tmp_path / "v2.gguf"
    w = gguf.GGUFWriter(path, arch="gemma3")
    w.add_array("test.no_ints", [7])
    w.add_array("test.no_strs", ["x"])
    w.add_uint64("test.big", 2**64 - 1)
    w.add_int8("test.neg", -5)
    w.add_float64("test.f64", 1e300)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = patched(path.read_bytes(), 4, "I", 2)
    # gguf-py writes no empty arrays: empty these two (the file has no tensors, so nothing shifts)
    for key, item_bytes in (("test.no_ints", 4), ("test.no_strs", 8 + 1)):
        length_at = data.find(key.encode()) + len(key) + 4 + 4
        data = patched(data, length_at, "Q", 0)
        data = data[: length_at + 8] + data[length_at + 8 + item_bytes :]
    path.write_bytes(data)
    with GGUFFile(path) as f:
        assert f.version == 2 and f.architecture == "gemma3" and f.tensors == {}
        assert f.metadata["test.no_ints"] == [] and f.metadata_types["test.no_ints"] == "ARRAY[INT32]"
        assert f.metadata["test.no_strs"] == [] and f.metadata_types["test.no_strs"] == "ARRAY[STRING]"
        assert f.metadata["test.big"] == 2**64 - 1 and f.metadata["test.neg"] == -5
        assert f.metadata["test.f64"] == 1e300


def test_invalid_utf8_string_value_is_replaced(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "ok.gguf")
    lay = layout(path)
    at = lay.value_at(KEY_STR) + 8  # first byte of "a string value"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(spliced(lay.data, at, b"\xff"))
    with GGUFFile(bad) as f:
        assert f.metadata[KEY_STR] == "\ufffd string value"
    bad.write_bytes(spliced(lay.data, lay.key_len_at(KEY_STR) + 8, b"\xff"))
    with pytest.raises(GGUFError, match="UTF-8"):
        GGUFFile(bad)


# --- malformed files -----------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> Layout:
    return layout(write_small_gguf(tmp_path / "ok.gguf"))


def _refused(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=match):
        GGUFFile(path)
    assert time.perf_counter() - start < 1.0


U64_MAX = 2**64 - 1


def _cases(lay: Layout) -> dict[str, tuple[bytes, str]]:
    d = lay.data
    ta, tb, tc = (lay.tensors[n] for n in (TENSOR_A, TENSOR_B, TENSOR_C))
    n_kv = int.from_bytes(d[16:24], "little")
    n_tensors = int.from_bytes(d[8:16], "little")
    return {
        "bad magic": (spliced(d, 0, b"GGUX"), "not a GGUF file"),
        "zero magic": (spliced(d, 0, b"\0\0\0\0"), "not a GGUF file"),
        "version 1": (patched(d, 4, "I", 1), "unsupported GGUF version 1"),
        "version 4": (patched(d, 4, "I", 4), "unsupported GGUF version 4"),
        "version max": (patched(d, 4, "I", 2**32 - 1), "unsupported GGUF version"),
        "big endian": (patched(d, 4, ">I", 3), "big-endian"),
        "huge tensor count": (patched(d, lay.n_tensors_at, "Q", U64_MAX), "tensor count"),
        "large tensor count": (patched(d, lay.n_tensors_at, "Q", 2**40), "tensor count"),
        "tensor count + 1": (patched(d, lay.n_tensors_at, "Q", n_tensors + 1), "truncated|past the end"),
        "huge kv count": (patched(d, lay.n_kv_at, "Q", U64_MAX), "metadata count"),
        "kv count + 1": (patched(d, lay.n_kv_at, "Q", n_kv + 1), "."),
        "huge key length": (patched(d, lay.key_len_at(KEY_A), "Q", U64_MAX), "truncated"),
        "key length 2**63": (patched(d, lay.key_len_at(KEY_A), "Q", 2**63), "truncated"),
        "huge string length": (patched(d, lay.value_at(KEY_STR), "Q", U64_MAX), "truncated"),
        "huge int array": (patched(d, lay.value_at(KEY_INTS) + 4, "Q", U64_MAX), "array of"),
        "int array + 1e6": (patched(d, lay.value_at(KEY_INTS) + 4, "Q", 10**6), "array of"),
        "huge string array": (patched(d, lay.value_at(KEY_STRS) + 4, "Q", U64_MAX), "array of"),
        "string array + 1": (patched(d, lay.value_at(KEY_STRS) + 4, "Q", len(STRINGS) + 1), "."),
        "huge element length": (patched(d, lay.value_at(KEY_STRS) + 12, "Q", U64_MAX), "has length"),
        "huge tensor name": (patched(d, tb.name_len_at, "Q", U64_MAX), "truncated"),
        "unknown value type": (patched(d, lay.value_type_at(KEY_A), "I", 13), "unknown value type 13"),
        "value type max": (patched(d, lay.value_type_at(KEY_A), "I", 2**32 - 1), "unknown value type"),
        "unknown item type": (patched(d, lay.value_at(KEY_INTS), "I", 13), "unknown array item type"),
        "nested array": (patched(d, lay.value_at(KEY_INTS), "I", 9), "arrays of arrays"),
        "bool 2": (patched(d, lay.value_at(KEY_BOOL), "B", 2), "bool"),
        "duplicate key": (spliced(d, lay.key_len_at(KEY_B) + 8, KEY_A.encode()), "duplicate metadata"),
        "duplicate tensor": (spliced(d, tb.n_dims_at - len(TENSOR_B), TENSOR_A.encode()), "duplicate tensor"),
        "n_dims 0": (patched(d, tb.n_dims_at, "I", 0), "n_dims 0"),
        "n_dims 5": (patched(d, tb.n_dims_at, "I", 5), "n_dims 5"),
        "n_dims max": (patched(d, tb.n_dims_at, "I", 2**32 - 1), "n_dims"),
        "dim 0": (patched(d, tb.dims_at + 8, "Q", 0), "dimension of 0"),
        "huge dims": (patched(d, tb.dims_at + 8, "Q", U64_MAX), "past the end"),
        "row not whole blocks": (patched(d, tb.dims_at, "Q", 48), "not a multiple"),
        "unknown block type": (patched(d, tb.type_at, "I", 99), "unknown block type 99"),
        "unsupported block type": (patched(d, tb.type_at, "I", 19), "unknown block type 19.*IQ1_S"),
        "rows shorter than a block": (patched(d, tb.type_at, "I", 21), "row length 64 .* IQ3_S block size 256"),
        "unaligned offset": (patched(d, tb.offset_at, "Q", tb.offset + 1), "not aligned"),
        "offset out of file": (patched(d, tb.offset_at, "Q", 2**40), "past the end"),
        "offset near 2**64": (patched(d, tb.offset_at, "Q", 2**64 - 32), "past the end"),
        "overlap": (patched(d, tb.offset_at, "Q", ta.offset), "overlap"),
        "overlap last": (patched(d, tc.offset_at, "Q", tb.offset), "overlap"),
        "empty": (b"", "truncated"),
        "magic only": (b"GGUF", "truncated"),
    }


def test_malformed_files_are_refused(tmp_path: Path, small: Layout) -> None:
    for name, (data, match) in _cases(small).items():
        try:
            _refused(tmp_path, data, match)
        except BaseException as e:
            raise AssertionError(f"case {name!r}") from e


def test_bad_alignment_is_refused(tmp_path: Path) -> None:
    lay = layout(write_small_gguf(tmp_path / "ok.gguf", alignment=64))
    with GGUFFile(tmp_path / "ok.gguf") as f:
        assert f.alignment == 64 and all(t.offset % 64 == 0 for t in f.tensors.values())
    at = lay.value_at("general.alignment")
    for value in (0, 3, 48, 2**32 - 1):
        _refused(tmp_path, patched(lay.data, at, "I", value), "not a power of two")
    # INT32 instead of UINT32
    _refused(tmp_path, patched(lay.data, lay.value_type_at("general.alignment"), "I", 5), "expected UINT32")
    # a larger power of two misaligns the stored offsets or pushes data past the end
    _refused(tmp_path, patched(lay.data, at, "I", 2**20), "not aligned|past the end")


def test_every_truncation_is_refused(tmp_path: Path, small: Layout) -> None:
    path = tmp_path / "cut.gguf"
    for cut in range(small.data_end):
        path.write_bytes(small.data[:cut])
        with pytest.raises(GGUFError) as err:
            GGUFFile(path)
        if cut < small.header_end:
            assert "truncated" in str(err.value), (cut, str(err.value))
        else:
            assert "past the end" in str(err.value), (cut, str(err.value))
    # trailing padding after the last tensor is not needed
    path.write_bytes(small.data[: small.data_end])
    GGUFFile(path).close()


@pytest.mark.parametrize("base", ["small", "all_types"])
def test_random_corruptions_never_crash(tmp_path: Path, base: str) -> None:
    if base == "small":
        original = write_small_gguf(tmp_path / "ok.gguf").read_bytes()
        region = layout(tmp_path / "ok.gguf").header_end
    else:
        original = write_all_types_gguf(tmp_path / "ok.gguf").read_bytes()
        region = len(original)
    rng = np.random.default_rng(0)
    path = tmp_path / "fuzz.gguf"
    n_loaded = 0
    start = time.perf_counter()
    for _ in range(1500):
        data = bytearray(original)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, region))
            if rng.random() < 0.3 and at + 8 <= len(data):
                # u64-sized garbage: where counts, lengths and offsets live
                data[at : at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
            else:
                data[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        try:
            f = GGUFFile(path)
        except GGUFError:
            continue
        n_loaded += 1
        with f:
            spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert all(s >= f.data_offset and e <= f.file_size for s, e in spans)
            for name, info in f.tensors.items():
                assert f.dequantize(name).shape == info.shape
    assert n_loaded > 0  # some corruptions (inside values) leave a valid file
    assert time.perf_counter() - start < 30


def test_released_pages_read_back(tmp_path) -> None:
    # MADV_DONTNEED on the read-only map drops resident pages; reads fault them back unchanged
    f = GGUFFile(write_small_gguf(tmp_path / "small.gguf"))
    before = {name: np.array(f.raw(name), copy=True) for name in f.tensors}
    f.release_pages()
    for name, raw in before.items():
        assert np.array_equal(np.asarray(f.raw(name)), raw)
    f.close()
    f.release_pages()  # a closed file: nothing to release, no error


def test_metadata_digest_follows_the_metadata_bytes(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The tokenizer cache's key: the same for the same file, different when one metadata byte differs,
    and untouched by tensor data."""
    a = GGUFFile(smollm2_gguf)
    assert a.metadata_digest() == GGUFFile(smollm2_gguf).metadata_digest()
    data = bytearray(smollm2_gguf.read_bytes())
    at = data.index(b"im_start")  # inside the chat template string
    changed = tmp_path / "changed.gguf"
    changed.write_bytes(bytes(data[:at]) + b"IM_start" + bytes(data[at + 8 :]))
    assert GGUFFile(changed).metadata_digest() != a.metadata_digest()
    data[-1] ^= 0xFF  # the last byte of tensor data
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    assert GGUFFile(other).metadata_digest() == a.metadata_digest()
    a.close()
    with pytest.raises(GGUFError):
        a.metadata_digest()


def test_long_arrays_stay_in_the_map(tmp_path: Path) -> None:
    """Arrays past LAZY_ITEMS are GGUFArrays read from the map on access: equal to gguf-py's lists, plain
    Python items, invalid UTF-8 replaced as in the eager parse, still readable after close()."""
    from superslm.formats.gguf_array import LAZY_ITEMS, GGUFArray

    n = LAZY_ITEMS + 5
    strs = [f"tok{i}" + "▁é" * (i % 3) for i in range(n)]
    strs[7] = "marker"
    path = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(path, arch="gemma3")
    w.add_array("long.strs", strs)
    w.add_array("long.ints", list(range(-3, n - 3)))
    w.add_array("long.floats", [i / 4 for i in range(n)])
    w.add_array("long.bools", [i % 2 == 0 for i in range(n)])
    w.add_array("short.strs", strs[:LAZY_ITEMS])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    f = GGUFFile(path)
    md = f.metadata
    assert isinstance(md["short.strs"], list)  # at the threshold: parsed as before
    for key in ("long.strs", "long.ints", "long.floats", "long.bools"):
        arr = md[key]
        assert isinstance(arr, GGUFArray) and len(arr) == n
        expected = reader.fields[key].contents()
        assert arr == expected and arr.tolist() == expected and list(arr) == expected, key
        assert [type(v) for v in arr[:3]] == [type(v) for v in expected[:3]], key
        assert arr[-1] == expected[-1] and arr[5:9] == expected[5:9] and arr[::1000] == expected[::1000]
        with pytest.raises(IndexError):
            arr[n]
    assert md["long.strs"][7] == "marker" and md["long.strs"].raw(2) == "tok2▁é▁é".encode()
    assert md["long.ints"] != md["long.floats"] and md["long.ints"] != strs
    assert md["long.ints"].numpy().dtype == np.int32 and md["long.bools"].numpy().dtype == bool
    with pytest.raises(TypeError):
        md["long.strs"].numpy()
    f.close()
    assert md["long.strs"][n - 1] == strs[-1]  # the arrays keep their view of the map
    bad = tmp_path / "bad.gguf"
    data = path.read_bytes()
    at = data.find(b"marker")
    bad.write_bytes(data[:at] + b"\xff" + data[at + 1 :])
    with GGUFFile(bad) as g:
        assert g.metadata["long.strs"][7] == "\ufffdarker"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.find(b"tok4000")])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(cut)


@pytest.fixture(scope="module")
def tiny_llama_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's float32 GGUF of a tiny random llama whose rows are 256 or 512 long (whole super-blocks, so every
    linear can take the 256-value block types)."""
    from tests.llama_cpp_convert import convert
    from tests.tiny_models import CONFIGS, build_hf_model

    cls, kwargs = CONFIGS["llama"]
    tmp = tmp_path_factory.mktemp("tiny_llama")
    build_hf_model("llama", tmp / "hf", spec=(cls, dict(kwargs, hidden_size=256, intermediate_size=512,
                                                        head_dim=64, num_attention_heads=4, num_key_value_heads=2)))
    return convert(tmp / "hf", tmp / "f32.gguf")


def last_logits_beside_llama_cpp(path: Path, model: object, tokens: list[int]
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The last row's logits (float64) of `tokens` through `model` (loaded from the GGUF `path`), through the same
    file loaded in float32, and through llama.cpp on the file."""
    import llama_cpp

    import superslm
    from benchmarks.kv_speed import _no_extra_buffer_types
    from tests.tiny_models import SingleSequence

    with torch.no_grad():
        ours = SingleSequence(model.net).step(tokens)[-1].double()  # type: ignore[attr-defined]
        dense = SingleSequence(superslm.load(path, dtype=torch.float32).net).step(tokens)[-1].double()
    _no_extra_buffer_types()  # llama.cpp's AMX buffers crash on some CPUs (see there)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(tokens)
    return ours, dense, torch.tensor(np.asarray(llm.scores[len(tokens) - 1]), dtype=torch.float64)


def _quantize_with_llama_cpp(f32: Path, out: Path, ftype: str) -> None:
    """llama.cpp's quantizer with its own per-tensor choice of types for `ftype`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0


def _quantize_with_ggml(f32: Path, out: Path, block: str) -> None:
    """Every blk.* matrix of `f32` quantized to `block` by ggml_quantize_chunk with an importance matrix of ones:
    llama.cpp's quantizer refuses IQ2_XXS, IQ2_XS, IQ2_S and IQ3_XXS without an imatrix, and takes one only as a C++
    map, while ggml's own routine takes it as a float array."""
    from tests.test_blocks import ggml_base

    lib = ggml_base()
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
        ctypes.c_void_p]  # fmt: skip
    qt = gguf.GGMLQuantizationType[block]
    reader = gguf.GGUFReader(f32)
    w = gguf.GGUFWriter(out, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if not (t.name.startswith("blk.") and t.data.ndim == 2):
            w.add_tensor(t.name, np.array(t.data))
            continue
        n, k = t.data.shape
        x = np.ascontiguousarray(t.data, dtype=np.float32)
        q = np.empty((n, k // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
        importance = np.ones(k, dtype=np.float32)
        assert lib.ggml_quantize_chunk(int(qt), x.ctypes.data, q.ctypes.data, 0, n, k, importance.ctypes.data) == q.size
        w.add_tensor(t.name, q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.slow  # fetches llama-cpp-python's source distribution from PyPI once
@pytest.mark.parametrize(
    "block,quantizer",
    [("IQ4_XS", "llama.cpp"), ("IQ4_NL", "llama.cpp"), ("IQ3_S", "llama.cpp")] + [(b, "ggml") for b in IQ_GRID_TYPES],
)
def test_iq_files_from_llama_cpp_load_and_answer_as_llama_cpp(block: str, quantizer: str, tiny_llama_f32: Path,
                                                              tmp_path: Path) -> None:
    """llama.cpp (or, for the types its quantizer wants an imatrix for, ggml's own quantize routine) writes an IQ
    file: it loads, its linears say where they came from, and its logits follow llama.cpp's own on the same file."""
    pytest.importorskip("llama_cpp")
    import superslm

    out = tmp_path / f"{block}.gguf"
    (_quantize_with_llama_cpp if quantizer == "llama.cpp" else _quantize_with_ggml)(tiny_llama_f32, out, block)
    types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert block in types, types
    model = superslm.load(out)
    assert any(f"from {block}" in name for name in model.info()["linears"]), model.info()["linears"]
    tokens = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, dense, theirs = last_logits_beside_llama_cpp(out, model, tokens)
    # the file's values in float32 (dense) against llama.cpp's 8-bit activations: the same argmax
    assert int(dense.argmax()) == int(theirs.argmax())
    # ours run the IQ2/IQ3 types as int8 per channel with bf16 activations (about 1% of W x, quant/gguf_map.py), IQ4
    # as stored (giq4) with bf16 activations: a near tie may swap, so llama.cpp must rank our choice within a
    # quarter of its logits' deviation of its own top
    assert theirs[int(ours.argmax())] >= theirs.max() - 0.25 * theirs.std()
    for got in (dense, ours):
        assert torch.corrcoef(torch.stack([got, theirs]))[0, 1] > 0.995
