"""Hybrid and MoE families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE) against transformers, and the engine's
contracts on a hybrid model (recurrent states per slot) and a MoE model."""

from __future__ import annotations

import json

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.engine import persist
from superslm.errors import StateCorrupted, UnsupportedModel
from superslm.kernels import delta_rule
from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from tests.test_engine import engine_page_bytes, prompts
from tests.tiny_models import SingleSequence, build_hf_model, hf_greedy

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[object, object]]:
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        out[family] = (build_hf_model(family, folder), folder)
    return out


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_delta_rule_forms_equal_transformers() -> None:
    """The chunked form (prompts, chunks of 64 with a padded last one) and the recurrent form (one token at a
    time) against transformers' torch references, with 2 key heads serving 4 value heads and a starting state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    g = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 150, 2, 4, 16, 8
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.1
    args = (q[None], k[None], v[None], decay[None], beta[None])
    want, want_s = torch_chunk_gated_delta_rule(*args, initial_state=s0[None], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    qn, kn = delta_rule.normalize_qk(q, k)
    got, got_s = delta_rule.chunked(qn, kn, v, decay, beta, s0)
    assert (got - want[0]).abs().max() <= 1e-5 and (got_s - want_s[0]).abs().max() <= 1e-5
    rec, rec_s = torch_recurrent_gated_delta_rule(*args, initial_state=s0[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    s, rows = s0[None].clone(), []
    for i in range(t):
        o, s = delta_rule.recurrent(qn[i:i + 1], kn[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], s)
        rows.append(o)
    assert (torch.cat(rows) - rec[0]).abs().max() <= 1e-5 and (s[0] - rec_s[0]).abs().max() <= 1e-5
    # the chunk size is a choice of arithmetic, not of result
    other, other_s = delta_rule.chunked(qn, kn, v, decay, beta, s0, chunk=16)
    assert (other - got).abs().max() <= 1e-4 and (other_s - got_s).abs().max() <= 1e-4


def test_in_place_recurrent_step_equals_the_reference() -> None:
    """recurrent_ (the engine's decode step: the state rows updated where they are) gives recurrent's outputs and
    states up to float rounding, and a row's bits are the same alone as beside others (value heads twice the
    key heads, as Qwen3.5's larger sizes have)."""
    torch.manual_seed(0)
    b, hk, hv, dk, dv = 3, 2, 4, 16, 8
    q, k = delta_rule.normalize_qk(torch.randn(b, hk, dk), torch.randn(b, hk, dk))
    v, g, beta = torch.randn(b, hv, dv), -torch.rand(b, hv), torch.rand(b, hv)
    state = torch.randn(b, hv, dk, dv) * 0.1
    want_o, want_s = delta_rule.recurrent(q, k, v, g, beta, state.clone())
    got_s = state.clone()
    got_o = delta_rule.recurrent_(q, k, v, g, beta, got_s)
    assert torch.allclose(got_o, want_o, atol=1e-6) and torch.allclose(got_s, want_s, atol=1e-6)
    alone = state[1:2].clone()
    o1 = delta_rule.recurrent_(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], alone)
    assert torch.equal(o1, got_o[1:2]) and torch.equal(alone, got_s[1:2])


@pytest.mark.parametrize(("hk", "hv", "t"), [(16, 16, 200), (8, 16, 130), (3, 9, 70)])
def test_the_prompt_form_by_head_groups_is_bit_identical(hk: int, hv: int, t: int) -> None:
    """chunked works on HEAD_GROUP value heads at a time (its temporaries scale with heads x rows): every group
    size, whole key heads or not, gives the bits of all heads at once."""
    torch.manual_seed(0)
    q, k = delta_rule.normalize_qk(torch.randn(t, hk, 32), torch.randn(t, hk, 32))
    v, g, beta = torch.randn(t, hv, 24), -torch.rand(t, hv), torch.rand(t, hv)
    state = torch.randn(hv, 32, 24) * 0.1
    want_o, want_s = delta_rule.chunked(q, k, v, g, beta, state, head_group=hv)
    for group in (1, 2, 4, 5):
        o, s = delta_rule.chunked(q, k, v, g, beta, state, head_group=group)
        assert torch.equal(o, want_o) and torch.equal(s, want_s)


