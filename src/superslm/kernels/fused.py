"""Torch references of the per-layer steps the GPU runs as one kernel each (kernels/triton/fused.py).

`prepare_qkv`: a fused qkv matmul's output -> bias, per-head q/k norms, RoPE, k and v into the paged
cache, q out; `gated_act`: the MLP's act(gate) * up from the fused gate_up output; `norm_rotate` and
`gated_act_rotate`: a norm or the activation feeding a Hadamard-rotated int4/int8 linear, with the
linear's cast and input rotation (`hadamard_rotate`, kernels.hadamard.Rotation's map); `norm_linear`: a norm
feeding a dense linear (and the activation after a fused gate_up), the GPU's one-launch GEMV; `prepare_attention`:
prepare_qkv and the paged attention after it (one launch of a decode step on the GPU), and `attention_linear`
with the o projection (whose GEMV merges the attention's key splits); `norm_rotate_int4` and
`gated_act_rotate_int4`: `norm_rotate` and `gated_act_rotate` with the int4 GEMV after them. Each is the plain
composition of the layer's own steps, so the torch backend computes exactly what it did before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata, QKVSpec, paged_attention, store_kv
from superslm.kernels.norm import rms_norm
from superslm.kernels.rope import apply_rope

#: the activations `gated_act` knows, by Arch name
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP's gate activation by Arch name: silu, gelu_tanh, or gelu (erf)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [N, 2 I] (gate then up) -> act(gate) * up [N, I] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(act, gate) * up


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (heads + 2 kv_heads) head_dim] -> views q [N, heads, D], k and v [N, kv_heads, D]."""
    n, qs, ks = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    return (qkv[:, :qs].view(n, heads, head_dim), qkv[:, qs : qs + ks].view(n, kv_heads, head_dim),
            qkv[:, qs + ks :].view(n, kv_heads, head_dim))  # fmt: skip


