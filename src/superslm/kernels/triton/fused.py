"""Per-layer steps fused into one kernel each; references in kernels/fused.py (same signatures).

On a GPU a small model's decode step is a few hundred short launches: these take five of a layer's
(bias add, two RoPEs, the KV store; the activation and the product) down to two. Each rounds where
its reference rounds (bias add, norm, each RoPE product and their sum, the activation, the product),
so results match the reference to the last bit but for the float32 sums and transcendentals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels import fused as ref
from superslm.kernels.attention import QKVSpec
from superslm.kernels.triton._util import next_pow2, round_to
from superslm.kernels.triton.store_kv import store_kv


@triton.jit
def _heads(
    src, bias, w_ptr, cos, sin, nheads, head_dim, rot, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, T: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """nheads heads at src ([heads, head_dim], dense): + bias, RMS norm per head, RoPE -> float32 tile."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < nheads) & (d < head_dim)
    half = rot // 2
    is_rot = d < rot
    # rotate_half's partner of dim i: i + half in the first half (negated), i - half in the second
    partner = tl.where(d < half, d + half, d - half)
    pm = m & is_rot
    x = tl.load(src + h * head_dim + d, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(src + h * head_dim + partner, mask=pm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = round_to(x + tl.load(bias + h * head_dim + d, mask=m, other=0.0).to(tl.float32), T)
        xp = round_to(xp + tl.load(bias + h * head_dim + partner, mask=pm, other=0.0).to(tl.float32), T)
    if NORM:
        inv = (1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / head_dim + eps))[:, None]  # [BLOCK_H, 1]
        w = tl.load(w_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
        if WEIGHT_IN_FLOAT:
            x, xp = round_to(x * inv * w, T), round_to(xp * inv * wp, T)
        else:
            x, xp = round_to(round_to(x * inv, T) * w, T), round_to(round_to(xp * inv, T) * wp, T)
    xp = tl.where(d < half, -xp, xp)
    c = tl.load(cos + d, mask=is_rot, other=1.0).to(tl.float32)
    s = tl.load(sin + d, mask=is_rot, other=0.0).to(tl.float32)
    y = round_to(round_to(x * c, T) + round_to(xp * s, T), T)
    return tl.where(is_rot, y, x)  # dims past rotary_dim pass through


@triton.jit
def _prepare_qkv_kernel(
    qkv_ptr, bias_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr,
    qkv_row, cs_row, kc_slot, vc_slot, heads, kv_heads, head_dim, rot, rows, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    T = q_ptr.dtype.element_ty
    src = qkv_ptr + row * qkv_row
    cos, sin = cos_ptr + row * cs_row, sin_ptr + row * cs_row
    q = _heads(src, bias_ptr, qn_ptr, cos, sin, heads, head_dim, rot, eps,
               HAS_BIAS, NORM, WEIGHT_IN_FLOAT, T, BLOCK_HQ, BLOCK_D)  # fmt: skip
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    tl.store(q_ptr + row * heads * head_dim + hq * head_dim + d, q.to(T), mask=(hq < heads) & (d < head_dim))
    slot = tl.load(slot_ptr + tl.maximum(tl.minimum(row, rows - 1), 0)).to(tl.int64)
    if (row < rows) & (slot >= 0):  # rows past `rows` and negative slots are padding: nothing stored
        ko = heads * head_dim
        k = _heads(src + ko, bias_ptr + ko, kn_ptr, cos, sin, kv_heads, head_dim, rot, eps,
                   HAS_BIAS, NORM, WEIGHT_IN_FLOAT, T, BLOCK_HK, BLOCK_D)  # fmt: skip
        hk = tl.arange(0, BLOCK_HK)[:, None]
        mk = (hk < kv_heads) & (d < head_dim)
        vo = ko + kv_heads * head_dim
        v = tl.load(src + vo + hk * head_dim + d, mask=mk, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = round_to(v + tl.load(bias_ptr + vo + hk * head_dim + d, mask=mk, other=0.0).to(tl.float32), T)
        tl.store(kc_ptr + slot * kc_slot + hk * head_dim + d, k.to(T), mask=mk)
        tl.store(vc_ptr + slot * vc_slot + hk * head_dim + d, v.to(T), mask=mk)


def _fits(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int,
          *others: torch.Tensor | None) -> bool:
    """Whether the kernel's one-dtype, dense-head layout holds (else the reference runs)."""
    same = all(t is None or t.dtype == qkv.dtype for t in (k_cache, v_cache, *others))
    dense = qkv.stride(-1) == 1 and all(c.stride(2) == 1 and c.stride(1) == head_dim for c in (k_cache, v_cache))
    return same and dense and qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)


def prepare_qkv(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.prepare_qkv, one program per row."""
    n = qkv.shape[0]
    bias, heads, kv_heads, q_norm, k_norm = spec.bias, spec.heads, spec.kv_heads, spec.q_norm, spec.k_norm
    head_dim = spec.head_dim(qkv)
    norm = spec.norm
    rot = cos.shape[-1]
    if not _fits(qkv, k_cache, v_cache, head_dim, bias, q_norm if norm else None, k_norm if norm else None, cos,
                 sin) or rot % 2 or rot > head_dim:
        # the reference's steps, then this backend's store, which skips the negative slots of padding rows
        q, k, v = ref.rotate_qkv(qkv, spec, cos, sin)
        rows = slot_mapping.shape[0]
        store_kv(k_cache, v_cache, k[:rows], v[:rows], slot_mapping)
        return q
    q = torch.empty(n, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    cos, sin = cos.contiguous(), sin.contiguous()
    rows = slot_mapping.shape[0]
    slots = slot_mapping if rows else torch.full((1,), -1, dtype=torch.long, device=qkv.device)
    _prepare_qkv_kernel[(n,)](
        qkv, bias if bias is not None else qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin,
        k_cache, v_cache, slots, q,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), v_cache.stride(0), heads, kv_heads, head_dim, rot, rows,
        float(spec.eps),
        HAS_BIAS=bias is not None, NORM=norm, WEIGHT_IN_FLOAT=spec.norm_float,
        BLOCK_HQ=next_pow2(heads), BLOCK_HK=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
        enable_fp_fusion=False,  # the reference's roundings, step by step
    )  # fmt: skip
    return q


@triton.jit
def gate_activation(g, ACT: tl.constexpr):
    """float32 g -> act(g), ACT the index in kernels.fused.ACTIVATIONS (silu, gelu_tanh, gelu)."""
    if ACT == 0:  # silu
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu, tanh approximation: 0.5 g (1 + tanh(y)) = g sigmoid(2 y)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * y))
    else:  # gelu (erf)
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    return a


@triton.jit
def gated_value(g, u, ACT: tl.constexpr, T: tl.constexpr):
    """act(gate) * up as kernels.fused.gated_act rounds it in dtype T: the activation rounded, then the product."""
    return round_to(round_to(gate_activation(g, ACT), T) * u, T)


@triton.jit
def _gated_act_kernel(gu_ptr, o_ptr, inter, gu_row, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    T = o_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * gu_row + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_row + inter + c, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * inter + c, gated_value(g, u, ACT, T).to(T), mask=m)


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.gated_act."""
    if act not in ref.ACTIVATIONS or gate_up.stride(-1) != 1 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return ref.gated_act(gate_up, act)
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    _gated_act_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), ACT=ref.ACTIVATIONS.index(act), BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    return out