def test_causal_conv_equals_transformers() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 12, generator=g), torch.randn(12, 4, generator=g)
    want = causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    got, state = delta_rule.causal_conv(x[:13], w, torch.zeros(12, 3))
    rows = [got]
    for i in range(13, 20):  # then one row at a time from the carried state, as a decode step
        y, state = delta_rule.causal_conv_step(x[i:i + 1], w, state[None])
        state = state[0]
        rows.append(y)
    assert (torch.cat(rows) - want).abs().max() <= 1e-6
    hf_state = torch.zeros(1, 12, 4)
    hf_state[0, :, 1:] = x[10:13].T
    step = causal_conv1d_update(x[13:14].T[None], hf_state, w, None, "silu")[0, :, 0]
    assert (step - want[13]).abs().max() <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family: str, built) -> None:
    """fp32 logits within 1e-4 of transformers for a 200-token prompt read as a 130-token chunk (three
    delta-rule chunks), a 64-token one, then single tokens (the recurrent form)."""
    hf, folder = built[family]
    src = open_source(folder)
    tokens = _tokens(200, 2)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
        seq = SingleSequence(Transformer(src.arch, materialize(src, torch.float32)), pages=64)
        cuts = ((0, 130), (130, 194), *((i, i + 1) for i in range(194, 200)))
        got = torch.cat([seq.step(tokens[a:b]) for a, b in cuts])
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.float_kv
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_64_steps_equals_transformers(family: str, built) -> None:
    hf, folder = built[family]
    model = superslm.load(folder, dtype="float32")
    ps = [_tokens(n, 3 + n) for n in (9, 150)]
    engine = model.engine(slots=2, context=256, chunk=48)
    got = [c.tokens for c in engine.generate([Request(p, 64, Sampling(ignore_eos=True)) for p in ps])]
    assert got == [hf_greedy(hf, p, 64) for p in ps]


def test_layer_kinds_and_refusals(built, tmp_path) -> None:
    a = open_source(built["qwen3_5"][1]).arch
    assert a.mixers == ("delta", "delta", "delta", "attention") and a.attn_gate and a.rotary_dim == 4
    assert a.delta.conv_width == 2 * 2 * 16 + 4 * 8
    n = open_source(built["qwen3_next"][1]).arch
    assert n.moe_layers == (False, True, True, True) and n.experts.shared_ffn == 48 and n.experts.norm_top_k
    m = open_source(built["qwen3_moe"][1]).arch
    assert m.mixers == ("attention",) * 3 and m.moe_layers == (False, True, False) and not m.attn_gate
    model = superslm.load(built["qwen3_5"][1])
    assert tuple(model.info()["arch"]["mixers"]) == a.mixers
    assert model.info()["layers"] == "4: 3 gated delta rule, 1 gated attention; dense MLP"
    assert superslm.load(built["qwen3_next"][1]).info()["layers"] == (
        "4: 3 gated delta rule, 1 gated attention; 8 experts of 32, top 2 and a shared expert of 48, on 3 layers "
        "(the rest dense)")
    # the decode graphs run attention and dense MLPs only: these layers are refused by type; the C++ plan takes
    # their all-decode steps with a state row for each sequence (tests/test_cpu_decode_hybrid.py), not this one
    from superslm.engine.graphs import graph_reason
    from superslm.kernels.attention import AttnMetadata

    net = model.net
    assert not net.plain and not net.plan_step(net.embed(torch.tensor([3])), AttnMetadata.one_prompt(1, 4),
                                               torch.zeros(1, 4, a.kv_heads, a.head_dim, dtype=net.dtype))
    assert "reference path" in graph_reason(net, deterministic=False)
    # a multimodal checkpoint's nested config is refused by name, not misread
    folder = tmp_path / "vl"
    folder.mkdir()
    text = json.loads((built["qwen3_5"][1] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "text_config": text}))
    with pytest.raises(UnsupportedModel, match="multimodal"):
        open_source(folder)


