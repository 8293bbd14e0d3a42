"""The C++ decode plan on parts layers (gated attention, gated delta rules, dense MLPs, mixtures of experts) against
its torch twin (kernels/cpu_hybrid.py via cpu_decode.decode_layers_reference) and the layers' own forward.

Tiny Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Qwen3-MoE models, float32 and bfloat16, dense and int8 / int4 linears,
float / int8 / 4-bit KV pages, several sequences of different lengths (one starting at position 0: its state rows
hold garbage the step must zero) decoding together; greedy tokens of the engine with the plan on and off.
"""

from __future__ import annotations

import os

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cache.kv import KVCache, slot_mapping
from superslm.cache.state import RecurrentStates
from superslm.kernels import cpu_decode
from superslm.kernels.attention import AttnMetadata
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from superslm.quant import quantize_linears
from tests.tiny_models import CONFIGS, build_hf_model

pytestmark = pytest.mark.skipif(os.environ.get("SUPERSLM_CPU_KERNELS") == "0", reason="C++ kernels disabled")

PS = 4
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        build_hf_model(family, path)
        out[family] = path
    # head_dim 32: 4-bit KV rows need a Hadamard block of 32
    cls, kwargs = CONFIGS["qwen3_5"]
    path = tmp_path_factory.mktemp("qwen3_5_d32")
    build_hf_model("qwen3_5", path, spec=(cls, dict(kwargs, head_dim=32)))
    out["qwen3_5_d32"] = path
    return out


def _net(folder, dtype: torch.dtype, fmt: str | None = None) -> Transformer:
    src = open_source(folder)
    net = Transformer(src.arch, materialize(src, dtype))
    if fmt is not None:
        quantize_linears(net, body=fmt, head=None, group=32, rotate=False)
    return net


def _prefilled(net: Transformer, lengths: list[int], kv_format: str = "auto", seed: int = 0):
    """KV pages and recurrent states holding prompts of `lengths` (the layers' own forward; 0: a sequence that
    starts with the decode step, its state row left as garbage) and the decode step's metadata."""
    a, d = net.arch, net.arch.delta
    pages = 64
    kv = KVCache(net.kv_layers, pages, PS, a.kv_heads, a.head_dim, net.dtype, kv=kv_format)
    states = None
    if d is not None:
        # one row more than the sequences, the slots shuffled: rows are found by state_slots, not by position
        states = RecurrentStates(net.state_layers, len(lengths) + 1, d.conv_width, d.conv, d.v_heads, d.k_dim,
                                 d.v_dim, net.dtype)
        g0 = torch.Generator().manual_seed(seed + 1)
        states.conv.copy_(torch.randn(states.conv.shape, generator=g0))
        states.ssm.copy_(torch.randn(states.ssm.shape, generator=g0))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages, generator=g).tolist()
    rows = torch.randperm(len(lengths) + 1, generator=g).tolist()[: len(lengths)]
    tables, used = [], 0
    for n in lengths:
        need = n // PS + 1
        tables.append(tuple(perm[used : used + need]))
        used += need
    fast = net.fast_decode
    net.fast_decode = False
    with torch.no_grad():
        for table, n, row in zip(tables, lengths, rows):
            if n == 0:
                continue
            toks = torch.randint(0, a.vocab, (n,), generator=g)
            slots = torch.tensor(slot_mapping(table, 0, n, PS))
            meta = AttnMetadata(torch.arange(n), slots, (0, n), (n,), (table,), PS, state_slots=(row,))
            net.run_layers(net.embed(toks), meta, kv.k, kv.v, states=states)
    net.fast_decode = fast
    pos = torch.tensor(lengths)
    slots = torch.tensor([slot_mapping(t, n, n + 1, PS)[0] for t, n in zip(tables, lengths)])
    qs = tuple(range(len(lengths) + 1))
    meta = AttnMetadata(pos, slots, qs, tuple(n + 1 for n in lengths), tuple(tables), PS,
                        state_slots=tuple(rows) if states is not None else ())
    toks = torch.randint(0, a.vocab, (len(lengths),), generator=g)
    return kv, states, meta, toks