def rotate_qkv(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prepare_qkv` up to the KV store: (q [N, heads, D], k, v [N, kv_heads, D])."""
    if spec.bias is not None:
        qkv = qkv + spec.bias
    q, k, v = split_qkv(qkv, spec.heads, spec.kv_heads, spec.head_dim(qkv))
    if spec.q_norm is not None and spec.k_norm is not None:
        q, k = rms_norm(q, spec.q_norm, spec.eps, spec.norm_float), rms_norm(k, spec.k_norm, spec.eps, spec.norm_float)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def prepare_qkv(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The attention's inputs from the fused qkv matmul's output qkv [N, (heads + 2 kv_heads) D].

    qkv + spec.bias (when given); q and k each through their per-head RMS norm (when spec has q_norm and
    k_norm [D]: Qwen3, Gemma-3) and RoPE (cos, sin [N, rotary_dim]); the first slot_mapping.shape[0] rows'
    k and v written to k_cache/v_cache [slots, kv_heads, D] at slot_mapping. Returns q [N, heads, D].
    """
    q, k, v = rotate_qkv(qkv, spec, cos, sin)
    rows = slot_mapping.shape[0]  # rows past this are padding (deterministic mode)
    store_kv(k_cache, v_cache, k[:rows], v[:rows], slot_mapping)
    return q


def prepare_attention(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """`prepare_qkv` (its slot_mapping: meta's), then paged attention over the cache it wrote: [N, heads, D]."""
    q = prepare_qkv(qkv, spec, cos, sin, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, spec.window, spec.scale)


def attention_linear(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    w: torch.Tensor,
) -> torch.Tensor:
    """`prepare_attention`, then the dense o projection w [out, heads D] (no bias): [N, out]."""
    o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
    return F.linear(o.reshape(o.shape[0], -1), w)


def attention_rotate(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`prepare_attention`, then a rotated o projection's cast, padding and input rotation (`linear_input`):
    [N, len(signs)] in `dtype`, what LinearFormat.forward_rotated takes."""
    o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
    return linear_input(o.reshape(o.shape[0], -1), signs, block, dtype)


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., K] -> per block of `block` inputs (x * signs) · H_b in x's dtype: kernels.hadamard.Rotation's
    forward step by step (signs and the orthonormal H_b cast to x's dtype, one batched matmul)."""
    # imported here: kernels.hadamard imports kernels.dispatch, which imports this module
    from superslm.kernels.hadamard import hadamard_matrix

    k, lead = x.shape[-1], x.shape[:-1]
    if block < 1 or k % block:
        raise InvalidArgument(f"Hadamard block {block} must divide the input dimension {k}")
    h = hadamard_matrix(block).to(x.device, x.dtype)  # [b, b]; checks that block is a power of two
    y = (x * signs.to(x.device, x.dtype)).reshape(*lead, k // block, block)  # [..., blocks, b]
    return torch.matmul(y, h).reshape(*lead, k)


def norm_rotate(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm feeding a rotated linear: (R · rms_norm(residual + x) in `dtype`, residual + x), or without a
    residual (R · rms_norm(x), None). As LinearFormat.forward does, the norm's output is cast to `dtype` (the
    linear's compute dtype) and zero-padded to the rotation's width K = len(signs) >= x's before the rotation:
    the result is [N, K]."""
    if residual is None:
        h, y = None, rms_norm(x, weight, eps, weight_in_float)
    else:
        h = residual + x
        y = rms_norm(h, weight, eps, weight_in_float)
    return linear_input(y, signs, block, dtype), h


def linear_input(
    y: torch.Tensor, signs: torch.Tensor, block: int, dtype: torch.dtype, rotate: Callable = hadamard_rotate
) -> torch.Tensor:
    """What LinearFormat.forward makes of its input y [..., k]: cast to `dtype`, zero inputs appended up to the
    rotation's width len(signs) (its k_pad), then `rotate` (this reference, or a backend's kernel)."""
    pad = signs.shape[0] - y.shape[-1]
    if pad < 0:
        raise InvalidArgument(f"a rotation over {signs.shape[0]} inputs cannot take {y.shape[-1]}")
    y = y.to(dtype)
    return rotate(F.pad(y, (0, pad)) if pad else y, signs, block)


def gated_act_rotate(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """The activation feeding a rotated linear: R · gated_act(gate_up, act), cast to `dtype` and zero-padded
    to len(signs) inputs first (see `norm_rotate`)."""
    return linear_input(gated_act(gate_up, act), signs, block, dtype)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    w: torch.Tensor,
    act: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm feeding a dense linear w [out, dim] (no bias): (rms_norm(residual + x) w^T, residual + x), or
    without a residual (rms_norm(x) w^T, None). With `act` (a fused gate_up: gate rows, then up rows) the first
    result is gated_act of that product, [N, out / 2]."""
    if residual is None:
        h, y = None, rms_norm(x, weight, eps, weight_in_float)
    else:
        h = residual + x
        y = rms_norm(h, weight, eps, weight_in_float)
    out = F.linear(y, w)
    return (out if act is None else gated_act(out, act)), h


class Int4Weight(NamedTuple):
    """An int4 weight in the int4 format's stored state (quant/int4.py `Int4Linear._state`): qweight uint8
    [N, K / 2] (byte j: code 2j low nibble, 2j + 1 high), scale and zero [N, K / group],
    W[n, k] = (code - 8) * scale[n, k // group] + zero[n, k // group]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, computed in float32 from the dequantized weight (`Int4Weight`).
    `tile_rows`: the kernel's rows per program (they change its rounding only); the reference has no tiles."""
    n = qweight.shape[0]
    codes = torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(n, -1)  # [N, K]
    s = scale.float().repeat_interleave(group, dim=1)
    z = zero.float().repeat_interleave(group, dim=1)
    w = (codes.float() - 8) * s + z
    return (x.float() @ w.T).to(x.dtype)


def norm_rotate_int4(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
    w4: Int4Weight,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`norm_rotate`, then the rotated int4 linear's product: (R · rms_norm(residual + x) W^T in `dtype`,
    residual + x), [N, out] (what LinearFormat.forward_rotated's matmul makes, before a bias)."""
    xr, h = norm_rotate(x, residual, weight, eps, weight_in_float, signs, block, dtype)
    return int4_matmul(xr, *w4), h


def gated_act_rotate_int4(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype, w4: Int4Weight
) -> torch.Tensor:
    """`gated_act_rotate`, then the rotated int4 linear's product (the down projection's, before a bias)."""
    return int4_matmul(gated_act_rotate(gate_up, act, signs, block, dtype), *w4)