def test_a_moe_config_without_a_dense_width_loads(built, tmp_path) -> None:
    """Qwen3.5-MoE's published configs name moe_intermediate_size only (no intermediate_size): the Arch reads it."""
    folder = tmp_path / "moe"
    folder.mkdir()
    cfg = json.loads((built["qwen3_5_moe"][1] / "config.json").read_text())
    cfg.pop("intermediate_size", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in built["qwen3_5_moe"][1].glob("*.safetensors"):
        (folder / f.name).symlink_to(f)
    a = open_source(folder).arch
    assert a.ffn == cfg["moe_intermediate_size"] and a.experts.ffn == cfg["moe_intermediate_size"]


def test_int8_linears_on_hybrid_layers(built) -> None:
    """quant="int8" swaps the parts' linears, each expert's included (the routers stay dense); the logits' error is
    within 3x the error transformers itself makes in bf16, on a hybrid and on a MoE model."""
    import transformers

    counts = superslm.load(built["qwen3_5_moe"][1], quant="int8").info()["linears"]
    # mixers, shared MLPs, 8 experts a layer, the head
    assert sum(n for k, n in counts.items() if "int8" in k) == 4 * 2 + 4 * 2 + 4 * 8 * 2 + 1
    for family in ("qwen3_5", "qwen3_moe"):
        hf, folder = built[family]
        p = _tokens(90, 9)
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
            hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            bf16_error = (hf16(torch.tensor([p])).logits[0].float() - want).abs().mean()
            got = SingleSequence(superslm.load(folder, quant="int8").net).step(p).float()
        assert (got - want).abs().mean() <= 3 * bf16_error, family


# --- the engine's contracts on a hybrid and a MoE model ---------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_moe"])
def model(request, built) -> superslm.Model:
    return superslm.load(built[request.param][1], dtype="float32")


def _greedy(model: superslm.Model, ps: list[list[int]], n: int = 12, **kwargs) -> list[list[int]]:
    engine = model.engine(**{"slots": 4, "context": 160, **kwargs})
    return [c.tokens for c in engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])]


def test_alone_batched_chunked_budgeted_deterministic(model) -> None:
    ps = prompts(5, seed=20, lo=3, hi=90)
    alone = [_greedy(model, [p], slots=1)[0] for p in ps]
    assert _greedy(model, ps) == alone
    for chunk in (1, 7, 64):
        assert _greedy(model, ps, chunk=chunk, rows=64) == alone, f"chunk {chunk}"
    assert _greedy(model, ps, deterministic=True) == alone
    engine = model.engine(slots=4, context=160)
    ids = [engine.add(Request(p, 12, Sampling(ignore_eos=True))) for p in ps]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy():
        for pr in engine.advance(layer_budget=1):
            got[pr.id] += pr.tokens
    assert [got[i] for i in ids] == alone


def test_deterministic_mode_is_bit_identical(model) -> None:
    """Deterministic mode on hybrid and MoE layers: a request's tokens and logprobs are bit-identical alone, in a
    batch, and with its prompt in chunks of 1, 7 or 64 rows (the delta rule runs token by token there: the
    chunked form's roundings depend on where its chunks start)."""
    ps = prompts(4, seed=24, lo=5, hi=80)

    def run(**kwargs) -> list[list[tuple]]:
        engine = model.engine(**{"slots": 4, "context": 160, "deterministic": True, **kwargs})
        reqs = [Request(p, 6, Sampling(temperature=0.9, seed=sum(p), logprobs=2, ignore_eos=True)) for p in ps]
        return [[(lp.token, lp.logprob, lp.top) for lp in c.logprobs] for c in engine.generate(reqs)]

    batched = run()
    assert run(slots=1) == batched  # one slot: each request alone
    for chunk in (1, 7, 64):
        assert run(chunk=chunk, rows=64) == batched, f"chunk {chunk}"