def _three_ways(net: Transformer, lengths: list[int], kv_format: str = "auto"):
    """(hidden states, states after) of the step from the layers' forward, the torch twin and the C++ plan."""
    outs = []
    for way in ("generic", "reference", "cpp"):
        kv, states, meta, toks = _prefilled(net, lengths, kv_format)
        with torch.no_grad():
            h = net.embed(toks)
            if way == "generic":
                net.fast_decode = False
                out = net.run_layers(h, meta, kv.k, kv.v, states=states)
                net.fast_decode = True
            else:
                tabs = net.rope_table_list(meta.positions)
                key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
                fn = cpu_decode.decode_layers_reference if way == "reference" else cpu_decode.decode_layers
                out = fn(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0, len(net.layers),
                         states=states, state_slots=meta.state_slots)
        rows = list(meta.state_slots)
        outs.append((out, None if states is None else (states.conv[:, rows].float(), states.ssm[:, rows])))
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_equals_reference_and_generic(family: str, folders) -> None:
    net = _net(folders[family], torch.float32)
    assert cpu_decode.plan_for(net) is not None
    (generic, gs), (ref, rs), (cpp, cs) = _three_ways(net, [0, 3, 9, 14, 40])
    scale = generic.abs().max().item()
    assert generic.std().item() > 0.1
    assert (ref - generic).abs().max().item() <= 1e-5 * scale
    assert (cpp - ref).abs().max().item() <= 1e-5 * scale
    if gs is not None:  # the recurrent states after the step, the fresh sequence's zeroed first
        for a, b, c in zip(gs, rs, cs):
            assert (b - a).abs().max().item() <= 1e-5 * a.abs().max().item()
            assert (c - b).abs().max().item() <= 1e-5 * a.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
def test_bfloat16_formats_within_rounding(family: str, fmt: str | None, folders) -> None:
    net = _net(folders[family], torch.bfloat16, fmt)
    assert cpu_decode.plan_for(net) is not None
    (generic, _), (ref, _), (cpp, _) = _three_ways(net, [0, 2, 7, 13, 35])
    scale = generic.float().abs().max().item()
    # the bounds of the plain layers' test (tests/test_cpu_decode.py): a bf16 rounding compounds over the layers
    assert (cpp.float() - ref.float()).abs().max().item() <= 2**-5 * scale
    assert (cpp.float() - generic.float()).abs().max().item() <= 0.03 * scale
    cos = torch.nn.functional.cosine_similarity(cpp.float(), generic.float(), dim=-1)
    assert cos.min().item() > 0.999


