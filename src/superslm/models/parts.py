"""A layer's parts: its mixer (`Attention` or `GatedDeltaNet`) and its MLP (`DenseMLP` or `MoE`), each naming
its tensors.

A recipe declares the parts of its layers and how its checkpoint stores them: Llama keeps q, k, v and
gate, up as separate tensors, Phi-3 fuses them (`qkv_proj`, `gate_up_proj`). Each part lists its linears
(`LinearSpec`: the module name the forward pass calls, and the canonical tensors whose rows it stacks),
its norms and every tensor's shape, so the loader, the quantizers and the forward pass read one
declaration instead of a list of names each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from superslm.models.arch import Arch

#: the linear modules of every layer, in the order the C++ plan and the converters walk them
LINEAR_NAMES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LinearSpec:
    """One linear of a part: `name` is the layer's module; its weight stacks `pieces` along the output rows
    (one piece where the checkpoint stores it fused) and its bias stacks `bias` (none when empty)."""

    name: str
    pieces: tuple[str, ...]
    bias: tuple[str, ...] = ()


@dataclass(frozen=True)
class Attention:
    """Self-attention over the paged KV cache: q, k, v in one linear (fused or split in the checkpoint), the
    output projection, RMS norms of q and k per head where the Arch says so. With `Arch.attn_gate`, q's rows hold
    each head's query and then its output gate (the attention's output times sigmoid(gate) before o)."""

    fused: bool = False

    def linears(self, a: Arch) -> tuple[LinearSpec, LinearSpec]:
        pieces = ("qkv",) if self.fused else ("q", "k", "v")
        bias = () if not a.qkv_bias else ("qkv_bias",) if self.fused else ("q_bias", "k_bias", "v_bias")
        return LinearSpec("qkv", pieces, bias), LinearSpec("o", ("o",), ("o_bias",) if a.o_bias else ())

    def norms(self, a: Arch) -> tuple[str, ...]:
        return ("attn_norm", "q_norm", "k_norm") if a.qk_norm else ("attn_norm",)

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        gated = 2 * q if a.attn_gate else q  # each head's query, then its output gate
        return {"q": (gated, a.dim), "k": (kv, a.dim), "v": (kv, a.dim), "qkv": (q + 2 * kv, a.dim), "o": (a.dim, q),
                "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "qkv_bias": (q + 2 * kv,), "o_bias": (a.dim,),
                "attn_norm": (a.dim,), "q_norm": (a.head_dim,), "k_norm": (a.head_dim,)}  # fmt: skip


@dataclass(frozen=True)
class DenseMLP:
    """act(gate) * up, then down: gate and up in one linear (fused or split in the checkpoint, gate first)."""

    fused: bool = False

    def linears(self, a: Arch) -> tuple[LinearSpec, LinearSpec]:
        return LinearSpec("gate_up", ("gate_up",) if self.fused else ("gate", "up")), LinearSpec("down", ("down",))

    def norms(self, a: Arch) -> tuple[str, ...]:
        return ("ffn_norm",)

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        return {"gate": (a.ffn, a.dim), "up": (a.ffn, a.dim), "gate_up": (2 * a.ffn, a.dim), "down": (a.dim, a.ffn),
                "ffn_norm": (a.dim,)}  # fmt: skip


#: the input projection's tensors of a delta-rule layer, by how a checkpoint stores them; stacked in this order
#: they give the rows q, k, v, z, b, a (`in_ba` regrouped at load as [all b, all a])
DELTA_LAYOUTS = {"split": ("in_qkv", "in_z", "in_b", "in_a"), "fused": ("in_qkvz", "in_ba"),
                 "qkv_z_ba": ("in_qkv", "in_z", "in_ba")}


@dataclass(frozen=True)
class GatedDeltaNet:
    """A gated delta-rule layer: one input projection (q, k, v for the convolution, then z, b and a; Qwen3-Next
    stores them as two fused tensors grouped by key head, which its recipe regroups at load), the causal
    depthwise convolution (`conv`: [channels, taps]), the decay's `dt_bias` and `a_log`, the gated RMS norm of
    each value head (`delta_norm`) and the output projection (kernels/delta_rule.py computes it). `layout`: how
    the checkpoint stores the input projection, a key of DELTA_LAYOUTS (llama.cpp's Qwen3-Next files keep b and
    a fused, q, k, v and z apart)."""

    layout: str = "split"

    def linears(self, a: Arch) -> tuple[LinearSpec, LinearSpec]:
        return LinearSpec("in_proj", DELTA_LAYOUTS[self.layout]), LinearSpec("out", ("out",))

    def norms(self, a: Arch) -> tuple[str, ...]:
        return ("attn_norm", "delta_norm")

    def tensors(self, a: Arch) -> tuple[str, ...]:
        """Its tensors that are neither a linear's nor a norm."""
        return ("conv", "dt_bias", "a_log")

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        d = a.delta
        assert d is not None
        c, v, h = d.conv_width, d.value_width, d.v_heads
        return {"in_qkv": (c, a.dim), "in_z": (v, a.dim), "in_b": (h, a.dim), "in_a": (h, a.dim),
                "in_qkvz": (c + v, a.dim), "in_ba": (2 * h, a.dim), "out": (a.dim, v), "conv": (c, d.conv),
                "dt_bias": (h,), "a_log": (h,), "attn_norm": (a.dim,), "delta_norm": (d.v_dim,)}  # fmt: skip


