"""The multi-token prediction (MTP) block of Qwen3.5 and Qwen3-Next checkpoints: a draft of the token after next
from the main model's hidden state and the next token.

What it computes, as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py (Qwen3NextMultiTokenPredictor.forward) and
llama.cpp's src/models/qwen35.cpp (graph_mtp) both compute it:

    e = embed(token)                       the body's embedding (shared; no MTP embedding of its own)
    x = fc(cat(enorm(e), hnorm(h)))        embedding first, then the hidden state: fc is [dim, 2 dim]
    x = decoder layer(x)                   a full gated-attention layer (Qwen3.5's: q/k norms, partial rotary
                                           positions, the sigmoid gate) and its MLP (dense, or experts as the
                                           body's), with its own KV cache
    logits = head(norm(x))                 the MTP's own final norm, then the body's head (shared)

enorm, hnorm and norm are the family's x * (1 + w) RMS norms (Qwen3_5RMSNorm / GemmaRMSNorm), kept as 1 + w in
float32 like the body's (Recipe.float32). `h` is the main model's hidden state AFTER its final norm: vLLM's
Qwen3NextModel.forward returns norm(h) and its proposer hands those states to the MTP, and llama.cpp's graph
takes t_h_nextn, set after output_norm. A chained draft feeds the MTP's own normed output back as `h`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from superslm.errors import UnsupportedModel
from superslm.kernels.attention import AttnMetadata
from superslm.kernels.dispatch import rms_norm
from superslm.models.arch import Arch
from superslm.models.layers import PartsLayer, _linear
from superslm.models.parts import mtp_arch

if TYPE_CHECKING:
    from superslm.models.transformer import Transformer


class MTP(nn.Module):
    """The MTP block from its canonical weights ("mtp.fc", "mtp.enorm", "mtp.hnorm", "mtp.norm" and
    "mtp.layers.{j}." + a layer's parts): `fc` and the three norms, and `arch.mtp` decoder layers, each a
    `PartsLayer` of a one-layer Arch (parts.mtp_arch) whose attention runs over paged KV like the body's."""

    def __init__(self, arch: Arch, w: Mapping[str, torch.Tensor | None], linear: type[nn.Module]) -> None:
        super().__init__()
        self.arch = arch
        self.fc = linear(w["mtp.fc"])
        for n in ("enorm", "hnorm", "norm"):
            self.register_buffer(n, w[f"mtp.{n}"], persistent=False)

        def layer(j: int) -> PartsLayer:
            p = f"mtp.layers.{j}."
            return PartsLayer(mtp_arch(arch, j), 0, {k[len(p):]: v for k, v in w.items() if k.startswith(p)}, linear)

        self.layers = nn.ModuleList(layer(j) for j in range(arch.mtp))

    def linears(self) -> list[tuple[nn.Module, str, str]]:
        """(parent module, attribute, name within the block) of each linear a weight format may replace:
        "fc", then "layers.{j}." + each decoder layer's own names."""
        out: list[tuple[nn.Module, str, str]] = [(self, "fc", "fc")]
        for j, layer in enumerate(self.layers):
            out += [(parent, attr, f"layers.{j}.{name}") for parent, attr, name in layer.linears()]  # type: ignore[operator]
        return out

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, meta: AttnMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """The MTP's output after its norm [N, dim] (the head's input, and the next chained step's `hidden`).

        hidden [N, dim]: the main model's hidden states after its final norm (or the previous step's output);
        embedded [N, dim]: the embeddings of the tokens that follow them; cos_sin: the rope tables of the rows'
        positions (the body's global rope); k_cache, v_cache [slots, kv_heads, head_dim]: the pages of decoder
        layer `step % arch.mtp` (vLLM's choice of layer for draft step `step`), written at meta.slot_mapping."""
        a = self.arch
        e = rms_norm(embedded, self.enorm, a.norm_eps, a.norm_float)
        h = rms_norm(hidden, self.hnorm, a.norm_eps, a.norm_float)
        x = _linear(self.fc, torch.cat([e, h.to(e.dtype)], dim=1), meta.deterministic)  # [N, 2 dim] -> [N, dim]
        res, y = self.layers[step % len(self.layers)](x, meta, cos_sin, k_cache, v_cache)
        return rms_norm(res + y, self.norm, a.norm_eps, a.norm_float)


def draft(net: Transformer, hidden: torch.Tensor, tokens: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor,
          v_cache: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft logits [N, vocab] float32, the MTP's normed output [N, dim]) of `net`'s MTP block (`net.mtp`).

    Row r drafts the token after `tokens[r]`: `hidden[r]` is the main model's hidden state after its final norm
    (`net.final_norm` of `run_layers`' output) at the position p where `tokens[r]` was predicted, or for a chained
    draft the previous step's output. The row runs at meta.positions[r] through the MTP's own attention layer:
    vLLM's proposer gives the row the position p of that hidden state (the token sits at p + 1), and so the row's
    keys and values belong at the slot of position p in the MTP layer's pages; whoever drives it must keep the
    positions and slots consistent across steps, as for any attention layer.

    KV: the MTP needs one more attention layer's pages per MTP layer (`net.arch.mtp`, 1 in every published
    checkpoint), of the body's KV shape [slots, kv_heads, head_dim] and page layout: e.g. a `cache.kv.KVCache` of
    `net.kv_layers + net.arch.mtp` layers, the last ones the MTP's, passed here as `kv.k[net.kv_layers + j]`.
    `step` picks decoder layer step % arch.mtp (one layer: always it). No recurrent state: the block is attention
    only."""
    mtp = getattr(net, "mtp", None)
    if mtp is None:
        raise UnsupportedModel(f"{net.arch.family}: this model has no MTP layer loaded")
    cos_sin = net.rope_table_list(meta.positions)[0]  # rope key 0: the global rope every attention layer reads
    out = mtp(hidden, net.embed(tokens), meta, cos_sin, k_cache, v_cache, step)
    if not getattr(net, "has_head", False):
        raise UnsupportedModel("the MTP's logits need the model's head (a model loaded with every layer)")
    return _linear(net.head, out, meta.deterministic).float(), out