def test_preemption_and_the_prefix_cache(model) -> None:
    """Preempted sequences recompute from their start (a delta-rule state restarts from zeros) and answer as
    alone, and every state row comes back."""
    ps = prompts(6, seed=21, lo=20, hi=30)
    alone = [_greedy(model, [p], 20, slots=1)[0] for p in ps]
    engine = model.engine(slots=6, context=160, page_size=4, kv_budget=30 * engine_page_bytes(model, 4))
    got = engine.generate([Request(p, 20, Sampling(ignore_eos=True)) for p in ps])
    assert engine.scheduler.num_preemptions > 0
    assert [c.tokens for c in got] == alone
    assert engine.pool.num_used == 0
    if model.arch.hybrid:
        assert sorted(engine.scheduler.free_states) == list(range(6))  # every state row came back
    again = engine.generate([Request(ps[0], 20, Sampling(ignore_eos=True))])[0]
    assert again.tokens == alone[0]


def test_a_hybrid_prefix_cache_resumes_from_checkpointed_states(built) -> None:
    """A delta-rule model's prefix cache: a repeated prompt resumes after its last full page (its chunk stopped
    there, so its states were checkpointed); a next turn that extends prompt and answer resumes at the last page
    boundary its answer reached; the answers equal an engine's without the cache, and in deterministic mode the
    logprobs are bit-identical cold and warm."""
    model = superslm.load(built["qwen3_5"][1], dtype="float32")
    p = _tokens(30, 11)
    s = Sampling(temperature=0.8, seed=3, logprobs=1, ignore_eos=True)
    plain = model.engine(slots=2, context=160, page_size=4, prefix_caching=False)
    assert plain.checkpoints is None and plain.saved_states is None  # no cache: no checkpoint rows taken
    for deterministic in (False, True):
        engine = model.engine(slots=2, context=160, page_size=4, deterministic=deterministic)
        # checkpoint rows start unwritten (they take memory once used): NaN there proves each is written first
        engine.saved_states.conv.fill_(float("nan"))
        engine.saved_states.ssm.fill_(float("nan"))
        cold = engine.generate([Request(p, 8, s)])[0]
        warm = engine.generate([Request(p, 8, s)])[0]
        assert cold.cached == 0 and warm.cached == 28  # 7 full pages; the last prompt token is always computed
        assert warm.tokens == cold.tokens
        if deterministic:
            assert [(x.token, x.logprob) for x in warm.logprobs] == [(x.token, x.logprob) for x in cold.logprobs]
        turn = p + cold.tokens + [5, 6, 7]  # 30 + 8 + 3: the answer's computed tokens reached 36
        nxt = engine.generate([Request(turn, 8, s)])[0]
        assert nxt.cached == 36
        assert nxt.tokens == plain.generate([Request(turn, 8, s)])[0].tokens
        other = engine.generate([Request(p, 8, Sampling(ignore_eos=True), salt="x")])[0]
        assert other.cached == 0  # another salt never shares pages, nor their states
        assert engine.pool.num_used == 0 and sorted(engine.scheduler.free_states) == [0, 1]