@dataclass(frozen=True)
class MoE:
    """A mixture of experts: the router (`router`: [experts, dim]), every expert's gate and up rows stacked
    (`experts_gate_up`: [experts, 2 ffn, dim]) and its down projection (`experts_down`: [experts, dim, ffn]);
    where the Arch says so, a shared expert (`shared_gate_up`, `shared_down`) scaled by sigmoid(`shared_scale` x)."""

    def linears(self, a: Arch) -> tuple[LinearSpec, ...]:
        e = a.experts
        assert e is not None
        if not e.shared_ffn:
            return ()
        return LinearSpec("shared_gate_up", ("shared_gate", "shared_up")), LinearSpec("shared_down", ("shared_down",))

    def norms(self, a: Arch) -> tuple[str, ...]:
        return ("ffn_norm",)

    def tensors(self, a: Arch) -> tuple[str, ...]:
        e = a.experts
        assert e is not None
        return ("router", "experts_gate_up", "experts_down", *(("shared_scale",) if e.shared_ffn else ()))

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        e = a.experts
        assert e is not None
        return {"router": (e.count, a.dim), "experts_gate_up": (e.count, 2 * e.ffn, a.dim),
                "experts_down": (e.count, a.dim, e.ffn), "shared_gate": (e.shared_ffn, a.dim),
                "shared_up": (e.shared_ffn, a.dim), "shared_down": (a.dim, e.shared_ffn), "shared_scale": (1, a.dim),
                "ffn_norm": (a.dim,)}  # fmt: skip


#: Gemma's sandwich norms, after attention and after the MLP (Arch.post_norms)
POST_NORMS = ("post_attn_norm", "post_ffn_norm")
#: every canonical name a linear's weight or a layer's norm may have, split or fused
PIECES = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", *POST_NORMS)


Mixer = Attention | GatedDeltaNet
MLP = DenseMLP | MoE


