"""Gemma 3 (text): local sliding-window layers and global layers with their own rope bases, norms
before and after attention and the MLP, RMS norms of q and k, a scaled embedding,
query_pre_attn_scalar and tanh-GELU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.models.arch import Arch, Rope, check_known, hf_layer_windows, hf_ropes
from superslm.models.llama import gguf_common, hf_common, whole
from superslm.models.registry import HF_LAYER, Recipe, register

HF_REFUSALS = {
    "hidden_activation": ("gelu_pytorch_tanh", None),
    "final_logit_softcapping": (None,),
    "attn_logit_softcapping": (None,),
    "use_bidirectional_attention": (False, None),
}

#: Gemma's norms compute x * (1 + w): HF stores w, GGUF stores 1 + w. We keep 1 + w.
NORMS = ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "k_norm", "norm")


def _windows_from_pattern(layers: int, window: int, pattern: int) -> tuple[int | None, ...]:
    # every `pattern`-th layer is global, the others slide
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    check_known(cfg, HF_REFUSALS)
    cfg = dict(cfg, hidden_act="silu")  # hf_common checks Llama's activation key; Gemma's is checked above
    rope, local = hf_ropes(cfg, local_theta_key="rope_local_base_freq")
    if local is None:
        local = Rope(theta=10000.0)
    layers = whole(cfg, "num_hidden_layers")
    windows = hf_layer_windows(cfg, layers)
    if cfg.get("layer_types") is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        windows = _windows_from_pattern(layers, int(cfg.get("sliding_window") or 4096), pattern)
    dim = whole(cfg, "hidden_size")
    fields = hf_common(
        cfg, "gemma3",
        rope=rope, rope_local=local, windows=windows, qk_norm=True, tied=cfg.get("tie_word_embeddings", True),
        act="gelu_tanh", embed_scale=dim**0.5, post_norms=True, norm_float=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
    )
    return Arch(**fields)


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    layers = int(md["gemma3.block_count"])
    window = int(md.get("gemma3.attention.sliding_window", 4096))
    fields = gguf_common(md, "gemma3")
    dim, heads, head_dim = fields["dim"], fields["heads"], fields["head_dim"]
    # llama.cpp: Gemma 3 27B (62 layers) scales queries by dim/heads, the others by head_dim
    scalar = dim // heads if layers == 62 else head_dim
    fields.update(
        rope_local=Rope(theta=10000.0), windows=_windows_from_pattern(layers, window, 6), qk_norm=True,
        tied=True, act="gelu_tanh", embed_scale=dim**0.5, post_norms=True, norm_float=True,
        attn_scale=float(scalar) ** -0.5,
    )
    return Arch(**fields)


def plus_one(name: str, t: torch.Tensor, arch: Arch) -> torch.Tensor:
    return t + 1.0 if name in NORMS else t


HF_LAYER_GEMMA = dict(
    HF_LAYER,
    post_attn_norm="post_attention_layernorm.weight",
    ffn_norm="pre_feedforward_layernorm.weight",
    post_ffn_norm="post_feedforward_layernorm.weight",
)

RECIPE = register(
    Recipe(
        family="gemma3",
        hf_types=("gemma3_text",),
        gguf_archs=("gemma3",),
        arch_from_hf=arch_from_hf,
        arch_from_gguf=arch_from_gguf,
        hf_layer=HF_LAYER_GEMMA,
        fix_hf=plus_one,
    )
)
