"""The MTP (multi-token prediction) block of Qwen3.5 / Qwen3-Next checkpoints: loaded from a HF folder and from
llama.cpp's GGUF (its "nextn" block), kept by the model, and its draft logits against a reference built from
transformers' own modules (its decoder layer class holding the MTP layer's weights, its RMSNorm, its rotary
embedding), the computation vLLM's qwen3_5_mtp.py runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import superslm
from superslm.cache.kv import KVCache
from superslm.errors import UnsupportedModel
from superslm.kernels.attention import AttnMetadata
from superslm.models.loader import canonical_names, canonical_tensor, open_source
from superslm.models.mtp import draft
from superslm.models.transformer import Transformer
from superslm.quant import LinearFormat, linear_summary
from tests.tiny_models import CONFIGS, build_hf_model, write_tokenizer

#: the families with an MTP block, each with transformers' modules of the reference; Qwen3-Next without its
#: dense first layer, so the MTP layer (vLLM builds it as layer 0 of its stack) and transformers' layer 3 agree
_MODULES = {
    "qwen3_5": ("qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_moe": ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm",
                    "Qwen3_5MoeTextRotaryEmbedding"),
    "qwen3_next": ("qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm",
                   "Qwen3NextRotaryEmbedding"),
}
_SPECS: dict[str, dict[str, Any]] = {"qwen3_next": dict(mlp_only_layers=[])}
#: the attention layer of the tiny configs (layer_types: three delta-rule layers, then full attention)
_ATTN_LAYER = 3


def _modules(family: str) -> tuple[Any, Any, Any]:
    import importlib

    mod, layer, norm, rope = _MODULES[family]
    m = importlib.import_module(f"transformers.models.{mod}")
    return getattr(m, layer), getattr(m, norm), getattr(m, rope)


class Reference(torch.nn.Module):
    """vLLM's Qwen3NextMultiTokenPredictor.forward with transformers' modules: fc(cat(enorm(e), hnorm(h))), the
    decoder layer, the MTP's norm, then the body's head."""

    def __init__(self, family: str, config: Any) -> None:
        super().__init__()
        layer, norm, _ = _modules(family)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * dim, dim, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm(dim, eps=eps) for _ in range(3))
        self.layers = torch.nn.ModuleList([layer(config, layer_idx=_ATTN_LAYER)])

    def logits(self, hf: Any, family: str, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Draft logits [T, vocab] of rows (hidden[r], tokens[r]) at positions 0..T-1, one causal sequence."""
        _, _, rope = _modules(family)
        t = len(tokens)
        e = hf.model.embed_tokens(torch.tensor([tokens]))
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden[None])], dim=-1))
        pos = torch.arange(t)[None]
        cos_sin = rope(hf.config)(x, pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        return hf.lm_head(self.norm(x))[0].float()


def build_mtp_folder(family: str, folder: Path, seed: int = 0, vocab: int | None = None) -> tuple[Any, Reference]:
    """A tiny model of `family` with mtp_num_hidden_layers=1 saved by transformers, then random "mtp.*" tensors
    (the reference's own parameters, N(0, 0.08) each) added to its safetensors."""
    from safetensors.torch import load_file, save_file

    cls, kwargs = CONFIGS[family]
    spec = dict(kwargs, mtp_num_hidden_layers=1, **_SPECS.get(family, {}), **({"vocab_size": vocab} if vocab else {}))
    hf = build_hf_model(family, folder, seed=seed, spec=(cls, spec))
    torch.manual_seed(seed + 1)
    ref = Reference(family, hf.config).eval()
    with torch.no_grad():
        for p in ref.parameters():  # every one drawn: transformers leaves a bare module's experts uninitialized
            p.copy_(torch.randn_like(p) * 0.08)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    assert not any(k.startswith("mtp.") for k in tensors)  # transformers drops them: the folder had none
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in ref.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})
    return hf, ref


