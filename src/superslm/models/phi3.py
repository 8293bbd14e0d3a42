"""Phi-3 and Phi-4-mini (HF model_type phi3; GGUF phi3): q/k/v and gate/up stored fused, LongRoPE, an optional
sliding window on every layer and partial rotary dimensions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superslm.models.arch import Arch, gguf_get
from superslm.models.llama import gguf_common, hf_common
from superslm.models.parts import Attention, DenseMLP, LayerParts
from superslm.models.registry import GGUF_LAYER, HF_LAYER, Recipe, register


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    # no attention_bias key: Phi-3's linears have no biases
    return Arch(**hf_common(dict(cfg, attention_bias=False), "phi3"))


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    fields = gguf_common(md, "phi3")
    window = gguf_get(md, "phi3.attention.sliding_window")
    if window:
        fields["windows"] = (int(window),) * fields["layers"]
    return Arch(**fields)


RECIPE = register(
    Recipe(
        family="phi3",
        hf_types=("phi3",),
        gguf_archs=("phi3",),
        arch_from_hf=arch_from_hf,
        arch_from_gguf=arch_from_gguf,
        hf_layer=dict(HF_LAYER, qkv="self_attn.qkv_proj.weight", gate_up="mlp.gate_up_proj.weight"),
        gguf_layer=dict(GGUF_LAYER, qkv="attn_qkv.weight", gate_up="ffn_up.weight"),
        parts=LayerParts(Attention(fused=True), DenseMLP(fused=True)),
    )
)