def test_save_restore_and_prefix_handles(model) -> None:
    p = prompts(1, seed=22, lo=70, hi=70)[0]
    want = _greedy(model, [p], 16)[0]
    engine = model.engine(slots=2, context=160)
    rid = engine.add(Request(p, 16, Sampling(ignore_eos=True)))
    first: list[int] = []
    while len(first) < 5:
        for pr in engine.advance():
            first += pr.tokens
    blob = engine.save(rid)
    other = model.engine(slots=2, context=160)
    rest: list[int] = []
    other.restore(blob)
    while other.busy():
        for pr in other.advance():
            rest += pr.tokens
    assert first + rest == want
    saved = persist.decode(blob, model.fingerprint)
    assert sorted(saved.extra) == (["conv", "ssm"] if model.arch.hybrid else [])
    if model.arch.hybrid:  # KV alone cannot resume a delta-rule model: a blob without its states is refused
        stripped = persist.encode(saved.header, saved.k, saved.v)
        with pytest.raises(StateCorrupted, match="recurrent states"):
            model.engine(slots=1, context=160).restore(stripped)
    pre = engine.prefix(p[:37])
    c = engine.generate([Request(p[37:], 16, Sampling(ignore_eos=True), prefix=pre)])[0]
    assert c.tokens == want and c.cached == 37


@pytest.mark.float_kv
def test_hidden_and_low_level_steps_equal_transformers(model, built) -> None:
    family = "qwen3_5" if model.arch.hybrid else "qwen3_moe"
    hf = built[family][0]
    a, b = prompts(2, seed=23, lo=30, hi=80)
    engine = model.engine(slots=2, context=160)
    rows = [(t, 0) for t in a] + [(t, 1) for t in b]
    wanted = [False] * len(rows)
    wanted[len(a) - 1] = wanted[-1] = True
    logits = engine.step([t for t, _ in rows], [s for _, s in rows], wanted)
    with torch.no_grad():
        want_a, want_b = hf(torch.tensor([a])).logits[0, -1], hf(torch.tensor([b])).logits[0, -1]
        nxt = int(want_a.argmax())
        want_next = hf(torch.tensor([a + [nxt]])).logits[0, -1]
        hidden = hf(torch.tensor([b]), output_hidden_states=True).hidden_states
    assert (logits[0] - want_a).abs().max() <= 1e-4 and (logits[1] - want_b).abs().max() <= 1e-4
    assert (engine.step([nxt], [0], [True])[0] - want_next).abs().max() <= 1e-4
    engine.reset(0)
    engine.reset(1)
    layers = list(range(model.arch.layers + 1))
    got = engine.hidden(b, [1] * len(b), layers)
    for i in layers:
        assert (got[i] - hidden[i][0]).abs().max() <= 1e-4, f"layer {i}"


def test_expert_counts(built) -> None:
    model = superslm.load(built["qwen3_moe"][1], dtype="float32")
    engine = model.engine(slots=2, context=128)
    assert engine.expert_counts() == {1: [0] * 8}
    engine.generate([Request(_tokens(30, 5), 4, Sampling(ignore_eos=True))])
    counts = engine.expert_counts()
    # 30 prompt rows and 3 decode rows (the last token is sampled, never read), 2 experts each
    assert list(counts) == [1] and sum(counts[1]) == 2 * 33
    assert superslm.load(built["qwen3_5"][1]).engine(slots=1, context=64).expert_counts() == {}



#: llama.cpp's converter runs experts on every layer (no dense layer between them), and its Qwen tokenizer adds
#: <|endoftext|> past our 300 tokens, which must stay inside the vocabulary
_GGUF_SPECS = {"qwen3_next": dict(mlp_only_layers=[]), "qwen3_moe": dict(decoder_sparse_step=1)}


