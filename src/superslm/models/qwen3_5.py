"""Qwen3.5 and Qwen3.5-MoE (HF model_type qwen3_5_text, qwen3_5_moe_text): three layers in four a gated delta
rule (`layer_types` "linear_attention"), the fourth gated attention (a sigmoid gate on each head's output,
q/k norms, rotary positions on a quarter of each head); norms compute x * (1 + w) in float32; the MoE variant
has a shared expert on every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.errors import FormatError, UnsupportedModel
from superslm.models.arch import Arch, DeltaNet, Experts, gguf_get
from superslm.models.llama import gguf_common, hf_common, whole
from superslm.models.qwen3_moe import experts_of
from superslm.models.registry import (
    GGUF_DELTA,
    GGUF_LAYER,
    GGUF_MOE,
    GGUF_MTP,
    HF_DELTA,
    HF_LAYER,
    HF_MOE,
    HF_MTP,
    Recipe,
    register,
)

#: rope_parameters' multimodal keys: text positions are the same on all three axes, so they change nothing
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
#: the norms that compute x * (1 + w) (the delta rule's gated norm multiplies by w itself); enorm and hnorm are the
#: MTP block's norms before its fc (Qwen3_5RMSNorm in vLLM's qwen3_5_mtp.py, as its final norm, "mtp.norm")
PLUS_ONE = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "norm", "enorm", "hnorm")


def mixers(cfg: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's mixer from layer_types, else every full_attention_interval-th layer attention (1-based)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = whole(cfg, "full_attention_interval", 4)
        return tuple("attention" if (i + 1) % every == 0 else "delta" for i in range(layers))
    names = {"linear_attention": "delta", "full_attention": "attention"}
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in names for k in kinds):
        raise ValueError(f"layer_types must be {layers} of {sorted(names)}, got {kinds!r}")
    return tuple(names[k] for k in kinds)


def delta_of(cfg: Mapping[str, Any]) -> DeltaNet:
    return DeltaNet(k_heads=whole(cfg, "linear_num_key_heads"), v_heads=whole(cfg, "linear_num_value_heads"),
                    k_dim=whole(cfg, "linear_key_head_dim"), v_dim=whole(cfg, "linear_value_head_dim"),
                    conv=whole(cfg, "linear_conv_kernel_dim", 4))


def hybrid_fields(cfg: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The Arch fields of a Qwen3.5 / Qwen3-Next text config: gated attention between delta-rule layers."""
    if "text_config" in cfg:
        raise UnsupportedModel(f"{cfg.get('model_type')}: the multimodal checkpoint is not supported yet; "
                               "a text-only (ForCausalLM) folder is")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        cfg = dict(cfg, rope_parameters={k: v for k, v in params.items() if k not in _MROPE_KEYS})
    layers = whole(cfg, "num_hidden_layers")
    kinds = mixers(cfg, layers)
    plain = {k: v for k, v in cfg.items() if k != "layer_types"}  # delta layers are not sliding windows
    if "intermediate_size" not in plain and "moe_intermediate_size" in plain:
        plain["intermediate_size"] = plain["moe_intermediate_size"]  # a MoE config names its experts' width only
    fields = hf_common(plain, family, qk_norm=True, attn_gate=True, norm_float=True)
    fields.update(mixers=kinds, delta=delta_of(cfg))
    return fields


def arch_from_hf(cfg: Mapping[str, Any]) -> Arch:
    moe = cfg.get("model_type") == "qwen3_5_moe_text"
    fields = hybrid_fields(cfg, "qwen3_5_moe" if moe else "qwen3_5")
    if moe:
        # Qwen3.5-MoE always renormalizes its top-k weights (its config has no norm_topk_prob)
        fields["experts"] = experts_of({k: v for k, v in cfg.items() if k != "norm_topk_prob"}, shared=True,
                                       norm_default=True)
    return Arch(**fields)


def fix_hf(name: str, t: torch.Tensor, arch: Arch) -> torch.Tensor:
    """x * (1 + w) norms kept as 1 + w; the convolution's [channels, 1, taps] as [channels, taps]."""
    if name in PLUS_ONE:
        return t + 1.0
    if name == "conv" and t.dim() == 3:
        return t.reshape(t.shape[0], t.shape[2])
    return t


