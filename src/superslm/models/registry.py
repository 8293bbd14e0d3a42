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

#: HF names of gated delta-rule layers (Qwen3.5: split; Qwen3-Next: in_qkvz and in_ba fused) and of a mixture
#: of experts (each expert's tensors stacked, or transformers' own stacked tensors: loader._stored's specs)
HF_DELTA = {
    "in_qkv": "linear_attn.in_proj_qkv.weight", "in_z": "linear_attn.in_proj_z.weight",
    "in_b": "linear_attn.in_proj_b.weight", "in_a": "linear_attn.in_proj_a.weight",
    "in_qkvz": "linear_attn.in_proj_qkvz.weight", "in_ba": "linear_attn.in_proj_ba.weight",
    "conv": "linear_attn.conv1d.weight", "dt_bias": "linear_attn.dt_bias", "a_log": "linear_attn.A_log",
    "delta_norm": "linear_attn.norm.weight", "out": "linear_attn.out_proj.weight",
}
HF_MOE: dict[str, Any] = {
    "router": "mlp.gate.weight",
    "experts_gate_up": ["mlp.experts.gate_up_proj",
                        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")],
    "experts_down": ["mlp.experts.down_proj", "mlp.experts.{e}.down_proj.weight"],
    "shared_gate": "mlp.shared_expert.gate_proj.weight", "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight", "shared_scale": "mlp.shared_expert_gate.weight",
}

#: llama.cpp's names of the same tensors (its pre-MLP norm of hybrid layers is post_attention_norm)
GGUF_DELTA = {
    "in_qkv": "attn_qkv.weight", "in_z": "attn_gate.weight", "in_b": "ssm_beta.weight", "in_a": "ssm_alpha.weight",
    "in_ba": "ssm_ba.weight", "conv": "ssm_conv1d.weight", "dt_bias": "ssm_dt.bias", "a_log": "ssm_a",
    "delta_norm": "ssm_norm.weight", "out": "ssm_out.weight", "ffn_norm": "post_attention_norm.weight",
}
GGUF_MOE: dict[str, Any] = {
    "router": "ffn_gate_inp.weight", "experts_gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "experts_down": "ffn_down_exps.weight", "shared_gate": "ffn_gate_shexp.weight", "shared_up": "ffn_up_shexp.weight",
    "shared_down": "ffn_down_shexp.weight", "shared_scale": "ffn_gate_inp_shexp.weight",
}

#: the MTP block's own tensors (parts.MTP_TENSORS): Qwen3.5 / Qwen3-Next checkpoints keep them under "mtp." (vLLM's
#: qwen3_next_mtp.py / qwen3_5_mtp.py load the same names: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm), its
#: decoder layers under "mtp.layers.{j}."; llama.cpp's converter (conversion/qwen.py _QwenMtpMixin) writes them as
#: block N (= the body's layers) "nextn" tensors, its layers as blocks N + j with the body's tensor names
HF_MTP = {"fc": "mtp.fc.weight", "enorm": "mtp.pre_fc_norm_embedding.weight",
          "hnorm": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
GGUF_MTP = {"fc": "nextn.eh_proj.weight", "enorm": "nextn.enorm.weight", "hnorm": "nextn.hnorm.weight",
            "norm": "nextn.shared_head_norm.weight"}

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
    #: canonical name -> the tensor's name in a layer (or a loader._stored spec: stacked experts, alternatives)
    hf_layer: Mapping[str, Any] = field(default_factory=lambda: HF_LAYER)
    gguf_layer: Mapping[str, Any] = field(default_factory=lambda: GGUF_LAYER)
    #: what each layer is made of, and whether the checkpoint fuses q/k/v and gate/up
    parts: LayerParts = field(default_factory=LayerParts)
    #: the same, where a GGUF file stores them otherwise (None: as `parts`)
    gguf_parts: LayerParts | None = None
    #: HF folders may nest the text model (e.g. Gemma 3 multimodal: language_model.)
    hf_prefixes: tuple[str, ...] = ("",)
    #: row permutation of q/k written by llama.cpp's converter (undone at load)
    gguf_permutes_qk: bool = False
    fix_hf: Fix = _keep
    fix_gguf: Fix = _keep
    #: tensors (short names) kept in float32 whatever the compute dtype: x * (1 + w) norms, whose 1 + w in
    #: bf16 would scale every channel off by up to 2**-8 where the checkpoint computes it in float32
    float32: tuple[str, ...] = ()
    #: where the family's multi-token prediction block is (HF_MTP, GGUF_MTP); empty: the family has none
    hf_mtp: Mapping[str, str] = field(default_factory=dict)
    gguf_mtp: Mapping[str, str] = field(default_factory=dict)

    def parts_for(self, hf: bool) -> LayerParts:
        """The layers' parts as a HF folder (hf) or a GGUF file stores them."""
        return self.parts if hf or self.gguf_parts is None else self.gguf_parts

    def layer_names(self, hf: bool) -> Mapping[str, Any]:
        return self.hf_layer if hf else self.gguf_layer

    def global_names(self, hf: bool) -> Mapping[str, str]:
        return self.hf_global if hf else GGUF_GLOBAL

    def mtp_names(self, hf: bool) -> Mapping[str, str]:
        return self.hf_mtp if hf else self.gguf_mtp


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
    from superslm.models import gemma3, llama, phi3, qwen2, qwen3, qwen3_5, qwen3_moe, qwen3_next, smollm3  # noqa: F401


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
