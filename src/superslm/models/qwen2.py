"""Qwen2 / Qwen2.5: Llama layout with biases on q, k and v (none on o)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superslm.models.arch import Arch
from superslm.models.llama import gguf_common, hf_common
from superslm.models.registry import Recipe, register


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    fields = hf_common(cfg, "qwen2", qkv_bias=True, o_bias=False)
    return Arch(**fields)


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    return Arch(**gguf_common(md, "qwen2", qkv_bias=True))


RECIPE = register(
    Recipe(family="qwen2", hf_types=("qwen2",), gguf_archs=("qwen2",),
           arch_from_hf=arch_from_hf, arch_from_gguf=arch_from_gguf)
)
