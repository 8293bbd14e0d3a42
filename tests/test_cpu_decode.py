"""The C++ decode layers (kernels/cpu/decode_layers.cpp) against their torch reference and the generic path (the
kernels they call, one at a time: tests/test_cpu_kernels.py).

Every family of the tiny configs, float32 and bfloat16, dense and quantized linears (int4, int8, bf16,
rotated or not), three sequences of different lengths on shuffled pages decoding together.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache.kv import KVCache, slot_mapping
from superslm.kernels import cpu_decode
from superslm.kernels.attention import AttnMetadata
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from superslm.quant import quantize_linears
from tests.tiny_models import PLAIN, build_hf_model

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")

PS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    out = {}
    for family in PLAIN:
        path = tmp_path_factory.mktemp(family)
        build_hf_model(family, path)
        out[family] = path
    return out


def test_extension_builds() -> None:
    # CI has a compiler: the fast path must exist there, not silently fall back
    assert cpu_decode.extension() is not None


def _prefilled(net: Transformer, lengths: list[int], seed: int = 0, pages: int = 64):
    """A KV cache holding three prompts (prefilled by the generic path) and the decode step's metadata."""
    a = net.arch
    kv = KVCache(len(net.layers), pages, PS, a.kv_heads, a.head_dim, net.dtype)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        need = n // PS + 1
        tables.append(tuple(perm[used : used + need]))
        used += need
    net.fast_decode = False
    with torch.no_grad():
        for table, n in zip(tables, lengths):
            toks = torch.randint(0, a.vocab, (n,), generator=g)
            pos = torch.arange(n)
            slots = torch.tensor(slot_mapping(table, 0, n, PS))
            meta = AttnMetadata(pos, slots, (0, n), (n,), (table,), PS)
            net.run_layers(net.embed(toks), meta, kv.k, kv.v)
    pos = torch.tensor(lengths)
    slots = torch.tensor([slot_mapping(t, n, n + 1, PS)[0] for t, n in zip(tables, lengths)])
    qs = tuple(range(len(lengths) + 1))
    meta = AttnMetadata(pos, slots, qs, tuple(n + 1 for n in lengths), tuple(tables), PS)
    toks = torch.randint(0, a.vocab, (len(lengths),), generator=g)
    return kv, meta, toks


