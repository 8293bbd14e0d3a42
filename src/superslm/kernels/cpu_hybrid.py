"""Parts layers in the C++ decode plan: how one is described to it, and its torch twin.

A parts layer (models/layers.py PartsLayer: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE) is a mixer (gated
attention, or a gated delta rule over the sequences' recurrent states) and an MLP (dense, or a mixture of experts).
Layer by layer in Python a decode step spent ~40% of its time between the weight kernels (norms, the attention's
gather and SDPA, the delta rule's small ops). `describe` hands such a layer to the plan (kernels/cpu/
decode_layers.cpp, its pieces in parts_layer.h): the mixer's two linears and the dense MLP's in the plan's linear
slots, then its kind (`set_kind`) and, for a mixture of experts, the block's own C++ step (kernels/moe_step.py
MoEStep, `set_moe`). `layer_reference` is the twin `cpu_decode.decode_layers_reference` runs for such a layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from superslm.cache.kv import read_rows
from superslm.kernels import delta_rule
from superslm.kernels.attention import store_kv
from superslm.kernels.fused import gated_act
from superslm.kernels.norm import rms_norm
from superslm.kernels.rope import apply_rope

#: parts_layer.h LayerKind
ATTENTION, DELTA = 1, 2


def is_parts(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a parts layer (PartsLayer.plain is False) rather than transformer.Layer."""
    return getattr(layer, "plain", True) is False


def _is_delta(mixer: torch.nn.Module) -> bool:
    return "in_proj" in mixer._modules


def _is_moe(mlp: torch.nn.Module) -> bool:
    return "router" in mlp._modules


def linears(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, ...]:
    """A parts layer's linears in the plan's four slots: the mixer's (qkv and o, or a delta rule's in_proj and out),
    then the dense MLP's gate_up and down (None, None where a mixture of experts is the MLP)."""
    mixer, mlp = layer._modules["mixer"], layer._modules["mlp"]
    first, second = ("in_proj", "out") if _is_delta(mixer) else ("qkv", "o")
    mods = mixer._modules
    if _is_moe(mlp):
        return mods[first], mods[second], None, None
    return mods[first], mods[second], mlp._modules["gate_up"], mlp._modules["down"]


def norms(layer: torch.nn.Module) -> list[torch.Tensor | None]:
    """attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffn_norm of a parts layer (None: absent)."""
    mixer = layer._modules["mixer"]
    q, k = (getattr(mixer, "q_norm", None), getattr(mixer, "k_norm", None)) if not _is_delta(mixer) else (None, None)
    return [layer.attn_norm, layer.ffn_norm, q, k, None, None]


def module_key(layer: torch.nn.Module) -> list[int]:
    """What a swap of a parts layer's linears changes (cpu_decode.plan_for rebuilds the plan when it does): its
    mixer's and MLP's modules, and a mixture of experts' parts (MoE.moe_parts rebuilds them on a swap)."""
    mixer, mlp = layer._modules["mixer"], layer._modules["mlp"]
    ids = [id(m) for m in mixer._modules.values()] + [id(m) for m in mlp._modules.values()]
    if _is_moe(mlp):
        ids.append(id(mlp.moe_parts()))
    return ids


def describe(plan: Any, net: Any, i: int) -> bool:
    """Layer i's kind (and its mixture of experts' step) to `plan`, after `add_layer`; False where the plan cannot
    run it (a delta rule's tensors in a layout the C++ step does not take, experts the MoE step does not run)."""
    layer = net.layers[i]
    mixer, mlp = layer._modules["mixer"], layer._modules["mlp"]
    j = net.cache_index[i]
    if _is_delta(mixer):
        d = mixer.dims
        small = (mixer.conv, mixer.delta_norm)
        if mixer.conv.shape != (d.conv_width, d.conv) or mixer.delta_norm.shape != (d.v_dim,) or any(
                t.dtype not in (torch.float32, torch.bfloat16) for t in small):
            return False
        plan.set_kind(i, DELTA, [mixer.conv, mixer.delta_norm, mixer.a_log, mixer.dt_bias],
                      [j, d.k_heads, d.k_dim, d.v_heads, d.v_dim])
    else:
        plan.set_kind(i, ATTENTION, [], [j, int(net.arch.attn_gate)])
    if _is_moe(mlp):
        from superslm.kernels import moe_step  # it imports cpu_decode, which imports this module

        parts = mlp.moe_parts()
        if parts.step is None:
            parts.step = moe_step.build_step(parts) or False
        if not parts.step:
            return False
        plan.set_moe(i, parts.step, mlp.tokens_per_expert)
    return True


# --- the twin ---------------------------------------------------------------------------------------


