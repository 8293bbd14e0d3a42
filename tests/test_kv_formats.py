"""KV page formats (cache/kv.py): int8 rows (codes and a float32 scale per token and kv head) against float pages,
on the CPU (int8 pages are refused on a GPU until the Triton kernels read them).

Quantized as written (store_kv, the C++ plan's own store), read without a dense copy of the cache (the torch
references dequantize the rows they gather; the C++ plan multiplies codes by their row's scale).
"""

from __future__ import annotations

import os

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache.kv import KVCache, dequantize_rows, kv_format, quantize_rows, read_rows, slot_mapping
from superslm.errors import InvalidArgument, SuperSLMError
from superslm.kernels import cpu_decode
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
    for bad in ("k8v4", "k4v4", "int4"):
        with pytest.raises(InvalidArgument, match="rotation"):
            kv_format(bad)
    for bad in ("int7", "", 8):
        with pytest.raises(InvalidArgument):
            kv_format(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="multiple of 4"):
        KVCache(1, 2, PS, 1, 6, kv="int8")
    with pytest.raises(InvalidArgument, match="CPU"):
        KVCache(1, 2, PS, 1, 64, kv="int8", device="cuda")  # refused before any allocation


def test_page_bytes_about_halve() -> None:
    # SmolLM2-135M's shape: 30 layers, 3 kv heads of 64; each row 64 codes + a 4-byte scale against 128 bf16 bytes
    bf16 = KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16)
    int8 = KVCache.page_bytes(30, 16, 3, 64, torch.bfloat16, "int8")
    assert bf16 == 30 * 16 * 3 * 2 * 128 and int8 * 128 == bf16 * 68
    kv = KVCache(30, 2, 16, 3, 64, torch.bfloat16, kv="int8")
    assert 2 * (kv.k.numel() * kv.k.element_size()) == 2 * int8  # what is allocated is what page_bytes says
    assert KVCache.page_bytes(2, 4, 1, 32, torch.float32, "fp32") == KVCache.page_bytes(2, 4, 1, 32, torch.float32)


def test_same_budget_holds_about_twice_the_pages(folders) -> None:
    model = superslm.load(folders["llama"], device="cpu", dtype=torch.bfloat16)
    budget = 200 * KVCache.page_bytes(model.net.kv_layers, 16, model.arch.kv_heads, model.arch.head_dim, model.dtype)
    plain = model.engine(slots=2, context=64, kv_budget=budget)
    small = model.engine(slots=2, context=64, kv_budget=budget, kv="int8")
    d = model.arch.head_dim
    assert plain.kv.num_pages == 200 and small.kv.num_pages == 200 * 2 * d // (d + 4)
    assert small.kv.k.dtype == torch.int8 and small.kv.k.shape[-1] == d + 4
    with pytest.raises(InvalidArgument):
        model.engine(slots=2, context=64, kv="k4v4")


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


def _ways(net: Transformer, lengths: list[int], kv_fmt: str) -> dict[str, tuple[torch.Tensor, KVCache]]:
    """Hidden states after every layer (and the cache after the step) from the generic path, the torch reference
    of the plan and the C++ plan, each on its own copy of the same prefilled cache."""
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
            fn = cpu_decode.decode_layers_reference if way == "reference" else cpu_decode.decode_layers
            out[way] = (fn(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0, len(net.layers)),
                        kv)
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


# --- engines -----------------------------------------------------------------------------------------------


def _greedy(model: superslm.Model, ps: list[list[int]], n: int, **kw) -> list[list[int]]:
    engine = model.engine(**{"slots": 8, "context": 160, **kw})
    return [c.tokens for c in engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])]


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_greedy_tokens_mostly_equal(family: str, folders) -> None:
    model = superslm.load(folders[family], device="cpu", dtype=torch.float32)
    ps = prompts(4, seed=3, lo=10, hi=60)
    floats = _greedy(model, ps, 24)
    int8 = _greedy(model, ps, 24, kv="int8")
    same = sum(a == b for x, y in zip(floats, int8) for a, b in zip(x, y))
    assert same >= 0.75 * 4 * 24, (same, floats, int8)
    # a warm prefix cache reads the same int8 rows the cold run wrote
    engine = model.engine(slots=2, context=160, kv="int8")
    cold = engine.generate([Request(ps[0], 12, Sampling(ignore_eos=True))])[0]
    warm = engine.generate([Request(ps[0], 12, Sampling(ignore_eos=True))])[0]
    assert warm.cached > 0 and warm.tokens == cold.tokens


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_deterministic_mode_holds_with_int8_pages(family: str, folders) -> None:
    model = superslm.load(folders[family], device="cpu", dtype=torch.bfloat16)
    ps = prompts(6, seed=21, lo=5, hi=40)

    def run(batch: list[list[int]], **kw) -> list[tuple]:
        engine = model.engine(**{"slots": 8, "context": 128, "deterministic": True, "kv": "int8", **kw})
        ss = [Sampling(temperature=0.9, seed=sum(p), logprobs=3, ignore_eos=True) for p in batch]
        done = engine.generate([Request(p, 8, s) for p, s in zip(batch, ss)])
        return [tuple((x.token, x.logprob, x.top) for x in c.logprobs) for c in done]

    alone = [run([p], slots=1)[0] for p in ps]
    assert run(ps) == alone
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
