"""Our forward pass against transformers on tiny random-weight models of every family."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from superslm.models.loader import materialize, open_source
from superslm.models.transformer import Transformer
from tests.tiny_models import PLAIN, SMALL, SingleSequence, build_hf_model


@pytest.mark.parametrize("family", PLAIN)
def test_logits_match_transformers(family: str, tmp_path) -> None:
    _check_logits(build_hf_model(family, tmp_path), tmp_path, family)


def _drop_rope_original(cfg: dict[str, Any]) -> None:
    cfg["rope_parameters"].pop("original_max_position_embeddings")


def _top_level_original(n: int) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        _drop_rope_original(cfg)
        cfg["original_max_position_embeddings"] = n

    return edit


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 512}  # fmt: skip
#: configs as users' folders spell them, edited after transformers saved them (transformers then reads the edited file)
VARIANTS: dict[str, tuple[str, dict[str, Any], Callable[[dict[str, Any]], None]]] = {
    # older transformers wrote Qwen2/Qwen3 configs without layer_types: layers >= max_window_layers slide
    "qwen2_legacy_window": ("Qwen2Config", dict(SMALL, use_sliding_window=True, sliding_window=6, max_window_layers=1),
                            lambda c: c.pop("layer_types")),
    "qwen3_legacy_window": ("Qwen3Config", dict(SMALL, head_dim=32, use_sliding_window=True, sliding_window=6,
                                                max_window_layers=1), lambda c: c.pop("layer_types")),
    # llama3 rope without its trained context: transformers takes max_position_embeddings (not 8192)
    "llama3_no_original": ("LlamaConfig", dict(SMALL, rope_theta=500000.0, rope_scaling=_LLAMA3), _drop_rope_original),
    # the trained context at the top level of config.json wins for llama3 and yarn
    "llama3_top_original": ("LlamaConfig", dict(SMALL, rope_theta=500000.0, max_position_embeddings=2048,
                                                rope_scaling=dict(_LLAMA3, factor=32.0)), _top_level_original(16)),
    "yarn_top_original": ("LlamaConfig", dict(SMALL, max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), _top_level_original(16)),
    # dynamic NTK scales past max_position_embeddings; a rope dict's original_max_position_embeddings is not read
    "dynamic_dict_original": ("LlamaConfig", dict(SMALL, max_position_embeddings=64, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}), lambda c: None),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant: str, tmp_path) -> None:
    import transformers

    cls_name, kwargs, edit = VARIANTS[variant]
    build_hf_model("llama", tmp_path, spec=(cls_name, kwargs))
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    _check_logits(hf, tmp_path, variant, prompt_len=30, decode_len=6)


def _check_logits(hf: Any, folder: Path, name: str, prompt_len: int = 20, decode_len: int = 16) -> None:
    """Our logits for a prompt and then one token at a time against transformers' in one pass, within 1e-4."""
    src = open_source(folder)
    net = Transformer(src.arch, materialize(src, torch.float32))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, src.arch.vocab, (prompt_len,), generator=g).tolist()
    decode = torch.randint(0, src.arch.vocab, (decode_len,), generator=g).tolist()
    family = name
    with torch.no_grad():
        want = hf(torch.tensor([prompt + decode])).logits[0].float()
        seq = SingleSequence(net)
        got = [seq.step(prompt)]
        got += [seq.step([t]) for t in decode]
    got_all = torch.cat(got)
    assert got_all.shape == want.shape
    diff = (got_all - want).abs().max().item()
    assert diff <= 1e-4, f"{family}: max abs diff {diff}"
    # the logits are not trivially flat: a wrong model would not pass by accident
    assert want.std().item() > 0.05


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_whole(chunk: int, tmp_path) -> None:
    build_hf_model("gemma3", tmp_path)
    src = open_source(tmp_path)
    net = Transformer(src.arch, materialize(src))
    tokens = torch.randint(0, src.arch.vocab, (30,)).tolist()
    with torch.no_grad():
        whole = SingleSequence(net).step(tokens)
        seq = SingleSequence(net, seed=5)
        parts = [seq.step(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-5


def _edited(folder: Path, edit: Callable[[dict[str, Any]], Any], name: str = "config.json") -> None:
    """Rewrite folder/name after `edit` changed its dict in place (its return value is ignored)."""
    path = folder / name
    cfg = json.loads(path.read_text()) if path.exists() else {}
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_malformed_configs_are_refused_by_name(tmp_path) -> None:
    """A config the forward pass cannot honour or cannot read is an error of our own classes naming the field, not
    a KeyError from inside a family's reader or a model computed without it (mlp_bias's tensors were dropped)."""
    from superslm.errors import FormatError, UnsupportedModel

    build_hf_model("llama", tmp_path)
    good = (tmp_path / "config.json").read_text()
    cases: list[tuple[Callable[[dict[str, Any]], Any], type[Exception], str]] = [
        (lambda c: c.update(mlp_bias=True), UnsupportedModel, "mlp_bias"),
        (lambda c: c.pop("intermediate_size"), FormatError, "intermediate_size"),
        (lambda c: c.pop("vocab_size"), FormatError, "vocab_size"),
        (lambda c: c.update(num_attention_heads=4.5), FormatError, "num_attention_heads"),
        (lambda c: c.update(num_attention_heads=0), FormatError, "malformed"),
        (lambda c: c.update(rope_theta="abc"), FormatError, "malformed"),
        (lambda c: c.update(rope_parameters=[1]), UnsupportedModel, "rope_parameters"),
    ]
    for edit, cls, words in cases:
        (tmp_path / "config.json").write_text(good)
        _edited(tmp_path, edit)
        with pytest.raises(cls, match=words):
            open_source(tmp_path)
    (tmp_path / "config.json").write_text(f"[{good}]")
    with pytest.raises(FormatError, match="not a JSON object"):
        open_source(tmp_path)
    (tmp_path / "config.json").write_text(good)
    assert open_source(tmp_path).arch.heads == SMALL["num_attention_heads"]
    _edited(tmp_path, lambda c: c.update(eos_token_id="x"), "generation_config.json")
    with pytest.raises(FormatError, match="generation_config.json"):
        open_source(tmp_path)