def attend_rows_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor, row_seq: torch.Tensor,
    seq_lens: torch.Tensor, window: int | None, scale: float,
) -> torch.Tensor:
    """Each row's attention over its sequence's keys, one row at a time: q [B, heads, D] -> [B, heads, D] in q's
    dtype; k_cache, v_cache one layer's [slots, kv_heads, width] in a page format of cache/kv.py."""
    o = torch.empty_like(q)
    g = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        first = max(0, length - window) if window is not None else 0
        slots = key_slots[int(row_seq[b]), first:length]
        kk = read_rows(k_cache, slots, torch.float32).transpose(0, 1).repeat_interleave(g, 0)  # [heads, keys, D]
        vv = read_rows(v_cache, slots, torch.float32).transpose(0, 1).repeat_interleave(g, 0)
        p = torch.softmax((kk @ q[b].float()[:, :, None])[..., 0] * scale, -1)  # [heads, keys]
        o[b] = (p[:, None, :] @ vv)[:, 0].to(o.dtype)
    return o


def layer_reference(
    net: Any, i: int, h: torch.Tensor, slot_mapping: torch.Tensor, key_slots: torch.Tensor, row_seq: torch.Tensor,
    seq_lens: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], k_cache: torch.Tensor,
    v_cache: torch.Tensor, states: Any, state_slots: Sequence[int],
) -> torch.Tensor:
    """Parts layer i on decode rows h [B, dim] in torch ops, as the plan computes it -> the stream after the layer.
    Its KV pages are k_cache[net.cache_index[i]] (attention); a delta rule's states are states.conv / .ssm at that
    index, rows `state_slots` (one a row, distinct), zeroed first for a row whose sequence starts here."""
    a = net.arch
    layer = net.layers[i]
    mixer, mlp = layer._modules["mixer"], layer._modules["mlp"]
    j, n = net.cache_index[i], h.shape[0]
    x = rms_norm(h, layer.attn_norm, a.norm_eps, a.norm_float)
    if _is_delta(mixer):
        d = mixer.dims
        proj = mixer.in_proj(x)
        mixed, z, b, av = torch.split(proj, [d.conv_width, d.value_width, d.v_heads, d.v_heads], dim=1)
        beta = torch.sigmoid(b)
        g = -mixer.a_log.float().exp() * F.softplus(av.float() + mixer.dt_bias.float())  # [B, Hv] log decay
        conv, ssm = states.conv[j], states.ssm[j]
        for r in range(n):
            if int(seq_lens[r]) == 1:
                conv[state_slots[r]].zero_()
                ssm[state_slots[r]].zero_()
        normed = delta_rule.decode_step_reference(mixed, z, g, beta, mixer.conv, conv, ssm, list(state_slots),
                                                  mixer.delta_norm, a.norm_eps, d.k_heads, d.k_dim, d.v_heads, d.v_dim)
        o = mixer.out(normed)
    else:
        qs, ks = a.heads * a.head_dim, a.kv_heads * a.head_dim
        out = mixer.qkv(x)
        gate = None
        if a.attn_gate:
            heads = out[:, : 2 * qs].reshape(n, a.heads, 2, a.head_dim)  # [B, heads, (query, gate), D]
            gate = heads[:, :, 1].reshape(n, qs)
            out = torch.cat([heads[:, :, 0].reshape(n, qs), out[:, 2 * qs :]], dim=1)
        q = out[:, :qs].reshape(n, a.heads, a.head_dim)
        k = out[:, qs : qs + ks].reshape(n, a.kv_heads, a.head_dim)
        v = out[:, qs + ks :].reshape(n, a.kv_heads, a.head_dim)
        if a.qk_norm:
            q = rms_norm(q, mixer.q_norm, a.norm_eps, a.norm_float)
            k = rms_norm(k, mixer.k_norm, a.norm_eps, a.norm_float)
        cos, sin = tables[net.rope_key(i)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv(k_cache[j], v_cache[j], k, v, slot_mapping)
        o_in = attend_rows_reference(q, k_cache[j], v_cache[j], key_slots, row_seq, seq_lens, a.windows[i],
                                     a.attn_scale).reshape(n, qs)
        if gate is not None:
            o_in = o_in * torch.sigmoid(gate)
        o = mixer.o(o_in)
    h = h + o
    x = rms_norm(h, layer.ffn_norm, a.norm_eps, a.norm_float)
    if _is_moe(mlp):
        from superslm.kernels import moe_step

        y = moe_step.moe_reference(x, mlp.moe_parts(), mlp.tokens_per_expert, lambda m, rows: m(rows))
    else:
        y = mlp.down(gated_act(mlp.gate_up(x), a.act))
    return h + y
