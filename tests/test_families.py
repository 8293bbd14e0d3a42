"""The families added as parts (Phi-3: fused q/k/v and gate/up, LongRoPE; SmolLM3: NoPE layers) against
transformers, through the forward pass, the C++ plan and the engine. Their plain logits test is
test_models_hf.py's, over CONFIGS."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.errors import FormatError, UnsupportedModel
from superslm.models.loader import canonical_names, materialize, open_source
from superslm.models.transformer import Transformer
from tests.tiny_models import CONFIGS, SMALL, SingleSequence, build_hf_model, hf_greedy, write_tokenizer


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[object, object]:
    folder = tmp_path_factory.mktemp("tiny-phi3")
    return build_hf_model("phi3", folder), folder


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory) -> tuple[object, object]:
    folder = tmp_path_factory.mktemp("tiny-smollm3")
    return build_hf_model("smollm3", folder), folder


def _one_at_a_time(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits with one token per call (LongRoPE then picks its table by each token's position)."""
    out, past = [], None
    with torch.no_grad():
        for t in tokens:
            res = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            out.append(res.logits[0].float())
            past = res.past_key_values
    return torch.cat(out)


def test_phi3_reads_its_fused_tensors(phi3) -> None:
    _, folder = phi3
    src = open_source(folder)
    names = canonical_names(src)
    assert names["layers.0.qkv"].name == "model.layers.0.self_attn.qkv_proj.weight"
    assert names["layers.0.gate_up"].name == "model.layers.0.mlp.gate_up_proj.weight"
    assert "layers.0.q" not in names and "layers.0.gate" not in names
    a = src.arch
    assert (a.rope.kind, a.rope.original_context, a.rotary_dim, a.windows[0]) == ("longrope", 64, 12, 12)


