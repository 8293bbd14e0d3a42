"""A layer's parts: its mixer (`Attention`) and its MLP (`DenseMLP`), each naming its tensors.

A recipe declares the parts of its layers and how its checkpoint stores them: Llama keeps q, k, v and
gate, up as separate tensors, Phi-3 fuses them (`qkv_proj`, `gate_up_proj`). Each part lists its linears
(`LinearSpec`: the module name the forward pass calls, and the canonical tensors whose rows it stacks),
its norms and every tensor's shape, so the loader, the quantizers and the forward pass read one
declaration instead of a list of names each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
    output projection, RMS norms of q and k per head where the Arch says so."""

    fused: bool = False

    def linears(self, a: Arch) -> tuple[LinearSpec, LinearSpec]:
        pieces = ("qkv",) if self.fused else ("q", "k", "v")
        bias = () if not a.qkv_bias else ("qkv_bias",) if self.fused else ("q_bias", "k_bias", "v_bias")
        return LinearSpec("qkv", pieces, bias), LinearSpec("o", ("o",), ("o_bias",) if a.o_bias else ())

    def norms(self, a: Arch) -> tuple[str, ...]:
        return ("attn_norm", "q_norm", "k_norm") if a.qk_norm else ("attn_norm",)

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        return {"q": (q, a.dim), "k": (kv, a.dim), "v": (kv, a.dim), "qkv": (q + 2 * kv, a.dim), "o": (a.dim, q),
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


#: Gemma's sandwich norms, after attention and after the MLP (Arch.post_norms)
POST_NORMS = ("post_attn_norm", "post_ffn_norm")
#: every canonical name a linear's weight or a layer's norm may have, split or fused
PIECES = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")
NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", *POST_NORMS)


@dataclass(frozen=True)
class LayerParts:
    """What every layer of a family is made of."""

    mixer: Attention = Attention()
    mlp: DenseMLP = DenseMLP()

    def linears(self, a: Arch) -> dict[str, LinearSpec]:
        """{module name: its spec} in LINEAR_NAMES order."""
        return {s.name: s for s in (*self.mixer.linears(a), *self.mlp.linears(a))}

    def norms(self, a: Arch) -> tuple[str, ...]:
        return (*self.mixer.norms(a), *self.mlp.norms(a), *(POST_NORMS if a.post_norms else ()))

    def tensors(self, a: Arch) -> tuple[str, ...]:
        """Every canonical tensor of one layer the checkpoint must hold."""
        specs = self.linears(a).values()
        return (*self.norms(a), *(p for s in specs for p in (*s.pieces, *s.bias)))

    def shapes(self, a: Arch) -> dict[str, tuple[int, ...]]:
        out = {**self.mixer.shapes(a), **self.mlp.shapes(a)}
        out.update({n: (a.dim,) for n in POST_NORMS})
        return out


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
