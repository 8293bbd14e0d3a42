"""Qwen3: Llama layout with RMS norms of q and k per head, explicit head_dim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superslm.models.arch import Arch
from superslm.models.llama import gguf_common, hf_common
from superslm.models.registry import Recipe, register


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    return Arch(**hf_common(cfg, "qwen3", qk_norm=True))


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    return Arch(**gguf_common(md, "qwen3", qk_norm=True))


RECIPE = register(
    Recipe(family="qwen3", hf_types=("qwen3",), gguf_archs=("qwen3",),
           arch_from_hf=arch_from_hf, arch_from_gguf=arch_from_gguf)
)