def hybrid_gguf_fields(md: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The Arch fields of a llama.cpp qwen35 / qwen35moe / qwen3next file: its ssm.* keys and recurrent_layers."""
    a = gguf_get(md, "general.architecture", required=True)

    def key(name: str, default: Any = None) -> Any:
        return gguf_get(md, f"{a}.{name}", default, required=default is None)

    fields = gguf_common(md, family, qk_norm=True, attn_gate=True, norm_float=True)
    # llama.cpp counts its MTP ("nextn") blocks in block_count and recurrent_layers, after the body's
    nextn = key("nextn_predict_layers", 0)
    if isinstance(nextn, bool) or not isinstance(nextn, (int, float)) or nextn != int(nextn) \
            or not 0 <= nextn < fields["layers"]:
        raise FormatError(f"{a}: nextn_predict_layers {nextn!r} for {fields['layers']} blocks")
    nextn = int(nextn)
    fields.update(layers=fields["layers"] - nextn, mtp=nextn)
    recurrent = key("attention.recurrent_layers")
    if not isinstance(recurrent, list) or len(recurrent) != fields["layers"] + nextn:
        raise FormatError(f"{a}: attention.recurrent_layers must be {fields['layers'] + nextn} flags, "
                          f"got {recurrent!r}")
    if any(recurrent[fields["layers"]:]):
        raise FormatError(f"{a}: an MTP (nextn) block marked recurrent")
    recurrent = recurrent[: fields["layers"]]
    v_heads = int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if v_heads <= 0 or inner % v_heads:
        raise FormatError(f"{a}: ssm.inner_size {inner} is not a multiple of {v_heads} value heads")
    fields.update(mixers=tuple("delta" if r else "attention" for r in recurrent),
                  delta=DeltaNet(k_heads=int(key("ssm.group_count")), v_heads=v_heads, k_dim=int(key("ssm.state_size")),
                                 v_dim=inner // v_heads, conv=int(key("ssm.conv_kernel"))))
    if gguf_get(md, f"{a}.expert_count") is not None:
        fields["experts"] = gguf_experts(md, a)
    return fields


def gguf_experts(md: Mapping[str, Any], a: str) -> Experts:
    """llama.cpp's expert keys; its Qwen MoE graphs renormalize the top-k weights (expert_weights_norm may say)."""
    shared = gguf_get(md, f"{a}.expert_shared_feed_forward_length", 0) or 0
    return Experts(count=int(gguf_get(md, f"{a}.expert_count", required=True)),
                   top_k=int(gguf_get(md, f"{a}.expert_used_count", required=True)),
                   ffn=int(gguf_get(md, f"{a}.expert_feed_forward_length", required=True)),
                   norm_top_k=bool(gguf_get(md, f"{a}.expert_weights_norm", True)), shared_ffn=int(shared))


def arch_from_gguf(md: Mapping[str, Any]) -> Arch:
    moe = gguf_get(md, "general.architecture") == "qwen35moe"
    return Arch(**hybrid_gguf_fields(md, "qwen3_5_moe" if moe else "qwen3_5"))


def a_log_of(t: torch.Tensor) -> torch.Tensor:
    """llama.cpp stores A = -exp(A_log) (ssm_a): A_log back, in float64 so the round trip loses nothing in fp32."""
    return torch.log(-t.double()).float()


def untile(t: torch.Tensor, dim: int, k_heads: int, per: int, width: int) -> torch.Tensor:
    """Undo llama.cpp's value-head order along `dim`: its files tile the heads (j * k_heads + g) where the
    checkpoint groups them by key head (g * per + j); `width` rows or columns per head."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per, k_heads, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)  # [per, k_heads] -> [k_heads, per]


def fix_gguf(name: str, t: torch.Tensor, arch: Arch) -> torch.Tensor:
    """A_log from ssm_a, and value heads back in the checkpoint's order (norms are stored as 1 + w already)."""
    d = arch.delta
    if name == "a_log":
        t = a_log_of(t)
    if d is None or d.k_heads == d.v_heads:
        return t
    per, keys = d.v_heads // d.k_heads, 2 * d.key_width
    if name in ("in_qkv", "conv"):
        return torch.cat([t[:keys], untile(t[keys:], 0, d.k_heads, per, d.v_dim)])
    if name == "in_z":
        return untile(t, 0, d.k_heads, per, d.v_dim)
    if name in ("in_b", "in_a"):
        return untile(t, 0, d.k_heads, per, 1)
    if name in ("a_log", "dt_bias"):
        return untile(t[:, None], 0, d.k_heads, per, 1)[:, 0]
    if name == "out":
        return untile(t, 1, d.k_heads, per, d.v_dim)
    return t


HF_HYBRID = {**HF_LAYER, **HF_DELTA, **HF_MOE}
GGUF_HYBRID = {**GGUF_LAYER, **GGUF_DELTA, **GGUF_MOE}

RECIPE = register(
    Recipe(family="qwen3_5", hf_types=("qwen3_5_text", "qwen3_5_moe_text"), gguf_archs=("qwen35", "qwen35moe"),
           arch_from_hf=arch_from_hf, arch_from_gguf=arch_from_gguf, hf_layer=HF_HYBRID, gguf_layer=GGUF_HYBRID,
           fix_hf=fix_hf, fix_gguf=fix_gguf, float32=PLUS_ONE, hf_mtp=HF_MTP, gguf_mtp=GGUF_MTP)
)