def test_phi3_longrope_past_the_trained_context_matches_transformers(phi3) -> None:
    """Fed one token at a time past the 64 trained positions, each row takes the long factors, as
    transformers does for a token whose position passes them."""
    hf, folder = phi3
    src = open_source(folder)
    net = Transformer(src.arch, materialize(src, torch.float32))
    tokens = torch.randint(0, src.arch.vocab, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    want = _one_at_a_time(hf, tokens)
    seq = SingleSequence(net, pages=32)
    with torch.no_grad():
        got = torch.cat([seq.step([t]) for t in tokens])
    assert (got - want).abs().max().item() <= 1e-4
    # the long factors matter there: with the short ones everywhere the rows past 64 differ
    short = replace(src.arch, rope=replace(src.arch.rope, long_factors=src.arch.rope.freq_factors))
    wrong = Transformer(short, materialize(src, torch.float32))
    seq = SingleSequence(wrong, pages=32)
    with torch.no_grad():
        off = torch.cat([seq.step([t]) for t in tokens])
    assert (off[:64] - want[:64]).abs().max().item() <= 1e-4
    assert (off[64:] - want[64:]).abs().max().item() > 1e-2


def test_smollm3_nope_layers_matter(smollm3) -> None:
    """The NoPE layers run without rotary positions: the same weights with rope everywhere give other logits."""
    hf, folder = smollm3
    src = open_source(folder)
    assert src.arch.rope_layers == (True, False, True, False)
    tokens = torch.randint(0, src.arch.vocab, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
        ours = SingleSequence(Transformer(src.arch, materialize(src, torch.float32))).step(tokens)
        everywhere = Transformer(replace(src.arch, rope_layers=(True,) * 4), materialize(src, torch.float32))
        wrong = SingleSequence(everywhere).step(tokens)
    assert (ours - want).abs().max().item() <= 1e-4
    assert (wrong - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", ["phi3", "smollm3"])
def test_engine_greedy_equals_transformers(family: str, phi3, smollm3) -> None:
    """Through superslm.load and the engine (the C++ plan at decode, batched), in fp32 and bf16 alike as far
    as greedy tokens go at this size; prompts stay within Phi-3's trained context, where transformers' one
    table per call and our per-row rule agree."""
    hf, folder = phi3 if family == "phi3" else smollm3
    model = superslm.load(folder, dtype="float32")
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 17, 30)]
    engine = model.engine(slots=4, context=128)
    got = [c.tokens for c in engine.generate([Request(p, 10, Sampling(ignore_eos=True)) for p in ps])]
    assert got == [hf_greedy(hf, p, 10) for p in ps]
    # the same answers in deterministic mode (every step through the C++ plan's per-row arithmetic)
    det = model.engine(slots=4, context=128, deterministic=True)
    assert [c.tokens for c in det.generate([Request(p, 10, Sampling(ignore_eos=True)) for p in ps])] == got


def test_phi3_converts_and_loads_back(phi3, tmp_path) -> None:
    """`superslm convert` of a fused checkpoint (dense and int8 bodies) loads back with the same logits."""
    from superslm.convert import convert

    _, folder = phi3
    src = open_source(folder)
    tokens = torch.randint(0, src.arch.vocab, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        want = SingleSequence(Transformer(src.arch, materialize(src, torch.float32))).step(tokens)
    for body, tol in (("dense", 1e-5), ("int8", 0.15)):
        out = convert(folder, tmp_path / body, format=body, head="dense", progress=False)
        model = superslm.load(out, dtype="float32", quant=None if body == "dense" else "auto")
        with torch.no_grad():
            got = SingleSequence(model.net).step(tokens)
        assert (got - want).abs().max().item() <= tol, body


def test_bad_family_configs_are_refused(tmp_path) -> None:
    build_hf_model("smollm3", tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["no_rope_layers"] = [1, 0]
    path.write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="no_rope_layers"):
        open_source(tmp_path)
    _, kwargs = CONFIGS["phi3"]
    bad = dict(kwargs["rope_parameters"], long_factor=[1.0, 2.0])  # 2 factors for 6 frequencies
    cfg = dict(json.loads(path.read_text()), model_type="phi3", rope_parameters=bad,
               original_max_position_embeddings=64)
    cfg.pop("no_rope_layers")
    path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="longrope"):
        open_source(tmp_path)


#: SmolLM3 as llama.cpp runs it: a NoPE layer every 4th (llama.cpp fixes the step at 4, the config's default)
_SMOLLM3_GGUF = ("SmolLM3Config", dict(SMALL, num_hidden_layers=4, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                                       rope_theta=2000000.0, tie_word_embeddings=False))


@pytest.mark.slow  # fetches llama-cpp-python's source distribution from PyPI once
@pytest.mark.parametrize("family", ["phi3", "smollm3"])
def test_gguf_from_llama_cpp_converter_matches_transformers(family: str, tmp_path) -> None:
    """llama.cpp's own converter writes the GGUF (fused attn_qkv and ffn_up, rope_factors_long/short and the
    attention factor for Phi-3; q/k rows permuted for SmolLM3): our logits from it equal transformers'."""
    from tests.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    hf = build_hf_model(family, folder, spec=_SMOLLM3_GGUF if family == "smollm3" else None)
    # the converter reads a Phi-3 vocabulary as GPT-2's BPE only when told; SmolLM3's, as Llama 3's, by itself
    cls = "GPT2Tokenizer" if family == "phi3" else "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    gguf = convert(folder, tmp_path / "model.gguf")
    src = open_source(gguf)
    a = open_source(folder).arch
    assert (src.arch.rope.kind, src.arch.rope_layers, src.arch.windows, src.arch.rotary_dim) == (
        a.rope.kind, a.rope_layers, a.windows, a.rotary_dim)
    if a.rope.kind == "longrope":  # the file's factors are float32, as transformers computes with them
        f32 = lambda f: torch.tensor(f, dtype=torch.float32).tolist()  # noqa: E731
        assert (src.arch.rope.freq_factors, src.arch.rope.long_factors) == (
            tuple(f32(a.rope.freq_factors)), tuple(f32(a.rope.long_factors)))
        assert abs(src.arch.rope.longrope_scale() - a.rope.longrope_scale()) < 1e-6
    tokens = torch.randint(0, a.vocab, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
        got = SingleSequence(Transformer(src.arch, materialize(src, torch.float32))).step(tokens)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.slow  # fetches llama-cpp-python's source distribution from PyPI once
def test_a_gguf_with_biases_converts_block_for_block(tmp_path) -> None:
    """`superslm convert --format gguf` of a llama.cpp Q8_0 file whose q/k/v carry biases (Qwen2): the folder's
    linears keep the file's blocks, the biases come from the file's float tensors, the logits are the file's
    within bf16 roundings."""
    from superslm.convert import convert as ours
    from tests.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    # two spare rows: transformers' Qwen2 tokenizer adds <|endoftext|> past our 300 tokens, which the converter
    # wants inside the vocabulary
    cls, kwargs = CONFIGS["qwen2"]
    build_hf_model("qwen2", folder, spec=(cls, dict(kwargs, vocab_size=302)))
    write_tokenizer(folder, 300)
    gguf = convert(folder, tmp_path / "model.gguf", outtype="q8_0")
    out = ours(gguf, tmp_path / "converted", format="gguf", progress=False)
    tokens = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    direct, folder_model = superslm.load(gguf), superslm.load(out)
    assert folder_model.info()["linears"] == direct.info()["linears"]  # the same formats, from the same blocks
    with torch.no_grad():
        want = SingleSequence(direct.net).step(tokens)
        got = SingleSequence(folder_model.net).step(tokens)
    # bf16 activations on both sides (the head and embedding may differ in layout between the two): close, not equal
    assert (got.float() - want.float()).abs().max().item() <= 0.05