@dataclass(frozen=True)
class LayerParts:
    """What the layers of a family are made of: layer i's mixer is `mixer` or, where `Arch.mixers` says "delta",
    `delta`; its MLP is `mlp` or, where `Arch.moe_layers` says so, `moe`."""

    mixer: Attention = Attention()
    mlp: DenseMLP = DenseMLP()
    delta: GatedDeltaNet = GatedDeltaNet()
    moe: MoE = MoE()

    def of_layer(self, a: Arch, i: int = 0) -> tuple[Mixer, MLP]:
        """Layer i's (mixer, MLP)."""
        mixer = self.delta if a.mixers[i] == "delta" else self.mixer
        return mixer, self.moe if a.moe_layers[i] else self.mlp

    def plain(self, a: Arch) -> bool:
        """Whether every layer is attention and a dense MLP (the layers the fused paths and the C++ plan run)."""
        return not a.hybrid and not any(a.moe_layers)

    def linears(self, a: Arch, i: int = 0) -> dict[str, LinearSpec]:
        """{module name: its spec} of layer i, mixer first (LINEAR_NAMES order for plain layers)."""
        mixer, mlp = self.of_layer(a, i)
        return {s.name: s for s in (*mixer.linears(a), *mlp.linears(a))}

    def norms(self, a: Arch, i: int = 0) -> tuple[str, ...]:
        mixer, mlp = self.of_layer(a, i)
        return (*mixer.norms(a), *mlp.norms(a), *(POST_NORMS if a.post_norms else ()))

    def tensors(self, a: Arch, i: int = 0) -> tuple[str, ...]:
        """Every canonical tensor of layer i the checkpoint must hold."""
        specs = self.linears(a, i).values()
        mixer, mlp = self.of_layer(a, i)
        extra = tuple(n for part in (mixer, mlp) for n in getattr(part, "tensors", lambda a: ())(a))
        return (*self.norms(a, i), *(p for s in specs for p in (*s.pieces, *s.bias)), *extra)

    def shapes(self, a: Arch, i: int = 0) -> dict[str, tuple[int, ...]]:
        mixer, mlp = self.of_layer(a, i)
        out = {**mixer.shapes(a), **mlp.shapes(a)}
        out.update({n: (a.dim,) for n in POST_NORMS})
        return out


#: the multi-token prediction block's own tensors beside its decoder layers (models/mtp.py): `fc` [dim, 2 dim]
#: over the normed embedding and the normed hidden state side by side, the two norms before it (`enorm` of the
#: embedding, `hnorm` of the hidden state) and the norm before the shared head (`norm`); canonical names
#: "mtp." + these, and "mtp.layers.{j}." + a layer's parts for its decoder layers
MTP_TENSORS = ("fc", "enorm", "hnorm", "norm")


def mtp_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    """The shapes of MTP_TENSORS."""
    return {"fc": (a.dim, 2 * a.dim), "enorm": (a.dim,), "hnorm": (a.dim,), "norm": (a.dim,)}


def mtp_arch(a: Arch, j: int) -> Arch:
    """MTP layer j as a one-layer Arch whose layer 0 is it: full attention (no window, rotary positions), and the
    MLP vLLM builds for it (Qwen3NextDecoderLayer / Qwen3_5DecoderLayer with the layer index j of the MTP stack:
    experts where `moe_layers[j]` has them). Its parts, shapes and PartsLayer come from this Arch."""
    moe = bool(a.moe_layers[min(j, a.layers - 1)]) and a.experts is not None
    return replace(a, layers=1, mixers=("attention",), windows=(None,), rope_layers=(True,), moe_layers=(moe,),
                   mtp=0)


def stack(w: Mapping[str, torch.Tensor | None], names: tuple[str, ...]) -> torch.Tensor:
    """The tensors `names` of `w` stacked along their first dimension (one name: the tensor itself)."""
    return w[names[0]] if len(names) == 1 else torch.cat([w[k] for k in names])  # type: ignore[misc, return-value]


def stacked(w: Mapping[str, torch.Tensor | None], name: str, a: Arch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of linear `name` from a layer's canonical tensors `w`, as the fused layout names
    them where `w` holds those pieces, else the split one (the forward pass runs each linear as one matmul)."""
    for fused in (True, False):
        spec = LayerParts(Attention(fused), DenseMLP(fused)).linears(a)[name]
        if all(w.get(k) is not None for k in spec.pieces):
            break
    return stack(w, spec.pieces), (stack(w, spec.bias) if spec.bias else None)