def _three_ways(net: Transformer, lengths: list[int], pages: int = 64
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states after every layer from the generic path, the torch reference and the C++ plan."""
    outs = []
    for way in ("generic", "reference", "cpp"):
        kv, meta, toks = _prefilled(net, lengths, pages=max(pages, 64))
        with torch.no_grad():
            h = net.embed(toks)
            if way == "generic":
                net.fast_decode = False
                outs.append(net.run_layers(h, meta, kv.k, kv.v))
                continue
            tabs = net.rope_table_list(meta.positions)
            key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
            fn = cpu_decode.decode_layers_reference if way == "reference" else cpu_decode.decode_layers
            outs.append(fn(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0, len(net.layers)))
    return outs[0], outs[1], outs[2]


@pytest.mark.parametrize("family", PLAIN)
def test_float32_equals_reference_and_generic(family: str, folders) -> None:
    src = open_source(folders[family])
    net = Transformer(src.arch, materialize(src, torch.float32))
    assert cpu_decode.plan_for(net) is not None
    # 3 keys, and 41 = two full blocks of 16 and a remainder for the vector attention's score tree
    generic, ref, cpp = _three_ways(net, [3, 9, 14, 40])
    assert (ref - generic).abs().max().item() <= 1e-5
    assert (cpp - ref).abs().max().item() <= 1e-5
    assert generic.std().item() > 0.1


def test_row_key_slots_name_each_rows_keys() -> None:
    """Each row's sequence, its visible key count and its sequence's key slots in position order (a page's slots
    table[p] * page_size + offset), written out by hand: decode rows and prompt chunks, tables holding pages past
    the keys (allocated ahead), page sizes 1, 4 and 16."""
    rng = np.random.default_rng(3)
    for _ in range(100):
        ps = int(rng.choice([1, 4, 16]))
        counts = [int(rng.integers(1, 6)) if rng.random() < 0.3 else 1 for _ in range(int(rng.integers(1, 6)))]
        lens = [int(rng.integers(c, 80)) for c in counts]
        tables = tuple(tuple(int(p) for p in rng.integers(0, 400, size=-(-n // ps) + int(rng.integers(0, 3))))
                       for n in lens)
        qs = np.concatenate([[0], np.cumsum(counts)]).tolist()
        pos = torch.tensor([n - c + j for n, c in zip(lens, counts) for j in range(c)])
        meta = AttnMetadata(pos, torch.zeros(qs[-1], dtype=torch.long), tuple(qs), tuple(lens), tables, ps)
        slots, rows, seen = cpu_decode.row_key_slots(meta, torch.device("cpu"))
        assert slots.shape == (len(lens), max(lens)) and slots.is_contiguous()
        for s, (t, n) in enumerate(zip(tables, lens)):
            assert slots[s, :n].tolist() == [t[i // ps] * ps + i % ps for i in range(n)]
        assert rows.tolist() == [s for s, c in enumerate(counts) for _ in range(c)]
        assert seen.tolist() == (pos + 1).tolist()


def test_long_contexts_value_tiles_equal_reference(folders) -> None:
    """Rows past several of the attention's key tiles (rowops_avx2.h: the value pass runs the keys in tiles of
    ~64 KB of value rows, every query head's sums carried from tile to tile) give the reference's hidden states."""
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    tile = max(64, 65536 // (net.arch.head_dim * 4))  # float32 value rows
    lengths = [2 * tile + 37, tile, 5]
    generic, ref, cpp = _three_ways(net, lengths, pages=sum(n // PS + 1 for n in lengths))
    assert (ref - generic).abs().max().item() <= 1e-5
    assert (cpp - ref).abs().max().item() <= 1e-5
    assert generic.std().item() > 0.1


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("fmt", [None, "int4", "int8", "bf16", "int4-rotated", "int4-g128-rotated", "int8-rotated"])
def test_bfloat16_formats_within_rounding(family: str, fmt: str | None, folders) -> None:
    """Rotated linears: the plan rotates each row in float (rowops.h rotate_rows), the modules by a bf16
    matmul; g128 pads every input of these tiny models (hidden 64, intermediate 96 or so) past its width."""
    src = open_source(folders[family])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    if fmt is not None:
        body = fmt.split("-")[0]
        quantize_linears(net, body=body, head=None, group=128 if "g128" in fmt else 32, rotate=fmt.endswith("rotated"))
        if "g128" in fmt:
            assert all(m.k_pad > m.in_features for m in (net.layers[0].qkv, net.layers[0].down))
    assert cpu_decode.plan_for(net) is not None
    generic, ref, cpp = _three_ways(net, [2, 7, 13, 35])
    scale = generic.float().abs().max().item()
    # one bf16 rounding (2^-8 relative) compounds over a few layers; a wrong kernel is off by O(1)
    # the same kernels, the rotation rounded differently (float rows vs a bf16 matmul): a few flips of one
    # bf16 ulp compound over the layers (1.4-1.8% of the scale on rotated int4 Gemma-3 on either kernel)
    assert (cpp.float() - ref.float()).abs().max().item() <= 2**-5 * scale
    assert (cpp.float() - generic.float()).abs().max().item() <= 0.03 * scale
    cos = torch.nn.functional.cosine_similarity(cpp.float(), generic.float(), dim=-1)
    assert cos.min().item() > 0.999


def test_which_steps_take_the_plan(folders) -> None:
    # default mode: all-decode steps, and prompt chunks a sliding window cuts; other chunks keep SDPA;
    # deterministic mode: every step
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv, meta, toks = _prefilled(net, [3, 5])
    net.fast_decode = True
    mixed = AttnMetadata(torch.tensor([3, 5, 6]), meta.slot_mapping.new_tensor([0, 1, 2]), (0, 1, 3),
                         (4, 7), meta.block_tables, PS)
    assert not net.plan_step(torch.zeros(3, net.arch.dim), mixed, kv.k)
    assert net.plan_step(torch.zeros(2, net.arch.dim), meta, kv.k)
    det = AttnMetadata(mixed.positions, mixed.slot_mapping, (0, 1, 3), (4, 7), meta.block_tables, PS,
                       deterministic=True)
    assert net.plan_step(torch.zeros(3, net.arch.dim), det, kv.k)
    src = open_source(folders["mistral"])  # sliding window 6
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv, meta, toks = _prefilled(net, [3, 5])
    net.fast_decode = True
    short = AttnMetadata(torch.arange(5), torch.arange(5), (0, 5), (5,), ((0, 1),), PS)
    cut = AttnMetadata(torch.arange(10), torch.arange(10), (0, 10), (10,), ((0, 1, 2),), PS)
    assert not net.plan_step(torch.zeros(5, net.arch.dim), short, kv.k)
    assert net.plan_step(torch.zeros(10, net.arch.dim), cut, kv.k)


def test_plan_follows_module_swaps(folders) -> None:
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    first = cpu_decode.plan_for(net)
    assert cpu_decode.plan_for(net) is first
    quantize_linears(net, body="int8", head=None)
    assert cpu_decode.plan_for(net) is not first


def test_plan_only_for_bf16_and_fp32_and_rebuilt_after_to(folders) -> None:
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv = torch.zeros(1, 1, 1, 1)
    assert cpu_decode.usable(net, torch.zeros(1, 2), kv)
    first = cpu_decode.plan_for(net)
    net.to(torch.bfloat16)
    assert cpu_decode.plan_for(net) is not first
    half = torch.zeros(1, 2, dtype=torch.float16)
    assert not cpu_decode.usable(net, half, kv.half())


def test_plan_refuses_out_of_range_inputs(folders) -> None:
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv, meta, toks = _prefilled(net, [3, 5])
    plan = cpu_decode.plan_for(net)
    h = net.embed(toks)
    key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
    tabs = [net._rope_tables(meta.positions)[0]]
    no_lora = [torch.empty(0, dtype=torch.long), []]
    no_states = [torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long)]  # no delta-rule layers
    args = [h, meta.slot_mapping, key_slots, row_seq, lens, [tabs[0][0]], [tabs[0][1]], kv.k, kv.v, 0, 1, False,
            *no_lora, *no_states]  # fmt: skip
    plan.run(*args)
    one_group = torch.zeros(len(h), dtype=torch.long)
    for i, bad in ((4, lens + key_slots.shape[1]), (1, meta.slot_mapping + 10**6), (3, row_seq + 5),
                   (12, torch.zeros(len(h) + 1, dtype=torch.long)),  # a group per row, one too many
                   (12, one_group)):  # a group without its weights  # fmt: skip
        with pytest.raises(RuntimeError):
            plan.run(*[bad if j == i else a for j, a in enumerate(args)])
    with pytest.raises(RuntimeError):  # weights of the wrong dtype
        plan.run(*args[:12], one_group, [torch.zeros(2, 2, dtype=torch.float64)] * (8 * plan.num_layers()),
                 *no_states)
    with pytest.raises(RuntimeError, match="slot twice"):  # two rows storing into one slot (stored on two threads)
        plan.run(*[meta.slot_mapping[:1].repeat(len(h)) if j == 1 else a for j, a in enumerate(args)])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_concatenated_parts_run_in_the_plan(family: str, folders) -> None:
    """A fused linear whose parts have different formats (a Q4_K_M file's Q4_K q, k and Q6_K v) runs in
    the C++ plan part by part, not through the slow generic path."""
    from superslm.quant.dense import Int8Linear
    from superslm.quant.gguf_map import ConcatLinear
    from superslm.quant.int4 import Int4Linear

    src = open_source(folders[family])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    for layer in net.layers:
        for name in ("qkv", "gate_up"):
            w = getattr(layer, name).weight.detach().float()
            cut = w.shape[0] // 2
            parts = [Int4Linear.from_dense(w[:cut], group=32), Int8Linear.from_dense(w[cut:])]
            setattr(layer, name, ConcatLinear(parts))
    assert cpu_decode.plan_for(net) is not None
    generic, ref, cpp = _three_ways(net, [2, 7, 13, 35])
    scale = generic.float().abs().max().item()
    assert (cpp.float() - ref.float()).abs().max().item() <= 2**-6 * scale
    assert (cpp.float() - generic.float()).abs().max().item() <= 0.03 * scale


def test_one_rows_query_heads_shared_by_the_threads_keep_their_bits(folders) -> None:
    """One decode row of a model with one kv head (Gemma-3's layout), 301 keys: past ~32K key values a step the plan
    splits each kv head's query heads over the threads; every head keeps the bits one thread gives it."""
    src = open_source(folders["gemma3"])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    assert net.arch.kv_heads == 1 and net.arch.heads >= 2
    outs = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        kv, meta, toks = _prefilled(net, [300], pages=96)
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                h = net.embed(toks)
                tabs = net.rope_table_list(meta.positions)
                key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
                assert key_slots.shape[1] * net.arch.head_dim * net.arch.heads >= 32768
                outs.append(cpu_decode.decode_layers(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k,
                                                     kv.v, 0, len(net.layers)))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_window_cut_prompt_in_the_plan_equals_the_generic_path(folders) -> None:
    # the rows of a prompt chunk, each over its own window of keys, tiled 8 at a time (rowops.h)
    src = open_source(folders["mistral"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    a = net.arch
    n = 19
    toks = torch.randint(0, a.vocab, (n,), generator=torch.Generator().manual_seed(5))
    outs = []
    for fast in (False, True):
        kv = KVCache(len(net.layers), 16, PS, a.kv_heads, a.head_dim, net.dtype)
        table = (3, 0, 7, 2, 9, 1)
        meta = AttnMetadata(torch.arange(n), torch.tensor(slot_mapping(table, 0, n, PS)), (0, n), (n,), (table,), PS)
        net.fast_decode = fast
        assert net.plan_step(net.embed(toks), meta, kv.k) == fast
        with torch.no_grad():
            outs.append(net.run_layers(net.embed(toks), meta, kv.k, kv.v))
    assert (outs[1] - outs[0]).abs().max().item() <= 1e-4 * outs[0].abs().max().item()


def test_q5_0_linears_run_in_the_plan(folders) -> None:
    """GGUF Q5_0 weights run as they are (quant/int5.py) inside the C++ plan (the VNNI kernels, or the AVX2 ones),
    equal to the reference; near the int8 re-quantization they replace; a decode row of a layer the plan does not
    run takes their GEMV (one_row_linear)."""
    from gguf import GGMLQuantizationType, quants

    from superslm.formats.blocks import Q5_0
    from superslm.quant.gguf_map import int5_runs
    from superslm.quant.int5 import GGUFInt5Linear

    if not int5_runs():
        pytest.skip("no 5-bit kernels: Q5_0 runs as int8")
    _stored_blocks_in_the_plan(open_source(folders["llama"]), ("qkv", "gate_up", "down"),
                               lambda w: quants.quantize(w, GGMLQuantizationType.Q5_0).reshape(-1), Q5_0, "gguf5",
                               GGUFInt5Linear)


def test_iq4_linears_run_in_the_plan(folders) -> None:
    """GGUF IQ4_NL weights run as they are (quant/iq4.py) inside the C++ plan, equal to the reference; the same
    greedy tokens as the int8 re-quantization they replace; a decode row of a layer the plan does not run takes
    their GEMV (one_row_linear)."""
    from superslm.formats.blocks import IQ4_NL
    from superslm.quant.gguf_map import iq4_runs
    from superslm.quant.iq4 import GGUFIQ4Linear
    from tests.test_iq4 import quantize_iq4_nl

    if not iq4_runs():
        pytest.skip("no IQ4 kernels: IQ4 runs as int8")
    _stored_blocks_in_the_plan(open_source(folders["llama"]), ("qkv", "gate_up", "down"), quantize_iq4_nl, IQ4_NL,
                               "giq4", GGUFIQ4Linear)


@pytest.mark.parametrize("deterministic", [False, True])
def test_iq4_decode_rows_are_each_rows_own(folders, deterministic: bool) -> None:
    """The plan's IQ4 linears take the integer rows kernel in a decode step of a few rows, in the default mode and in
    deterministic mode alike (a float32 decode of the whole weight per call made 16 streams slower than one): each
    row of a 4-row step is, bit for bit, the row the step of its sequence alone gives, the same in both modes."""
    from superslm.formats.blocks import IQ4_NL
    from superslm.quant.gguf_map import iq4_runs, linear_from_gguf
    from tests.test_iq4 import quantize_iq4_nl

    if not iq4_runs():
        pytest.skip("no IQ4 kernels: IQ4 runs as int8")
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.bfloat16))
    for layer in net.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name).weight.detach().float().numpy()
            setattr(layer, name, linear_from_gguf([(quantize_iq4_nl(w), IQ4_NL, w.shape, None)],
                                                  mapping={"IQ4_NL": ("giq4", {})}))
    lengths = [2, 7, 13, 35]
    kv, meta, toks = _prefilled(net, lengths)

    def step(kv: KVCache, meta: AttnMetadata, toks: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = net.embed(toks)
            tabs = net.rope_table_list(meta.positions)
            key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
            return cpu_decode.decode_layers(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0,
                                            len(net.layers), deterministic)

    together = step(kv, meta, toks)  # each step writes its rows' keys to the same slots: the same values
    for i, n in enumerate(lengths):
        one = AttnMetadata(meta.positions[i : i + 1], meta.slot_mapping[i : i + 1], (0, 1), (n + 1,),
                           (meta.block_tables[i],), PS)
        assert torch.equal(step(kv, one, toks[i : i + 1])[0], together[i]), f"row {i}"


def test_q6k_linears_run_in_the_plan(tmp_path) -> None:
    """GGUF Q6_K weights run as they are (quant/q6k.py) inside the C++ plan (four decode rows: the GEMV's rows
    sharing each block), equal to the reference; near the int8 re-quantization they replace; a decode row of a
    layer the plan does not run takes their GEMV (one_row_linear)."""
    from benchmarks.q6k_decode import quantize_q6k
    from superslm.formats.blocks import Q6_K
    from superslm.quant.gguf_map import q6k_runs
    from superslm.quant.q6k import GGUFQ6KLinear
    from tests.tiny_models import CONFIGS

    if not q6k_runs():
        pytest.skip("no Q6_K kernels: Q6_K runs as int8")
    cls, kwargs = CONFIGS["llama"]  # rows of 256 and 512: whole Q6_K blocks
    build_hf_model("llama", tmp_path, spec=(cls, dict(kwargs, hidden_size=256, intermediate_size=512, head_dim=64,
                                                      num_attention_heads=4, num_key_value_heads=2)))
    _stored_blocks_in_the_plan(open_source(tmp_path), ("qkv", "o", "gate_up", "down"), quantize_q6k, Q6_K, "gq6k",
                               GGUFQ6KLinear)


def test_q80_linears_run_in_the_plan(folders) -> None:
    """GGUF Q8_0 weights run as they are (quant/q80.py) inside the C++ plan (four decode rows: the GEMV's rows
    sharing each load of the codes), equal to the reference; near the int8 re-quantization they replace; a decode
    row of a layer the plan does not run takes their GEMV (one_row_linear)."""
    from gguf import GGMLQuantizationType, quants

    from superslm.formats.blocks import Q8_0
    from superslm.quant.gguf_map import q80_runs
    from superslm.quant.q80 import GGUFQ80Linear

    if not q80_runs():
        pytest.skip("no Q8_0 kernels: Q8_0 runs as int8")
    _stored_blocks_in_the_plan(open_source(folders["llama"]), ("qkv", "o", "gate_up", "down"),
                               lambda w: quants.quantize(w, GGMLQuantizationType.Q8_0).reshape(-1), Q8_0, "gq80",
                               GGUFQ80Linear)


def _stored_blocks_in_the_plan(src: object, names: tuple[str, ...], quantize: object, block: object, fmt: str,
                               cls: type) -> None:
    """The llama model `src` with its linears `names` quantized to GGUF `block` (by `quantize`) and run as they are
    (format `fmt`, module class `cls`): the plan within 2^-6 of its reference and 0.03 of the generic path, hidden
    states near the int8 re-quantization of the same blocks (cosine > 0.99), and a decode row of one such linear
    outside the plan through `one_row_linear` bit for bit as the module's own forward."""
    from superslm.quant.gguf_map import linear_from_gguf

    nets = {}
    for f in (fmt, "int8"):
        net = Transformer(src.arch, materialize(src, torch.bfloat16))  # type: ignore[attr-defined]
        for layer in net.layers:
            for name in names:
                w = getattr(layer, name).weight.detach().float().numpy()
                setattr(layer, name, linear_from_gguf([(quantize(w), block, w.shape, None)],  # type: ignore[operator]
                                                      mapping={block.name: (f, {})}))  # type: ignore[attr-defined]
        nets[f] = net
    net = nets[fmt]
    assert all(isinstance(getattr(net.layers[0], name), cls) for name in names)
    assert cpu_decode.plan_for(net) is not None
    generic, ref, cpp = _three_ways(net, [2, 7, 13, 35])
    scale = generic.float().abs().max().item()
    assert (cpp.float() - ref.float()).abs().max().item() <= 2**-6 * scale
    assert (cpp.float() - generic.float()).abs().max().item() <= 0.03 * scale
    # the file's values against their int8 re-quantization: the same hidden states within int8's error
    other, _, _ = _three_ways(nets["int8"], [2, 7, 13, 35])
    cos = torch.nn.functional.cosine_similarity(cpp.float(), other.float(), dim=-1)
    assert cos.min().item() > 0.99
    m = net.layers[0].down
    x = torch.randn(1, m.in_features).to(torch.bfloat16)
    got = cpu_decode.one_row_linear(m, x)
    assert got is not None and torch.equal(got, m(x))

def test_a_nan_row_stays_its_own(folders) -> None:
    # a NaN in one sequence's hidden state is NaN in its output (the vector exp keeps it) and touches no other
    src = open_source(folders["llama"])
    net = Transformer(src.arch, materialize(src, torch.float32))
    kv, meta, toks = _prefilled(net, [3, 9, 14])
    with torch.no_grad():
        h = net.embed(toks)
        h[0, 3] = float("nan")
        tables = net._rope_tables(meta.positions)
        tabs = [tables.get(k, tables[max(tables)]) for k in range(2)]
        key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
        out = cpu_decode.decode_layers(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0,
                                       len(net.layers))
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()


def test_quantized_modules_keep_torchs_kernels() -> None:
    """Prompt chunks run the int4/int8 modules on torch's packed kernels on every CPU, also where the plan
    takes ours from 2 rows (`gemm_rows`): their roundings decide the default model's near-tie answers (the
    docs' "capital of France" example flips with the VNNI kernels' two-part activations)."""
    from superslm.quant.dense import Int8Linear
    from superslm.quant.int4 import Int4Linear

    g = torch.Generator().manual_seed(9)
    m4 = Int4Linear.from_dense(torch.randn(192, 256, generator=g), group=32)
    m8 = Int8Linear.from_dense(torch.randn(192, 256, generator=g))
    x = (torch.randn(20, 256, generator=g) * torch.rand(20, 256, generator=g) ** 4).to(torch.bfloat16)
    assert torch.equal(m4(x), torch.ops.aten._weight_int4pack_mm_for_cpu(x, m4.qweight, 32, m4.scales_zeros))
    assert torch.equal(m8(x), torch.ops.aten._weight_int8pack_mm(x, m8.codes, m8.scale))
    ext = cpu_decode.extension()
    assert ext.gemm_rows(False) in (2, 16) and ext.gemm_rows(True) in (2, 2**63 - 1)


def test_one_row_linear_runs_the_plans_gemvs() -> None:
    """A decode row of a layer the plan does not run (delta rule, experts) takes the plan's GEMVs (VNNI, else
    AVX2): int4 and int8 formats, rotated or not, padded, with a bias, equal to the GEMV on the prepared input and
    within bf16 rounding of the module; a ConcatLinear part by part; None for other formats, other row counts,
    hooks, and rows the GEMV cannot split."""
    from superslm.quant.dense import Bf16Linear, Int8Linear
    from superslm.quant.gguf_map import ConcatLinear
    from superslm.quant.int4 import Int4Linear

    ext = cpu_decode.extension()
    if ext is None or not (ext.vnni_available() or ext.avx2_available()):
        pytest.skip("neither AVX-512 VNNI nor AVX2: the modules keep their own kernels")
    vnni = ext.vnni_available()
    g = torch.Generator().manual_seed(11)
    w, bias = torch.randn(192, 300, generator=g), torch.randn(192, generator=g)
    mods = [Int4Linear.from_dense(w, bias, group=32), Int4Linear.from_dense(w, group=64, rotate=3),
            Int8Linear.from_dense(w[:, :256], bias), Int8Linear.from_dense(w, rotate=5)]  # fmt: skip
    for m in mods:
        x = torch.randn(1, m.in_features, generator=g).to(torch.bfloat16)
        got = cpu_decode.one_row_linear(m, x)
        assert got is not None and got.dtype == x.dtype and got.shape == (1, 192)
        want = m(x).float()
        assert ((got.float() - want).abs() <= 2**-6 * want.abs() + 2e-2 * want.abs().max()).all()
        if isinstance(m, Int4Linear):
            h = m.prepare_input(x).to(torch.bfloat16)
            y = (ext.int4_gemv(h, m.qweight, m.scales_zeros, m.group) if vnni
                 else ext.int4_gemv_avx2(h, m.qweight, m.scales_zeros, m.group, 0))
            assert torch.equal(got, m.finish(y[:, :192], x.dtype))
        assert cpu_decode.one_row_linear(m, x.repeat(2, 1)) is None
        handle = m.register_forward_hook(lambda *a: None)
        assert cpu_decode.one_row_linear(m, x) is None
        handle.remove()
    nan = torch.full((1, 300), float("nan"), dtype=torch.bfloat16)
    assert cpu_decode.one_row_linear(mods[0], nan) is None
    x = torch.randn(1, 300, generator=g).to(torch.bfloat16)
    assert cpu_decode.one_row_linear(Bf16Linear.from_dense(w), x) is None
    cat = ConcatLinear([mods[0], mods[3]])
    got = cpu_decode.one_row_linear(cat, x)
    parts = [cpu_decode.one_row_linear(m, x) for m in (mods[0], mods[3])]
    assert got is not None and torch.equal(got, torch.cat(parts, 1))
    assert cpu_decode.one_row_linear(ConcatLinear([mods[0], Bf16Linear.from_dense(w)]), x) is None


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_hooks_on_layers_keep_the_modules(tmp_path, family: str) -> None:
    """A forward hook on a layer, or on a module in it (a parts layer's mixer or its linear), sees every step:
    the plan, which runs whole layers in one call, declines the steps it would skip; without hooks the plan runs
    again and the tokens are the same."""
    build_hf_model(family, tmp_path)
    model = superslm.load(tmp_path, quant="int4")
    prompt, n = [5, 9, 14, 3, 8], 6

    def tokens() -> list[int]:
        engine = model.engine(slots=1, context=64)
        return engine.generate([Request(prompt, n, Sampling(temperature=0))])[0].tokens

    want = tokens()
    layer = model.net.layers[1]
    inner = next(m for m in layer._modules.values() if m is not None)  # a linear, or a parts layer's mixer
    for module in (layer, inner, *[m for m in inner._modules.values() if m is not None][:1]):
        seen: list[int] = []
        handle = module.register_forward_hook(lambda *a, seen=seen: seen.append(1))
        assert cpu_decode.watched(model.net)
        assert tokens() == want
        handle.remove()
        assert len(seen) >= n, f"{type(module).__name__}: the hook saw {len(seen)} of the {n} steps"
    assert not cpu_decode.watched(model.net)
