"""Recipes by name: a family is found by HF `model_type` or GGUF `general.architecture`.

A recipe reads its config into an Arch, declares its layers' parts (models/parts.py: which tensors, fused
or split) and names its tensors for both sources. Canonical names (what the forward pass reads) are: embed,
norm, head, and per layer `layers.{i}.` + the parts' names (attn_norm, q, k, v or qkv, o, their biases,
q_norm, k_norm, post_attn_norm, ffn_norm, gate, up or gate_up, down, post_ffn_norm).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from superslm.errors import UnsupportedModel
from superslm.models.arch import Arch
from superslm.models.parts import LayerParts

#: GGUF tensor names as llama.cpp writes them, the same for every family we run
GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight"}
GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
    "o": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "o_bias": "attn_output.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}

#: HF names of Llama-like models; post_attention_layernorm is the pre-MLP norm there
HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "ffn_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}

#: a transform of one loaded tensor: (canonical name, tensor, arch) -> tensor
Fix = Callable[[str, torch.Tensor, Arch], torch.Tensor]


def _keep(name: str, t: torch.Tensor, arch: Arch) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Recipe:
    """One model family: how to read its Arch and where its tensors are."""

    family: str
    hf_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    arch_from_hf: Callable[[Mapping[str, Any]], Arch]
    arch_from_gguf: Callable[[Mapping[str, Any]], Arch]
    hf_global: Mapping[str, str] = field(default_factory=lambda: HF_GLOBAL)
    hf_layer: Mapping[str, str] = field(default_factory=lambda: HF_LAYER)
    gguf_layer: Mapping[str, str] = field(default_factory=lambda: GGUF_LAYER)
    #: what each layer is made of, and whether the checkpoint fuses q/k/v and gate/up
    parts: LayerParts = field(default_factory=LayerParts)
    #: HF folders may nest the text model (e.g. Gemma 3 multimodal: language_model.)
    hf_prefixes: tuple[str, ...] = ("",)
    #: row permutation of q/k written by llama.cpp's converter (undone at load)
    gguf_permutes_qk: bool = False
    fix_hf: Fix = _keep
    fix_gguf: Fix = _keep

    def layer_names(self, hf: bool) -> Mapping[str, str]:
        return self.hf_layer if hf else self.gguf_layer

    def global_names(self, hf: bool) -> Mapping[str, str]:
        return self.hf_global if hf else GGUF_GLOBAL


_BY_HF: dict[str, Recipe] = {}
_BY_GGUF: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    for t in recipe.hf_types:
        _BY_HF[t] = recipe
    for a in recipe.gguf_archs:
        _BY_GGUF[a] = recipe
    return recipe


def _load_all() -> None:
    # Importing the family modules registers them; kept lazy to avoid an import cycle.
    from superslm.models import gemma3, llama, phi3, qwen2, qwen3, smollm3  # noqa: F401


def recipe_for_hf(config: Mapping[str, Any]) -> Recipe:
    """The recipe of a config.json, by model_type (refused, naming it, when unknown)."""
    _load_all()
    model_type = config.get("model_type")
    if model_type not in _BY_HF:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (known: {sorted(_BY_HF)})")
    return _BY_HF[model_type]


def recipe_for_gguf(metadata: Mapping[str, Any]) -> Recipe:
    """The recipe of a GGUF file, by general.architecture."""
    _load_all()
    arch = metadata.get("general.architecture")
    if arch not in _BY_GGUF:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (known: {sorted(_BY_GGUF)})")
    return _BY_GGUF[arch]