@pytest.mark.parametrize("kv_format", ["int8", "k8v4", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kv_pages(kv_format: str, dtype: torch.dtype, folders) -> None:
    net = _net(folders["qwen3_5_d32"], dtype)
    (generic, _), (ref, _), (cpp, _) = _three_ways(net, [0, 5, 11, 30], kv_format)
    scale = generic.float().abs().max().item()
    # float32: an ulp upstream (the float32 norms, exp) may move a code by one step, up to 1/127 of its row's
    # largest value (the sequence at position 0 attends to its own row alone)
    assert (cpp.float() - ref.float()).abs().max().item() <= 2**-5 * scale
    if dtype == torch.float32:
        assert (cpp - ref).abs().max().item() <= scale / 127
    # the layers' forward attends by SDPA over rows dequantized to the model dtype, the plan in float32
    assert (cpp.float() - generic.float()).abs().max().item() <= 0.03 * scale


def test_expert_counts_and_budgeted_layers(folders) -> None:
    """The plan adds each expert's rows to MoE.tokens_per_expert as the layers do; a step run a few layers at a
    time (layer budgets: start..end) gives the step run at once."""
    net = _net(folders["qwen3_5_moe"], torch.float32)
    counts = []
    outs = []
    for budget in (None, 1, 3):
        for layer in net.layers:
            layer.mlp.tokens_per_expert.zero_()
        kv, states, meta, toks = _prefilled(net, [0, 6, 9])
        for layer in net.layers:
            layer.mlp.tokens_per_expert.zero_()
        with torch.no_grad():
            h = net.embed(toks)
            n = len(net.layers)
            step = n if budget is None else budget
            for start in range(0, n, step):
                h = net.run_layers(h, meta, kv.k, kv.v, start, min(n, start + step), plan=True, states=states)
        outs.append(h)
        counts.append([layer.mlp.tokens_per_expert.clone() for layer in net.layers])
    kv, states, meta, toks = _prefilled(net, [0, 6, 9])
    for layer in net.layers:
        layer.mlp.tokens_per_expert.zero_()
    net.fast_decode = False
    with torch.no_grad():
        want = net.run_layers(net.embed(toks), meta, kv.k, kv.v, states=states)
    net.fast_decode = True
    for layer, got in zip(net.layers, counts[0]):
        assert torch.equal(layer.mlp.tokens_per_expert, got) and int(got.sum()) == 3 * net.arch.experts.top_k
    assert all(all(torch.equal(a, b) for a, b in zip(c, counts[0])) for c in counts)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert (outs[0] - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_which_steps_take_the_plan(folders) -> None:
    """All-decode steps of the default mode with a state row each; not prompt chunks, deterministic mode, drafts,
    adapters, or a sequence without its state row."""
    net = _net(folders["qwen3_5"], torch.float32)
    kv, states, meta, toks = _prefilled(net, [3, 5])
    h = torch.zeros(2, net.arch.dim)
    assert net.plan_step(h, meta, kv.k)
    assert not net.plan_step(h, meta, kv.k, drafting=True)
    fields = dict(positions=meta.positions, slot_mapping=meta.slot_mapping, query_start=meta.query_start,
                  seq_lens=meta.seq_lens, block_tables=meta.block_tables, page_size=PS)
    assert not net.plan_step(h, AttnMetadata(**fields, deterministic=True, state_slots=meta.state_slots), kv.k)
    assert not net.plan_step(h, AttnMetadata(**fields, state_slots=meta.state_slots, state_drafts=((7,), ())), kv.k)
    assert not net.plan_step(h, AttnMetadata(**fields), kv.k)  # no state rows
    chunk = AttnMetadata(torch.tensor([3, 5, 6]), meta.slot_mapping.new_tensor([0, 1, 2]), (0, 1, 3), (4, 7),
                         meta.block_tables, PS, state_slots=meta.state_slots)
    assert not net.plan_step(torch.zeros(3, net.arch.dim), chunk, kv.k)
    net.fast_decode = False
    assert not net.plan_step(h, meta, kv.k)


def test_plan_follows_module_swaps(folders) -> None:
    net = _net(folders["qwen3_5_moe"], torch.bfloat16)
    first = cpu_decode.plan_for(net)
    assert first is not None and cpu_decode.plan_for(net) is first
    # one expert's linear replaced, three levels below the layer: the plan is rebuilt
    import copy

    moe = next(layer.mlp for layer in net.layers if hasattr(layer.mlp, "experts_mlp"))
    moe.experts_mlp[1].down = copy.deepcopy(moe.experts_mlp[1].down)
    second = cpu_decode.plan_for(net)
    assert second is not None and second is not first and cpu_decode.plan_for(net) is second
    quantize_linears(net, body="int8", head=None)
    assert cpu_decode.plan_for(net) is not second


def _greedy_runs(model: superslm.Model, ps: list[list[int]], n: int) -> dict[bool, tuple[list, list]]:
    """Per plan switch: each request's TokenLogprobs (top 5) of n greedy tokens, decoding together, and the expert
    counts of each MoE layer after them."""
    out = {}
    for fast in (True, False):
        model.net.fast_decode = fast
        moes = [layer.mlp for layer in model.net.layers if hasattr(layer.mlp, "tokens_per_expert")]
        for m in moes:
            m.tokens_per_expert.zero_()
        engine = model.engine(slots=4, context=128)
        reqs = [Request(p, n, Sampling(ignore_eos=True, logprobs=5)) for p in ps]
        out[fast] = ([c.logprobs for c in engine.generate(reqs)], [m.tokens_per_expert.tolist() for m in moes])
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", "int8"), ("bfloat16", "int4")])
def test_engine_greedy_tokens_equal_the_layers(family: str, dtype: str, quant: str | None, folders) -> None:
    """40 greedy tokens of 4 requests decoding together (one with a 1-token prompt: its first step is a decode row
    at position 0), the plan on and off: the same tokens in float32. In bfloat16 the plan rounds a few values
    otherwise than the layers (a bf16 ulp of these random tiny models' flat logits, 2^-6 at 4, picks another
    token): the same tokens until a near-tie, where the plan's token is within 4 ulps of the layers' best, or until
    a router chose another expert for a row (a MoE's near-tie: the expert counts up to that step differ)."""
    model = superslm.load(folders[family], dtype=dtype, quant=quant)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    runs = _greedy_runs(model, ps, 40)
    first = None
    for plan, layers in zip(runs[True][0], runs[False][0]):
        assert len(plan) == len(layers) == 40
        for j, (a, b) in enumerate(zip(plan, layers)):
            if a.token != b.token:
                assert dtype == "bfloat16", (j, a, b)
                top = dict(b.top)
                if a.token not in top or top[b.token] - top[a.token] > 4 * 2**-6:
                    first = j if first is None else min(first, j)
                break
    if first is not None:  # not a near-tie of the logits: a router's, up to that step
        runs = _greedy_runs(model, ps, first + 1)
        assert runs[True][1] != runs[False][1], f"step {first}: tokens differ beyond rounding, the experts do not"


def test_plan_refuses_bad_state_rows(folders) -> None:
    """A state slot outside the states, given twice, or missing is refused by name, never read or written."""
    net = _net(folders["qwen3_5"], torch.float32)
    kv, states, meta, toks = _prefilled(net, [3, 5])
    h = net.embed(toks)
    tabs = net.rope_table_list(meta.positions)
    key_slots, row_seq, lens = cpu_decode.row_key_slots(meta, h.device)
    rows = states.conv.shape[1]
    for slots, match in (((0, rows), "out of range"), ((1, 1), "given twice"), ((0,), "one int64 state slot")):
        with pytest.raises(RuntimeError, match=match):
            cpu_decode.decode_layers(net, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, kv.k, kv.v, 0,
                                     len(net.layers), states=states, state_slots=slots)
