"""SmolLM3 (HF model_type smollm3; GGUF smollm3): the Llama layout where every fourth layer has no rotary
positions (NoPE, `no_rope_layers`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from superslm.models.arch import Arch, gguf_get
from superslm.models.llama import gguf_common, hf_common, unpermute_qk, whole
from superslm.models.registry import Recipe, register

#: transformers' SmolLM3Config.default_theta, for configs that name no rope_theta
DEFAULT_THETA = 2_000_000.0


def rope_layers(cfg: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, whether it rotates q and k: `no_rope_layers` (1: rope, 0: none), else a NoPE layer every
    `no_rope_layer_interval` layers (the last of each group), as transformers derives it."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = whole(cfg, "no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must be {layers} flags of 0 or 1, got {flags!r}")
    return tuple(bool(f) for f in flags)


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    params = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and not (isinstance(params, Mapping) and "rope_theta" in params):
        cfg = dict(cfg, rope_theta=DEFAULT_THETA)
    layers = whole(cfg, "num_hidden_layers")
    fields = hf_common(cfg, "smollm3", rope_layers=rope_layers(cfg, layers))
    if not cfg.get("use_sliding_window"):
        fields["windows"] = (None,) * layers  # layer_types may name sliding layers that transformers runs full
    return Arch(**fields)


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    fields = gguf_common(md, "smollm3")
    step = int(gguf_get(md, "smollm3.no_rope_layer_step", 4) or 4)
    fields["rope_layers"] = tuple((i + 1) % step != 0 for i in range(fields["layers"]))
    return Arch(**fields)


RECIPE = register(
    # llama.cpp's converter writes SmolLM3 as Llama: q/k rows permuted (NoPE layers too)
    Recipe(family="smollm3", hf_types=("smollm3",), gguf_archs=("smollm3",), arch_from_hf=arch_from_hf,
           arch_from_gguf=arch_from_gguf, gguf_permutes_qk=True, fix_gguf=unpermute_qk)
)
