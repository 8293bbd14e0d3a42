"""Qwen3-Next (HF model_type qwen3_next): Qwen3.5's hybrid layers (gated delta rule and gated attention,
x * (1 + w) norms) with a mixture of experts and a shared expert; the delta rule's input projections are
stored fused and grouped by key head (q, k, v, z of each group; b, a of each group), regrouped at load into
Qwen3.5's order (all q, all k, all v, all z; all b, all a)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.models.arch import Arch
from superslm.models.parts import GatedDeltaNet, LayerParts
from superslm.models.qwen3_5 import GGUF_HYBRID, HF_HYBRID, PLUS_ONE, a_log_of, hybrid_fields, hybrid_gguf_fields
from superslm.models.qwen3_5 import fix_hf as qwen3_5_fix
from superslm.models.qwen3_moe import experts_of, sparse_layers
from superslm.models.registry import GGUF_MTP, HF_MTP, Recipe, register


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    fields = hybrid_fields(cfg, "qwen3_next")
    experts = experts_of(cfg, shared=True, norm_default=True)
    return Arch(**fields, experts=experts, moe_layers=sparse_layers(cfg, fields["layers"]))


def regroup(name: str, t: torch.Tensor, a: Arch) -> torch.Tensor:
    """in_qkvz / in_ba rows from key-head groups to Qwen3.5's order; the rest as Qwen3.5 fixes them."""
    d = a.delta
    if d is None or name not in ("in_qkvz", "in_ba"):
        return qwen3_5_fix(name, t, a)
    per = d.v_heads // d.k_heads
    widths = [d.k_dim, d.k_dim, per * d.v_dim, per * d.v_dim] if name == "in_qkvz" else [per, per]
    groups = t.reshape(d.k_heads, sum(widths), t.shape[-1])  # [groups, rows of one group, dim]
    pieces = torch.split(groups, widths, dim=1)
    return torch.cat([p.reshape(-1, t.shape[-1]) for p in pieces])  # each piece's rows, group after group


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    # llama.cpp's qwen3next has experts on every layer
    return Arch(**hybrid_gguf_fields(md, "qwen3_next"))


def fix_gguf(name: str, t: torch.Tensor, a: Arch) -> torch.Tensor:
    """llama.cpp's converter regroups q, k, v and z itself; b and a stay grouped by key head, A is -exp(A_log)."""
    if name == "a_log":
        return a_log_of(t)
    return regroup(name, t, a) if name == "in_ba" else t


RECIPE = register(
    Recipe(family="qwen3_next", hf_types=("qwen3_next",), gguf_archs=("qwen3next",), arch_from_hf=arch_from_hf,
           arch_from_gguf=arch_from_gguf, hf_layer=HF_HYBRID, gguf_layer=GGUF_HYBRID,
           parts=LayerParts(delta=GatedDeltaNet(layout="fused")),
           gguf_parts=LayerParts(delta=GatedDeltaNet(layout="qkv_z_ba")), fix_hf=regroup, fix_gguf=fix_gguf,
           float32=PLUS_ONE, hf_mtp=HF_MTP, gguf_mtp=GGUF_MTP)
)