def hidden_states(net: Transformer, tokens: list[int]) -> torch.Tensor:
    """The main model's hidden states after its final norm [T, dim], one sequence on shuffled pages."""
    from tests.tiny_models import SingleSequence

    seq = SingleSequence(net)
    n, ps = len(tokens), seq.page_size
    pos = torch.arange(n)
    slots = torch.tensor([seq.block_table[p // ps] * ps + p % ps for p in range(n)])
    meta = AttnMetadata(pos, slots, (0, n), (n,), (seq.block_table,), ps, state_slots=(0,))
    h = net.run_layers(net.embed(torch.tensor(tokens)), meta, seq.kv.k, seq.kv.v, states=seq.states)
    return net.final_norm(h)


def draft_rows(net: Transformer, hidden: torch.Tensor, tokens: list[int], chunks: tuple[int, ...]) -> torch.Tensor:
    """`draft` over rows (hidden[r], tokens[r]) at positions 0..T-1, fed in `chunks` of rows to the MTP's own KV
    pages (one more attention layer, shuffled pages of 4)."""
    a, ps = net.arch, 4
    kv = KVCache(1, 32, ps, a.kv_heads, a.head_dim, net.dtype)
    table = tuple(torch.randperm(32, generator=torch.Generator().manual_seed(3)).tolist())
    out, start = [], 0
    for size in chunks:
        pos = torch.arange(start, start + size)
        slots = torch.tensor([table[p // ps] * ps + p % ps for p in pos.tolist()])
        meta = AttnMetadata(pos, slots, (0, size), (start + size,), (table,), ps)
        logits, normed = draft(net, hidden[start:start + size], torch.tensor(tokens[start:start + size]), meta,
                               kv.k[0], kv.v[0])
        assert normed.shape == (size, a.dim)
        out.append(logits)
        start += size
    return torch.cat(out)


def _tokens(n: int, seed: int, vocab: int = 300) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", list(_MODULES))
def test_draft_logits_equal_the_transformers_reference(family: str, tmp_path) -> None:
    """Row r: the main model's normed hidden state at position r and token r + 1, at position r (vLLM's
    proposer); fed whole or in chunks over shuffled pages, the draft logits equal the reference's (fp32, 1e-4)."""
    folder = tmp_path / "hf"
    hf, ref = build_mtp_folder(family, folder)
    model = superslm.load(folder, dtype="float32", quant="none")
    assert model.arch.mtp == 1 and model.net.mtp is not None
    tokens = _tokens(23, 5)
    with torch.no_grad():
        want_hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0]
        got_hidden = hidden_states(model.net, tokens)
        assert (got_hidden - want_hidden).abs().max().item() <= 1e-4
        want = ref.logits(hf, family, want_hidden[:-1], tokens[1:])
        for chunks in ((22,), (9, 1, 12), (1,) * 22):
            got = draft_rows(model.net, want_hidden[:-1], tokens[1:], chunks)  # the same input: the MTP alone
            assert (got - want).abs().max().item() <= 1e-4, chunks


def test_mtp_tensors_load_as_stored_and_show_in_info(tmp_path) -> None:
    """The canonical MTP tensors are the file's (norms as 1 + w, in float32 at any dtype); info says so."""
    folder = tmp_path / "hf"
    _, ref = build_mtp_folder("qwen3_5", folder)
    src = open_source(folder)
    names = canonical_names(src)
    sd = ref.state_dict()
    assert torch.equal(canonical_tensor(src, "mtp.fc", names["mtp.fc"]), sd["fc.weight"])
    assert torch.equal(canonical_tensor(src, "mtp.enorm", names["mtp.enorm"]), sd["pre_fc_norm_embedding.weight"] + 1)
    assert torch.equal(canonical_tensor(src, "mtp.layers.0.q", names["mtp.layers.0.q"]),
                       sd["layers.0.self_attn.q_proj.weight"])
    model = superslm.load(folder, dtype="bfloat16", quant="none")
    assert model.net.mtp.enorm.dtype == torch.float32 and model.net.mtp.fc.weight.dtype == torch.bfloat16
    info = model.info()
    assert info["arch"]["mtp"] == 1 and "MTP: 1 layer" in info["layers"]
    assert sum(linear_summary(model.net).values()) == sum(1 for _ in model.net.mtp.linears()) + 4 * 4 + 1


def test_a_checkpoint_without_mtp_loads_as_before(tmp_path) -> None:
    """A folder whose config says mtp_num_hidden_layers=1 but holds no mtp.* tensors (transformers' save), and a
    folder with the block read with fewer layers: no MTP, the Arch and the fingerprint as without the key."""
    cls, kwargs = CONFIGS["qwen3_5"]
    plain, said = tmp_path / "plain", tmp_path / "said"
    build_hf_model("qwen3_5", plain)
    build_hf_model("qwen3_5", said, spec=(cls, dict(kwargs, mtp_num_hidden_layers=1)))
    a, b = superslm.load(plain, dtype="float32"), superslm.load(said, dtype="float32")
    assert a.arch.mtp == b.arch.mtp == 0 and a.net.mtp is None and b.net.mtp is None
    assert "mtp" not in a.arch.summary() and a.fingerprint == b.fingerprint
    with pytest.raises(UnsupportedModel):
        draft(a.net, torch.zeros(1, a.arch.dim), torch.tensor([3]), None, None, None)  # type: ignore[arg-type]
    folder = tmp_path / "mtp"
    build_mtp_folder("qwen3_5", folder)
    part = superslm.load(folder, dtype="float32", layers=2)
    assert part.net.mtp is None


def test_a_missing_mtp_tensor_is_a_format_error(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from superslm.errors import FormatError

    folder = tmp_path / "hf"
    build_mtp_folder("qwen3_5", folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["mtp.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(FormatError, match="mtp.layers.0.self_attn.k_proj.weight"):
        superslm.load(folder, dtype="float32")


def test_formats_swap_the_mtp_linears(tmp_path) -> None:
    """int8 re-quantizes the MTP block's linears like the body's; its drafts stay near the dense ones."""
    folder = tmp_path / "hf"
    build_mtp_folder("qwen3_5", folder)
    dense = superslm.load(folder, dtype="float32", quant="none")
    q = superslm.load(folder, quant="int8")
    mods = [getattr(p, a) for p, a, _ in q.net.mtp.linears()]
    assert mods and all(isinstance(m, LinearFormat) for m in mods)
    tokens = _tokens(12, 9)
    with torch.no_grad():
        want = draft_rows(dense.net, hidden_states(dense.net, tokens)[:-1], tokens[1:], (11,))
        got = draft_rows(q.net, hidden_states(q.net, tokens)[:-1], tokens[1:], (11,))
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99


@pytest.mark.slow  # llama.cpp's converter (fetched from PyPI once)
@pytest.mark.parametrize("family", list(_MODULES))
def test_gguf_from_llama_cpp_converter_keeps_the_mtp_block(family: str, tmp_path) -> None:
    """llama.cpp's converter without --no-mtp writes the block as nextn tensors of block N and block N's layer
    tensors: the Arch has the body's layers and one MTP layer, every MTP tensor equals the folder's after the
    converter's transforms (norms + 1), and the GGUF's draft logits equal the folder's; run from the file's blocks
    they stay close, and a converted folder of the file gives the same drafts."""
    from tests.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    build_mtp_folder(family, folder, vocab=302)  # the converter's Qwen tokenizer adds tokens past our 300
    write_tokenizer(folder, 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    gguf = convert(folder, tmp_path / "model.gguf")
    hf_src, g_src = open_source(folder), open_source(gguf)
    assert g_src.arch.layers == hf_src.arch.layers == 4 and g_src.arch.mtp == hf_src.arch.mtp == 1
    assert g_src.arch.mixers == hf_src.arch.mixers
    hf_names, g_names = canonical_names(hf_src), canonical_names(g_src)
    keys = sorted(k for k in hf_names if k.startswith("mtp."))
    assert keys == sorted(k for k in g_names if k.startswith("mtp.")) and "mtp.layers.0.o" in keys
    for k in keys:
        want, got = canonical_tensor(hf_src, k, hf_names[k]), canonical_tensor(g_src, k, g_names[k])
        assert torch.equal(got, want), k
    tokens = _tokens(15, 4)
    a, b = superslm.load(folder, dtype="float32", quant="none"), superslm.load(gguf, dtype="float32")
    with torch.no_grad():
        hidden = hidden_states(a.net, tokens)[:-1]
        want = draft_rows(a.net, hidden, tokens[1:], (14,))
        got = draft_rows(b.net, hidden_states(b.net, tokens)[:-1], tokens[1:], (6, 8))
        assert (got - want).abs().max().item() <= 1e-4
        native = superslm.load(gguf)  # the file's blocks as they are (bf16 activations), the MTP's linears too
        assert all(isinstance(getattr(p, at), LinearFormat) for p, at, _ in native.net.mtp.linears())
        q = draft_rows(native.net, hidden.to(native.net.dtype), tokens[1:], (14,))
        assert torch.corrcoef(torch.stack([q.flatten(), want.flatten()]))[0, 1] > 0.99
        # `superslm convert` of the file keeps the block's blocks as the load runs them
        from superslm.convert import convert as ours

        kept = superslm.load(ours(gguf, tmp_path / "ours"))
        assert kept.arch.mtp == 1 and linear_summary(kept.net) == linear_summary(native.net)
        assert torch.equal(draft_rows(kept.net, hidden.to(kept.net.dtype), tokens[1:], (14,)), q)


@pytest.mark.parametrize("fmt", ["int8", "dense"])
def test_convert_keeps_the_mtp_block(fmt: str, tmp_path) -> None:
    """`superslm convert` writes the MTP block (its linears in the body's format): the converted folder's drafts
    are the loaded source's in the same formats, exactly; with --layers the block goes with the head."""
    from superslm.convert import convert
    from superslm.quant import quantize_linears

    folder = tmp_path / "hf"
    build_mtp_folder("qwen3_5", folder)
    got = superslm.load(convert(folder, tmp_path / "out", format=fmt), dtype="float32")
    ref = superslm.load(folder, quant=None, dtype="float32")
    if fmt != "dense":
        quantize_linears(ref.net, body=fmt, head="int8")
    assert got.arch == ref.arch and got.arch.mtp == 1 and got.net.mtp is not None
    assert linear_summary(got.net) == linear_summary(ref.net)
    tokens = _tokens(14, 2)
    with torch.no_grad():
        want = draft_rows(ref.net, hidden_states(ref.net, tokens)[:-1], tokens[1:], (13,))
        assert torch.equal(draft_rows(got.net, hidden_states(got.net, tokens)[:-1], tokens[1:], (13,)), want)
    cut = superslm.load(convert(folder, tmp_path / "cut", format=fmt, layers=2), dtype="float32")
    assert cut.arch.mtp == 0 and cut.net.mtp is None


@pytest.mark.slow  # llama.cpp's converter and quantizer
def test_a_q4_0_file_runs_the_mtp_block_from_its_blocks(tmp_path) -> None:
    """llama.cpp's quantizer writes the MTP block's linears as Q4_0 (nextn.eh_proj included) or its fallback
    types: they run as stored (codes exact), and the drafts follow the folder's float32 ones."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.llama_cpp_convert import convert

    folder = tmp_path / "hf"
    build_mtp_folder("qwen3_5_moe", folder, vocab=302)
    write_tokenizer(folder, 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    wide, q4 = convert(folder, tmp_path / "model.gguf"), tmp_path / "model-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    assert llama_cpp.llama_model_quantize(str(wide).encode(), str(q4).encode(), params) == 0
    stored = superslm.load(q4)
    kinds = [getattr(p, a).describe() for p, a, _ in stored.net.mtp.linears()]
    assert "codes exact" in kinds[0] and all("from Q" in k or "from F16" in k for k in kinds), kinds
    ref = superslm.load(folder, dtype="float32", quant="none")
    tokens = _tokens(15, 4)
    with torch.no_grad():
        hidden = hidden_states(ref.net, tokens)[:-1]
        want = draft_rows(ref.net, hidden, tokens[1:], (14,))
        got = draft_rows(stored.net, hidden.to(stored.net.dtype), tokens[1:], (14,))
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99
