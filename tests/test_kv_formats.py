"""KV page formats (cache/kv.py): int8 rows (codes and a float32 scale per token and kv head) and rotated 4-bit rows
(each head through a Hadamard rotation, then 4-bit codes and a scale) against float pages, on the CPU (quantized
pages are refused on a GPU until the Triton kernels read them); and what "auto" chooses.

Quantized as written (store_kv, the C++ plan's own store), read without a dense copy of the cache (the torch
references dequantize the rows they gather; the C++ plan multiplies codes by their row's scale; 4-bit rows are
attended in their rotated basis).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache import kv as kvmod
from superslm.cache.kv import (
    KVCache,
    choose_format,
    dequantize_rows,
    dequantize_rows4,
    kv_format,
    quantize_rows,
    quantize_rows4,
    read_rows,
    rotate,
    slot_mapping,
    unrotate,
    write_rows,
)
from superslm.errors import InvalidArgument, SuperSLMError
from superslm.kernels import cpu_decode, hadamard
from superslm.kernels.attention import AttnMetadata, paged_attention, store_kv
from superslm.kernels.attention_invariant import paged_attention_invariant
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from superslm.quant import quantize_linears
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model

cpp = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")

PS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    out = {}
    for family in ("llama", "qwen3", "gemma3", "qwen3_5"):
        path = tmp_path_factory.mktemp(f"kv-{family}")
        build_hf_model(family, path)
        out[family] = path
    return out


# --- names and bytes ---------------------------------------------------------------------------------------


def test_format_names() -> None:
    assert kv_format("int8") == kv_format("K8V8") == kv_format("k8v8")
    assert kv_format("int8").quantized and not kv_format("auto").quantized and not kv_format(None).quantized
    assert kv_format("bf16").dtype == torch.bfloat16 and kv_format("auto").dtype is None
    assert kv_format("int4") == kv_format("K4V4")
    assert (kv_format("k4v4").key_bits, kv_format("k4v4").value_bits) == (4, 4)
    assert (kv_format("k8v4").key_bits, kv_format("k8v4").value_bits) == (8, 4)
    assert (kv_format("k4v8").key_bits, kv_format("k4v8").value_bits) == (4, 8)
    for bad in ("int7", "", "k4v2", 8):
        with pytest.raises(InvalidArgument):
            kv_format(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        KVCache(1, 2, PS, 1, 6, kv="int8")
    with pytest.raises(InvalidArgument, match="CPU"):
        KVCache(1, 2, PS, 1, 64, kv="int8", device="cuda")  # refused before any allocation
    for fmt in ("k8v4", "k4v8", "k4v4"):
        with pytest.raises(InvalidArgument, match="multiple of 32"):
            KVCache(1, 2, PS, 1, 48, kv=fmt)  # 48: a Hadamard block of 16, too small to spread an outlier
        with pytest.raises(InvalidArgument, match="CPU"):
            KVCache(1, 2, PS, 1, 64, kv=fmt, device="cuda")
    KVCache(1, 2, PS, 1, 48, kv="int8")  # int8 rows are not rotated: any multiple of 4
    kv = KVCache(1, 2, PS, 2, 96, kv="k8v4")  # 96: three blocks of 32
    assert (kv.k.dtype, kv.k.shape[-1], kv.v.dtype, kv.v.shape[-1]) == (torch.int8, 100, torch.uint8, 52)


def test_page_bytes_about_halve() -> None:
    # SmolLM2-135M's shape: 30 layers, 3 kv heads of 64; each row 64 codes + a 4-byte scale against 128 bf16 bytes
    bf16 = KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16)
    int8 = KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, "int8")
    assert bf16 == 30 * 16 * 3 * 2 * 128 and int8 * 128 == bf16 * 68
    kv = KVCache(30, 2, 16, 3, 64, torch.bfloat16, kv="int8")
    assert 2 * (kv.k.numel() * kv.k.element_size()) == 2 * int8  # what is allocated is what page_bytes says
    assert KVCache.page_bytes(2, 4, 1, 32, torch.float32, "fp32") == KVCache.page_bytes(2, 4, 1, 32, torch.float32)
    # 4-bit rows: 32 bytes of codes + a 4-byte scale for a head of 64; k8v4 mixes the two widths
    assert KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, "k4v4") == 30 * 16 * 3 * 2 * 36
    assert KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, "k8v4") == 30 * 16 * 3 * (68 + 36)
    kv4 = KVCache(30, 2, 16, 3, 64, torch.bfloat16, kv="k4v4")
    assert 2 * kv4.k.numel() * kv4.k.element_size() == KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, "k4v4") * 2


def test_same_budget_holds_about_twice_the_pages(folders) -> None:
    model = superslm.load(folders["llama"], device="cpu", dtype=torch.bfloat16)
    budget = 200 * KVCache.page_bytes(model.net.kv_layers, 16, model.arch.kv_heads, model.arch.head_dim, model.dtype)
    plain = model.engine(slots=2, context=64, kv_budget=budget)
    small = model.engine(slots=2, context=64, kv_budget=budget, kv="int8")
    d = model.arch.head_dim
    assert plain.kv.num_pages == 200 and small.kv.num_pages == 200 * 2 * d // (d + 4)
    assert small.kv.k.dtype == torch.int8 and small.kv.k.shape[-1] == d + 4
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        model.engine(slots=2, context=64, kv="k4v4")  # the tiny llama's heads are 16 wide


# --- rows, store and read ----------------------------------------------------------------------------------


def test_rows_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert rows[..., :64].abs().max() == 127  # the largest value of each row takes the full range
    err = (dequantize_rows(rows, torch.float32) - x).abs()
    assert (err <= scale * 0.5 * (1 + 1e-6)).all()
    assert err.max() > 0  # quantization happened
    zero = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(zero, torch.zeros(2, 12, dtype=torch.int8))  # codes 0, scale 0.0
    assert torch.equal(dequantize_rows(zero, torch.float32), torch.zeros(2, 8))


def test_store_and_read_only_the_gathered_rows() -> None:
    g = torch.Generator().manual_seed(1)
    kv = KVCache(1, 8, PS, 2, 16, torch.bfloat16, kv="int8")
    k, v = torch.randn(5, 2, 16, generator=g).bfloat16(), torch.randn(5, 2, 16, generator=g).bfloat16()
    slots = torch.tensor([3, 17, 9, 30, 0])
    store_kv(kv.k[0], kv.v[0], k, v, slots)
    assert torch.equal(kv.k[0][slots], quantize_rows(k)) and torch.equal(kv.v[0][slots], quantize_rows(v))
    got = read_rows(kv.k[0], slots[[4, 1]], torch.float32)
    assert got.shape == (2, 2, 16)
    assert (got - k[[4, 1]].float()).abs().max() <= k.float().abs().max() / 254 * 1.001
    untouched = torch.ones(kv.k.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not kv.k[0][untouched].any()


def test_rotation_is_the_seeded_block_hadamard() -> None:
    g = torch.Generator().manual_seed(7)
    for d, block in ((64, 64), (96, 32), (256, 256), (512, 256)):
        x = torch.randn(9, 2, d, generator=g)
        r = rotate(x)
        # the independent reference: kernels/hadamard.py's rotation with the same seed and block
        assert (r - hadamard.rotate_activation(x, kvmod.ROTATION_SEED, block)).abs().max() <= 1e-5
        assert (unrotate(r) - x).abs().max() <= 1e-5
        assert torch.allclose(r.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # orthogonal
        # butterflies, not a matmul: a row's bits do not depend on the rows beside it
        assert torch.equal(rotate(x[3:4, 1:2]), r[3:4, 1:2])


def _unpack4(rows: torch.Tensor) -> tuple[list[int], float]:
    """One 4-bit row read byte by byte in plain Python: (codes - 8, scale)."""
    b = rows.tolist()
    codes = []
    for byte in b[:-4]:
        codes += [(byte & 15) - 8, (byte >> 4) - 8]
    return codes, float(rows[-4:].contiguous().view(torch.float32))


def test_4bit_rows_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-3, 2, 40)[:, None, None]
    x[:, :, 5] *= 30  # an outlier channel, as keys have: the rotation spreads it over the head
    r = rotate(x)
    rows = quantize_rows4(r)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 3, 36)
    scale = rows[..., 32:].contiguous().view(torch.float32)
    assert torch.equal(scale, r.abs().amax(-1, keepdim=True) / 7)
    for i, h in ((0, 0), (17, 2), (39, 1)):  # the layout: element 2i in byte i's low nibble, code + 8
        codes, sc = _unpack4(rows[i, h])
        assert codes == (r[i, h] / sc).round().clamp(-7, 7).int().tolist() and sc == scale[i, h].item()
    err = dequantize_rows4(rows, torch.float32) - r
    assert (err.abs() <= scale * 0.5 * (1 + 1e-6)).all() and err.abs().max() > 0
    # read_rows gives the values back: the rotation is orthogonal, so the error's length is the rotated one's
    cache = torch.zeros(50, 3, 36, dtype=torch.uint8)
    slots = torch.randperm(50, generator=g)[:40]
    write_rows(cache, slots, x)
    back = read_rows(cache, slots, torch.float32)
    assert ((back - x).norm(dim=-1) <= err.norm(dim=-1) * (1 + 1e-4) + 1e-6).all()
    assert ((back - x).norm(dim=-1) <= 0.5 * scale[..., 0] * 8 * (1 + 1e-5)).all()  # sqrt(64) half steps
    zero = quantize_rows4(torch.zeros(2, 32))
    assert (zero[:, :16] == 0x88).all() and torch.equal(dequantize_rows4(zero, torch.float32), torch.zeros(2, 32))
    nan = torch.zeros(1, 32)
    nan[0, 3] = float("nan")
    bad = quantize_rows4(nan)
    assert (bad[0, :16] == 0x88).all() and dequantize_rows4(bad, torch.float32).isnan().all()


def test_4bit_rows_beat_plain_4bit_on_outlier_keys() -> None:
    """The reason for the rotation: keys with a few large channels lose far less through rotated 4-bit rows
    than through the same rows unrotated."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(200, 64, generator=g)
    x[:, [3, 40]] *= 20
    rotated = (unrotate(dequantize_rows4(quantize_rows4(rotate(x)), torch.float32)) - x).norm(dim=-1)
    plain = (dequantize_rows4(quantize_rows4(x), torch.float32) - x).norm(dim=-1)
    assert rotated.mean() < 0.5 * plain.mean()


