"""Qwen3-MoE (HF model_type qwen3_moe): Qwen3's attention (q/k norms per head) with a mixture of experts as the
MLP of every `decoder_sparse_step`-th layer outside `mlp_only_layers` (softmax router, top-k, renormalized
where `norm_topk_prob`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superslm.models.arch import Arch, Experts
from superslm.models.llama import gguf_common, hf_common, whole
from superslm.models.registry import GGUF_LAYER, GGUF_MOE, HF_LAYER, HF_MOE, Recipe, register


def experts_of(cfg: Mapping[str, Any], shared: bool = False, norm_default: bool = False) -> Experts:
    """The Experts of a Qwen MoE config (`shared`: with its shared expert; `norm_default`: whether the top-k
    weights are renormalized when the config says nothing, as the family's transformers config defaults)."""
    count = "num_experts" if "num_experts" in cfg else "num_local_experts"  # transformers 5 writes the latter
    return Experts(count=whole(cfg, count), top_k=whole(cfg, "num_experts_per_tok"),
                   ffn=whole(cfg, "moe_intermediate_size"),
                   norm_top_k=bool(cfg.get("norm_topk_prob", norm_default)),
                   shared_ffn=whole(cfg, "shared_expert_intermediate_size") if shared else 0)


def sparse_layers(cfg: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers have the experts, as transformers builds them: every decoder_sparse_step-th one (1-based)
    that mlp_only_layers does not name."""
    step = whole(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"mlp_only_layers must be a list of layer numbers, got {only!r}")
    return tuple(i not in only and (i + 1) % step == 0 for i in range(layers))


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    fields = hf_common(cfg, "qwen3_moe", qk_norm=True)
    if "intermediate_size" not in cfg:
        fields["ffn"] = whole(cfg, "moe_intermediate_size")
    return Arch(**fields, experts=experts_of(cfg), moe_layers=sparse_layers(cfg, fields["layers"]))


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    from superslm.models.qwen3_5 import gguf_experts

    # llama.cpp's qwen3moe has experts on every layer
    return Arch(**gguf_common(md, "qwen3_moe", qk_norm=True), experts=gguf_experts(md, "qwen3moe"))


RECIPE = register(
    Recipe(family="qwen3_moe", hf_types=("qwen3_moe",), gguf_archs=("qwen3moe",), arch_from_hf=arch_from_hf,
           arch_from_gguf=arch_from_gguf, hf_layer={**HF_LAYER, **HF_MOE}, gguf_layer={**GGUF_LAYER, **GGUF_MOE})
)