@pytest.mark.slow  # fetches llama-cpp-python's source distribution from PyPI once
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_from_llama_cpp_converter_matches_transformers(family: str, tmp_path) -> None:
    """llama.cpp's own converter writes the GGUF (A as -exp(A_log), value heads tiled for Qwen3.5, Qwen3-Next's
    q, k, v, z regrouped and b, a kept by key head, experts stacked): our logits from it equal transformers'."""
    from tests.llama_cpp_convert import convert
    from tests.tiny_models import CONFIGS, write_tokenizer

    folder = tmp_path / "hf"
    cls, kwargs = CONFIGS[family]
    hf = build_hf_model(family, folder, spec=(cls, dict(kwargs, vocab_size=302, **_GGUF_SPECS.get(family, {}))))
    write_tokenizer(folder, 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    gguf = convert(folder, tmp_path / "model.gguf", extra=() if family == "qwen3_moe" else ("--no-mtp",))
    src = open_source(gguf)
    assert src.arch.mixers == open_source(folder).arch.mixers
    tokens = _tokens(150, 7)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
        got = SingleSequence(Transformer(src.arch, materialize(src, torch.float32))).step(tokens)
    assert (got - want).abs().max().item() <= 1e-4
    model = superslm.load(gguf, dtype="float32")  # fp32: dense weights (f32 blocks) in fp32, as transformers runs
    c = model.engine(slots=1, context=256).generate([Request(tokens[:40], 8, Sampling(ignore_eos=True))])[0]
    assert c.tokens == hf_greedy(hf, tokens[:40], 8)


@pytest.mark.slow  # llama.cpp's converter and quantizer
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_gguf_runs_its_blocks_as_stored(family: str, tmp_path) -> None:
    """A llama.cpp Q4_0 file of each family loads with its blocks as they are (int4 codes exact, each expert's rows
    of the stacked expert tensors too; value heads tiled along an output's columns as int8): its logits follow
    the same file's dense weights as closely as an int8 re-quantization of them does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.llama_cpp_convert import convert
    from tests.tiny_models import CONFIGS, write_tokenizer

    folder = tmp_path / "hf"
    cls, kwargs = CONFIGS[family]
    build_hf_model(family, folder, spec=(cls, dict(kwargs, vocab_size=302, **_GGUF_SPECS.get(family, {}))))
    write_tokenizer(folder, 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    wide = convert(folder, tmp_path / "model.gguf", extra=() if family == "qwen3_moe" else ("--no-mtp",))
    q4 = tmp_path / "model-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    assert llama_cpp.llama_model_quantize(str(wide).encode(), str(q4).encode(), params) == 0
    stored = superslm.load(q4)  # quant "auto": the blocks on the CPU
    kinds = stored.info()["linears"]
    assert any("codes exact" in k for k in kinds) and not any(k.startswith("dense") for k in kinds), kinds
    experts = [m for layer in stored.net.layers for m in getattr(layer.mlp, "experts_mlp", ())]
    assert ("moe" in family or "next" in family) == bool(experts)
    # each expert's rows of the stacked tensors, as stored (Q4_0 codes, or the quantizer's fallback type)
    assert all("from Q" in m.gate_up.describe() and "from Q" in m.down.describe() for m in experts)
    dense = superslm.load(q4, quant=None, dtype="float32")
    tokens = _tokens(120, 3)
    with torch.no_grad():
        got = SingleSequence(stored.net).step(tokens).float()
        want = SingleSequence(dense.net).step(tokens).float()
        int8 = SingleSequence(superslm.load(q4, quant="int8").net).step(tokens).float()

    def corr(x: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([x.flatten(), want.flatten()]))[0, 1].item()

    def agree(x: torch.Tensor) -> float:
        return (x.argmax(-1) == want.argmax(-1)).float().mean().item()

    # close to the dense weights, about as close as re-quantizing them to int8 is (a tiny random MoE's router
    # flips experts on small errors, so its bar is that path's, which tests against transformers above, less 1e-3:
    # Qwen3-MoE's logits moved from 0.9996 to 0.9975 when its int4 prompt rows changed from decoded blocks + sgemm
    # to the AVX2 row kernel, whose outputs are one bf16 ulp from the sgemm's, both 0.25% from the float product)
    assert corr(got) > min(0.999, corr(int8) - 1e-3), (corr(got), corr(int8))
    assert agree(got) >= min(0.9, agree(int8)), (agree(got), agree(int8))
    p = [Request(tokens[:30], 8, Sampling(ignore_eos=True))]
    c = stored.engine(slots=1, context=128).generate(p)[0]
    assert len(c.tokens) == 8 and c.tokens[0] == int(want[29].argmax())