def _filled(kv: KVCache, lengths: list[int], heads: int, g: torch.Generator) -> AttnMetadata:
    """Random keys and values for sequences of `lengths` on shuffled pages, and a step with one decode row each
    and a prompt chunk of 5 rows for the last."""
    layer_k, layer_v = kv.k[0], kv.v[0]
    perm = torch.randperm(kv.num_pages, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(tuple(perm[used : used + -(-n // PS)]))
        used += len(tables[-1])
    d = kv.head_dim
    for t, n in zip(tables, lengths):
        slots = torch.tensor(slot_mapping(t, 0, n, PS))
        kk, vv = torch.randn(n, layer_k.shape[1], d, generator=g), torch.randn(n, layer_k.shape[1], d, generator=g)
        store_kv(layer_k, layer_v, kk, vv, slots)
    qs, pos, rows = [0], [], []
    for i, (t, n) in enumerate(zip(tables, lengths)):
        r = 5 if i == len(lengths) - 1 else 1
        pos += list(range(n - r, n))
        rows += slot_mapping(t, n - r, n, PS)
        qs.append(qs[-1] + r)
    return AttnMetadata(torch.tensor(pos), torch.tensor(rows), tuple(qs), tuple(lengths), tuple(tables), PS)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_over_int8_pages_is_close_to_float_pages(window: int | None) -> None:
    heads, kvh, d = 4, 2, 32
    outs = {}
    for fmt in ("auto", "int8"):
        g = torch.Generator().manual_seed(2)
        kv = KVCache(1, 40, PS, kvh, d, torch.float32, kv=fmt)
        meta = _filled(kv, [3, 20, 37, 50], heads, g)
        q = torch.randn(meta.query_start[-1], heads, d, generator=g)
        outs[fmt] = (paged_attention(q, kv.k[0], kv.v[0], meta, window, d**-0.5),
                     paged_attention_invariant(q, kv.k[0], kv.v[0], meta, window, d**-0.5))
    ref, inv = outs["auto"]
    ref8, inv8 = outs["int8"]
    # int8 rows: ~0.4% of each row's largest value; the attention averages those errors
    assert 0 < (ref8 - ref).abs().max() <= 0.02
    assert (inv8 - ref8).abs().max() <= 1e-5  # the batch-invariant reference reads the same rows
    assert (inv - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("fmt", ["k8v4", "k4v8", "k4v4"])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_over_4bit_pages_is_close_to_float_pages(fmt: str, window: int | None) -> None:
    heads, kvh, d = 4, 2, 64
    outs = {}
    for name in ("auto", fmt):
        g = torch.Generator().manual_seed(2)
        kv = KVCache(1, 40, PS, kvh, d, torch.float32, kv=name)
        meta = _filled(kv, [3, 20, 37, 50], heads, g)
        q = torch.randn(meta.query_start[-1], heads, d, generator=g)
        outs[name] = (paged_attention(q, kv.k[0], kv.v[0], meta, window, d**-0.5),
                      paged_attention_invariant(q, kv.k[0], kv.v[0], meta, window, d**-0.5), q, kv, meta)
    ref = outs["auto"][0]
    got, inv, q, kv, meta = outs[fmt]
    # 4-bit rows: up to 1/14 of each rotated row's largest value per element; the softmax averages those errors
    err = (got - ref).abs()
    assert 0.005 < err.max() <= 0.35 and err.mean() <= 0.08, (err.max(), err.mean())  # a wrong read is off by O(1)
    # paged_attention attends in the rotated basis; the batch-invariant reference un-rotates every row it reads
    assert (inv - got).abs().max() <= 1e-5
    # and both are the plain attention over the values read_rows gives back
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        first, mask = meta.mask(s, window)
        slots = meta.key_slots(s)[first:]
        k = read_rows(kv.k[0], slots, torch.float32).transpose(0, 1).repeat_interleave(2, 0)
        v = read_rows(kv.v[0], slots, torch.float32).transpose(0, 1).repeat_interleave(2, 0)
        p = torch.softmax((q[a:b].transpose(0, 1) @ k.transpose(1, 2)) * d**-0.5 + (~mask) * -1e30, -1)
        assert (got[a:b] - (p @ v).transpose(0, 1)).abs().max() <= 1e-5


# --- the C++ plan ------------------------------------------------------------------------------------------


def _prefilled(net: Transformer, lengths: list[int], kv_fmt: str, seed: int = 0):
    a = net.arch
    pages = 64
    kv = KVCache(len(net.layers), pages, PS, a.kv_heads, a.head_dim, net.dtype, kv=kv_fmt)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(tuple(perm[used : used + n // PS + 1]))
        used += n // PS + 1
    net.fast_decode = False
    with torch.no_grad():
        for table, n in zip(tables, lengths):
            toks = torch.randint(0, a.vocab, (n,), generator=g)
            slots = torch.tensor(slot_mapping(table, 0, n, PS))
            meta = AttnMetadata(torch.arange(n), slots, (0, n), (n,), (table,), PS)
            net.run_layers(net.embed(toks), meta, kv.k, kv.v)
    pos = torch.tensor(lengths)
    slots = torch.tensor([slot_mapping(t, n, n + 1, PS)[0] for t, n in zip(tables, lengths)])
    meta = AttnMetadata(pos, slots, tuple(range(len(lengths) + 1)), tuple(n + 1 for n in lengths), tuple(tables), PS)
    return kv, meta, torch.randint(0, a.vocab, (len(lengths),), generator=g)


Plan = Callable[[], AbstractContextManager[object]]


def _ways(net: Transformer, lengths: list[int], kv_fmt: str,
          plan: Plan = nullcontext) -> dict[str, tuple[torch.Tensor, KVCache]]:  # fmt: skip
    """Hidden states after every layer (and the cache after the step) from the generic path, the torch reference
    of the plan and the C++ plan, each on its own copy of the same prefilled cache; the plan runs inside
    `plan()` (e.g. a context that makes its torch fallback an error)."""
    out = {}
    for way in ("generic", "reference", "cpp"):
        kv, meta, toks = _prefilled(net, lengths, kv_fmt)
        with torch.no_grad():
            h = net.embed(toks)
            if way == "generic":
                out[way] = (net.run_layers(h, meta, kv.k, kv.v), kv)
                continue
            tabs = net.rope_table_list(meta.positions)
            key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
            args = (net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0, len(net.layers))
            if way == "reference":
                out[way] = (cpu_decode.decode_layers_reference(*args), kv)
                continue
            with plan():
                out[way] = (cpu_decode.decode_layers(*args), kv)
    return out


@cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_quantizes_as_torch_does(dtype: torch.dtype) -> None:
    """decode_layers.cpp quantize_row writes cache.kv.quantize_rows' bits: codes rounded half to even, the
    scale, rows of zeros, NaN and inf rows, tiny and huge rows."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = torch.arange(32) - 15.5  # quotients at exact halves
    x = x.to(dtype)
    got = cpu_decode.extension().quantize_kv_rows(x.contiguous())
    assert torch.equal(got, quantize_rows(x))


@cpp
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_plan_reads_int8_pages_float32(family: str, folders) -> None:
    src = open_source(folders[family])
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv = KVCache(len(net.layers), 4, PS, net.arch.kv_heads, net.arch.head_dim, net.dtype, kv="int8")
    assert cpu_decode.usable(net, torch.zeros(1, net.arch.dim), kv.k)  # the plan runs it, not the reference
    # 41 keys: two full blocks of 16 (or five of 8) and a remainder in the vector attention
    ways = _ways(net, [3, 9, 14, 40], "int8")
    (generic, _), (ref, ref_kv), (got, got_kv) = ways["generic"], ways["reference"], ways["cpp"]
    assert (got - ref).abs().max().item() <= 1e-5
    assert (ref - generic).abs().max().item() <= 1e-5
    # the rows the step wrote: the plan's keys differ from torch's by float roundings only
    for a, b in ((got_kv.k, ref_kv.k), (got_kv.v, ref_kv.v)):
        assert (read_rows(a, torch.arange(a.shape[0]), torch.float32)
                - read_rows(b, torch.arange(b.shape[0]), torch.float32)).abs().max() <= 1e-3
    floats = _ways(net, [3, 9, 14, 40], "auto")["cpp"][0]
    err = (got - floats).abs().max().item()
    assert 0 < err <= 0.05 * floats.abs().max().item()  # int8 rows differ from float pages, a little


@cpp
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", [None, "int8"])
def test_plan_reads_int8_pages_bfloat16(family: str, fmt: str | None, folders) -> None:
    src = open_source(folders[family])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    if fmt is not None:
        quantize_linears(net, body=fmt, head=None, group=32)
    ways = _ways(net, [2, 7, 13, 35], "int8")
    generic, ref, got = (ways[w][0].float() for w in ("generic", "reference", "cpp"))
    scale = generic.abs().max().item()
    # as tests/test_cpu_decode.py: one bf16 rounding compounds over a few layers; a wrong read is off by O(1)
    assert (got - ref).abs().max().item() <= 2**-5 * scale
    assert (got - generic).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(got, generic, dim=-1).min().item() > 0.999


@cpp
def test_plan_reads_4bit_pages_as_the_reference_does(folders) -> None:
    """The C++ plan reads rotated 4-bit rows as they are stored (tests/test_kv_cpu4.py checks it in depth): its
    step over k4v4 pages follows the torch reference's, and differs from float pages by the format's rounding."""
    src = open_source(folders["qwen3"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    h = torch.zeros(1, net.arch.dim)
    for fmt in ("k8v4", "k4v8", "k4v4"):
        kv = KVCache(len(net.layers), 4, PS, net.arch.kv_heads, net.arch.head_dim, net.dtype, kv=fmt)
        assert cpu_decode.plan_reads(h, kv.k, kv.v) and cpu_decode.usable(net, h, kv.k)
    ways = _ways(net, [3, 9, 14, 40], "k4v4")
    (generic, _), (ref, _), (got, _) = ways["generic"], ways["reference"], ways["cpp"]
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-3 * scale and (ref - generic).abs().max().item() <= 1e-4
    floats = _ways(net, [3, 9, 14, 40], "auto")["cpp"][0]
    err = (got - floats).abs().max().item()
    assert 0 < err <= 0.25 * floats.abs().max().item()


# --- "auto" ------------------------------------------------------------------------------------------------


def _fits(budget: int, pages: int, layers: int = 30, kv_heads: int = 3, head_dim: int = 64):
    return lambda fmt: budget // KVCache.page_bytes(layers, 16, kv_heads, head_dim, torch.bfloat16, fmt) >= pages


def test_auto_picks_the_most_precise_format_that_fits(monkeypatch) -> None:
    # SmolLM2-135M's shape: 8 slots of 4,096 tokens = 2,048 pages of 16
    pages, small = 2048, 135_000_000
    per = {f: KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, f) for f in ("auto", "int8", "k8v4", "k4v4")}
    monkeypatch.setitem(kvmod.MEASURED_LOSS, "<1B", {"int8": 0.003, "k8v4": 0.01, "k4v4": 0.02})
    for budget, want in ((per["auto"] * pages, "auto"), (per["auto"] * pages - 1, "int8"),
                         (per["int8"] * pages, "int8"), (per["k8v4"] * pages, "k8v4"),
                         (per["k4v4"] * pages, "k4v4"), (per["k4v4"] * 10, "k4v4")):
        assert choose_format(small, 64, "cpu", _fits(budget, pages)).name == want, (budget, want)
    # a 4-bit format measured above +3% for the size is never picked: the most tokens then come from k8v4
    monkeypatch.setitem(kvmod.MEASURED_LOSS, "<1B", {"int8": 0.003, "k8v4": 0.01, "k4v4": 0.031})
    assert choose_format(small, 64, "cpu", _fits(per["k4v4"] * pages, pages)).name == "k8v4"
    assert choose_format(small, 64, "cpu", _fits(per["int8"] * pages - 1, pages)).name == "k8v4"
    monkeypatch.setitem(kvmod.MEASURED_LOSS, "<1B", {"int8": 0.003, "k8v4": 0.05, "k4v4": 0.2})
    assert choose_format(small, 64, "cpu", _fits(per["k4v4"] * pages, pages)).name == "int8"
    # unmeasured sizes: int8 rows, never 4-bit
    assert "1-4B" not in kvmod.MEASURED_LOSS
    assert choose_format(2_000_000_000, 64, "cpu", _fits(per["k4v4"] * pages, pages)).name == "int8"
    # formats the head or the device cannot take are skipped: heads of 48 have no 4-bit rows, a GPU no quantized
    per48 = {f: KVCache.page_bytes(30, 16, 3, 48, torch.bfloat16, f) for f in ("auto", "int8")}
    monkeypatch.setitem(kvmod.MEASURED_LOSS, "<1B", {"int8": 0.003, "k8v4": 0.01, "k4v4": 0.02})
    assert choose_format(small, 48, "cpu", _fits(per48["int8"] // 2 * pages, pages, head_dim=48)).name == "int8"
    assert choose_format(small, 64, "cuda", _fits(per["k4v4"] * pages, pages)).name == "auto"


def test_auto_measured_table_keeps_4bit_within_the_threshold() -> None:
    """The shipped table: "auto" may pick exactly the formats measured within +3% (docs/benchmarks.md)."""
    for cls, losses in kvmod.MEASURED_LOSS.items():
        for name, loss in losses.items():
            assert kv_format(name).quantized and loss >= 0
            params = {"<1B": 10**8, "1-4B": 2 * 10**9, ">=4B": 10**10}[cls]
            assert kvmod.auto_allowed(name, params) == (loss <= kvmod.AUTO_MAX_LOSS)


def test_engine_auto_keeps_float_pages_unless_they_do_not_fit(folders, monkeypatch) -> None:
    from superslm.engine import engine as engine_mod

    model = superslm.load(folders["qwen3"], device="cpu", dtype=torch.bfloat16)
    a = model.arch
    page = {f: KVCache.page_bytes(model.net.kv_layers, 16, a.kv_heads, a.head_dim, model.dtype, f)
            for f in ("auto", "int8", "k8v4", "k4v4")}
    want = 4 * (256 // 16)
    assert model.engine(slots=4, context=256).kv.k.dtype == torch.bfloat16  # this machine's memory holds them
    monkeypatch.setitem(kvmod.MEASURED_LOSS, "<1B", {"int8": 0.003, "k8v4": 0.01, "k4v4": 0.02})
    for free, dtype in ((2 * page["auto"] * want, torch.bfloat16), (2 * page["int8"] * want, torch.int8),
                        (2 * page["k4v4"] * want, torch.uint8)):
        monkeypatch.setattr(engine_mod, "_available_memory", lambda device, free=free: free)
        e = model.engine(slots=4, context=256)  # half the free memory is the budget
        assert e.kv.k.dtype == dtype and e.kv.num_pages == want
    # a budget in bytes is sized in the model dtype's pages: "auto" keeps them, fewer pages
    e = model.engine(slots=4, context=256, kv_budget=page["k4v4"] * want)
    assert e.kv.k.dtype == torch.bfloat16 and e.kv.num_pages == page["k4v4"] * want // page["auto"]
    # named formats are what they say, whatever fits
    assert model.engine(slots=4, context=256, kv="k4v4").kv.format.name == "k4v4"


# --- engines -----------------------------------------------------------------------------------------------


def _greedy(model: superslm.Model, ps: list[list[int]], n: int, **kw) -> list[list[int]]:
    engine = model.engine(**{"slots": 8, "context": 160, **kw})
    return [c.tokens for c in engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])]


def _agree_and_warm(model: superslm.Model, kv: str, warm_kv: str, steps: int, share: float) -> superslm.Engine:
    """Greedy tokens on `kv` pages agree with float pages' in at least `share` of 4 x steps places, and a warm prefix
    cache on `warm_kv` pages reads the rows its cold run wrote (same tokens); returns that engine."""
    ps = prompts(4, seed=3, lo=10, hi=60)
    floats = _greedy(model, ps, steps)
    quantized = _greedy(model, ps, steps, kv=kv)
    same = sum(a == b for x, y in zip(floats, quantized) for a, b in zip(x, y))
    assert same >= share * 4 * steps, (same, floats, quantized)
    engine = model.engine(slots=2, context=160, kv=warm_kv)
    cold = engine.generate([Request(ps[0], 12, Sampling(ignore_eos=True))])[0]
    warm = engine.generate([Request(ps[0], 12, Sampling(ignore_eos=True))])[0]
    assert warm.cached > 0 and warm.tokens == cold.tokens
    return engine


def test_4bit_pages_in_an_engine(folders) -> None:
    model = superslm.load(folders["qwen3"], device="cpu", dtype=torch.float32)
    engine = _agree_and_warm(model, "k8v4", "k4v4", 16, 0.5)
    assert engine.kv.k.dtype == engine.kv.v.dtype == torch.uint8


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_greedy_tokens_mostly_equal(family: str, folders) -> None:
    model = superslm.load(folders[family], device="cpu", dtype=torch.float32)
    _agree_and_warm(model, "int8", "int8", 24, 0.75)


@pytest.mark.parametrize(("family", "kv"), [("qwen3", "int8"), ("gemma3", "int8"), ("qwen3", "k4v4"),
                                             ("gemma3", "k8v4")])
def test_deterministic_mode_holds_with_quantized_pages(family: str, kv: str, folders) -> None:
    model = superslm.load(folders[family], device="cpu", dtype=torch.bfloat16)
    same_bits_in_any_batch(model, kv, prompts(6, seed=21, lo=5, hi=40))


def same_bits_in_any_batch(model: superslm.Model, kv: str, ps: list[list[int]], slots: int = 8, context: int = 128,
                           tokens: int = 8, orders: bool = True) -> None:
    """Deterministic mode on `kv` pages: each prompt's sampled tokens, logprobs and top logprobs are the same
    alone as beside the others (and, with `orders`, in reverse order and in prompt chunks of 7)."""

    def run(batch: list[list[int]], **kw) -> list[tuple]:
        engine = model.engine(**{"slots": slots, "context": context, "deterministic": True, "kv": kv, **kw})
        ss = [Sampling(temperature=0.9, seed=sum(p), logprobs=3, ignore_eos=True) for p in batch]
        done = engine.generate([Request(p, tokens, s) for p, s in zip(batch, ss)])
        return [tuple((x.token, x.logprob, x.top) for x in c.logprobs) for c in done]

    alone = [run([p], slots=1)[0] for p in ps]
    assert run(ps) == alone
    if orders:
        assert run(ps[::-1])[::-1] == alone
        assert run(ps, chunk=7) == alone


def test_restore_across_formats_fails_cleanly(folders) -> None:
    model = superslm.load(folders["llama"], device="cpu", dtype=torch.bfloat16)
    plain = model.engine(slots=2, context=64)
    small = model.engine(slots=2, context=64, kv="int8")
    blobs = {}
    for name, engine in (("plain", plain), ("int8", small)):
        rid = engine.add(Request(prompts(1, seed=4)[0], 20, Sampling(ignore_eos=True)))
        engine.advance()
        engine.advance()
        blobs[name] = engine.save(rid)
    # a float blob never lands in int8 rows, nor int8 rows in float pages: refused, nothing restored
    for blob, engine in ((blobs["plain"], small), (blobs["int8"], plain)):
        with pytest.raises(SuperSLMError):
            engine.restore(blob)
