"""Llama family: Llama 2/3.x, SmolLM, Mistral (HF model_type llama/mistral; GGUF llama)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.models.arch import Arch, Rope, check_known, eos_tuple, gguf_get, hf_layer_windows, hf_ropes
from superslm.models.registry import Recipe, register

#: options that must hold these values for our forward pass to compute what the model does
HF_REFUSALS = {
    "hidden_act": ("silu", None),
    "pretraining_tp": (1, None),
    # biases on gate/up/down: the forward pass has none (the tensors would be dropped silently)
    "mlp_bias": (False, None),
}


def whole(cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    """cfg[key] as an int: a JSON integer, or a float with no fraction (4.0); 4.5 or "4" are malformed."""
    value = cfg[key] if default is None else (cfg.get(key) or default)
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"{key} must be a whole number, got {value!r}")
    return int(value)


def hf_common(cfg: Mapping[str, Any], family: str, **extra: Any) -> dict[str, Any]:
    """The Arch fields every Llama-like config spells the same way."""
    check_known(cfg, HF_REFUSALS)
    heads = whole(cfg, "num_attention_heads")
    dim = whole(cfg, "hidden_size")
    head_dim = whole(cfg, "head_dim", dim // heads)
    layers = whole(cfg, "num_hidden_layers")
    rope, local = hf_ropes(cfg)
    params = cfg.get("rope_parameters")
    partial = cfg.get("partial_rotary_factor")
    if partial is None and isinstance(params, Mapping):  # transformers 5 writes it into rope_parameters
        partial = params.get("partial_rotary_factor")
    rotary = int(head_dim * float(partial or 1.0))
    windows = hf_layer_windows(cfg, layers, max_window_layers=family in ("qwen2", "qwen3"))
    if cfg.get("layer_types") is None and cfg.get("sliding_window") and family in ("mistral", "phi3"):
        windows = (int(cfg["sliding_window"]),) * layers
    fields: dict[str, Any] = dict(
        family=family,
        vocab=whole(cfg, "vocab_size"),
        dim=dim,
        ffn=whole(cfg, "intermediate_size"),
        layers=layers,
        heads=heads,
        kv_heads=whole(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        rotary_dim=rotary,
        rope=rope,
        rope_local=local,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        windows=windows,
        context=whole(cfg, "max_position_embeddings", 2048),
        bos_id=cfg.get("bos_token_id"),
        eos_ids=eos_tuple(cfg.get("eos_token_id")),
    )
    fields.update(extra)
    return fields


def gguf_common(md: Mapping[str, Any], family: str, **extra: Any) -> dict[str, Any]:
    """The Arch fields llama.cpp writes the same way for every family."""
    a = gguf_get(md, "general.architecture", required=True)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        return gguf_get(md, f"{a}.{name}", default, required)

    heads = int(key("attention.head_count", required=True))
    dim = int(key("embedding_length", required=True))
    if heads <= 0 or key("attention.key_length") is None and dim % heads:
        from superslm.errors import FormatError

        raise FormatError(f"{a}: embedding length {dim} is not a multiple of {heads} heads (and no key length)")
    head_dim = int(key("attention.key_length", dim // heads))
    value_dim = int(key("attention.value_length", head_dim))
    if value_dim != head_dim:
        from superslm.errors import UnsupportedModel

        raise UnsupportedModel(f"{a}: value length {value_dim} differs from key length {head_dim}")
    kv = key("attention.head_count_kv", heads)
    if isinstance(kv, list):
        from superslm.errors import UnsupportedModel

        raise UnsupportedModel(f"{a}: per-layer kv head counts are not supported")
    vocab = key("vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    theta = float(key("rope.freq_base", 10000.0))
    scaling = key("rope.scaling.type", "none")
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if scaling in ("none", None) or factor == 1.0:
        rope = Rope(theta=theta)
    elif scaling == "linear":
        rope = Rope(theta=theta, kind="linear", factor=factor)
    elif scaling == "yarn":
        rope = Rope(
            theta=theta, kind="yarn", factor=factor,
            original_context=int(key("rope.scaling.original_context_length", 0) or 0),
        )
    else:
        from superslm.errors import UnsupportedModel

        raise UnsupportedModel(f"{a}: rope scaling type {scaling!r} is not supported")
    eos = md.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        family=family,
        vocab=int(vocab),
        dim=dim,
        # a model with experts on every layer (llama.cpp's Qwen3.5-MoE files) has no dense FFN size
        ffn=int(key("feed_forward_length") or key("expert_feed_forward_length", required=True)),
        layers=int(key("block_count", required=True)),
        heads=heads,
        kv_heads=int(kv),
        head_dim=head_dim,
        rotary_dim=int(key("rope.dimension_count", head_dim)),
        rope=rope,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        context=int(key("context_length", 2048)),
        bos_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_ids=eos_tuple(eos),
    )
    fields.update(extra)
    return fields


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    family = "mistral" if cfg.get("model_type") == "mistral" else "llama"
    return Arch(**hf_common(cfg, family))


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    # tied: decided by the loader (no output.weight in the file), biases likewise
    return Arch(**gguf_common(md, "llama"))


def unpermute_qk(name: str, t: torch.Tensor, arch: Arch) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k (interleaved rope pairs -> NeoX halves)."""
    if name not in ("q", "k", "q_bias", "k_bias"):
        return t
    heads = arch.heads if name.startswith("q") else arch.kv_heads
    rows = t.shape[0]
    # [heads, 2, half, ...] was written as [heads, half, 2, ...]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


RECIPE = register(
    Recipe(
        family="llama",
        hf_types=("llama", "mistral"),
        gguf_archs=("llama",),
        arch_from_hf=arch_from_hf,
        arch_from_gguf=arch_from_gguf,
        gguf_permutes_qk=True,
        fix_gguf=unpermute_qk,
    )
)
