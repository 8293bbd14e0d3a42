"""A gated delta-rule layer's rows on the GPU (kernels/delta_rule.py decode_step_reference's meaning): the causal
convolution step of each row over its slot's conv state, then the q/k L2 norms and the recurrence over its slot's
float32 state. Decode rows: one program per (row, value head, block of value dims), the state read and written
once. A prompt's rows: the same per-row arithmetic (shared jit functions) walked in order, one program per block of
channels for the conv and per (value head, block of value dims) for the recurrence, the state in registers
throughout, so a prompt's rows get the bits its tokens would get one decode step at a time, however it is chunked.
The gated norm after them stays the reference's torch ops.

Rounding follows the reference where it rounds: the conv's products and sum to the weight's dtype, its SiLU to
the rows' dtype (bf16 rows almost always bit for bit); the recurrence in float32 as `recurrent_`, up to the order
of its sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from superslm.kernels.delta_rule import QK_EPS, gated_rms_norm
from superslm.kernels.triton._util import next_pow2, round_to


@triton.jit
def _conv_row(x, sp, w_ptr, y_out, c, m, xt, wt, st, TAPS: tl.constexpr):
    """One row's conv over channels c: y = silu(sum_j state[j] w[j] + x w[TAPS - 1]) stored at y_out, the state at
    sp shifted by one (x last). The step and the prompt kernels share it, so a prompt's rows get the step's bits."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for j in tl.static_range(TAPS - 1):
        raw = tl.load(sp + j, mask=m, other=0.0)
        w = tl.load(w_ptr + c * TAPS + j, mask=m, other=0.0).to(tl.float32)
        acc += round_to(round_to(raw.to(tl.float32), wt) * w, wt)  # the reference multiplies in the weight's dtype
        if j > 0:
            tl.store(sp + j - 1, raw, mask=m)  # the window shifted by one
    w_last = tl.load(w_ptr + c * TAPS + (TAPS - 1), mask=m, other=0.0).to(tl.float32)
    acc += round_to(round_to(x, wt) * w_last, wt)
    tl.store(sp + TAPS - 2, round_to(x, st).to(st), mask=m)
    y = round_to(acc, wt)
    y = round_to(y / (1.0 + tl.exp(-y)), wt)
    tl.store(y_out + c, round_to(y, xt).to(xt), mask=m)


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr,
    C, x_stride,
    TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row b, channels c: `_conv_row` over its slot's window."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * x_stride + c, mask=m, other=0.0).to(tl.float32)
    sp = state_ptr + slot * C * (TAPS - 1) + c * (TAPS - 1)
    _conv_row(x, sp, w_ptr, y_ptr + b * C, c, m, x_ptr.dtype.element_ty, w_ptr.dtype.element_ty,
              state_ptr.dtype.element_ty, TAPS)


@triton.jit
def _conv_prompt_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr,
    T, C, x_stride,
    TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """T rows of one sequence in order, channels c: `_conv_row` for each over its window (state_ptr: the slot's
    [C, TAPS - 1]; each thread reads back the window entries it stored itself)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    sp = state_ptr + c * (TAPS - 1)
    for t in range(T):
        x = tl.load(x_ptr + t * x_stride + c, mask=m, other=0.0).to(tl.float32)
        _conv_row(x, sp, w_ptr, y_ptr + t * C, c, m, x_ptr.dtype.element_ty, w_ptr.dtype.element_ty,
                  state_ptr.dtype.element_ty, TAPS)


@triton.jit
def _recur_row(row, g, beta, s, kh, h, kk, mk, vv, mv, DK, DV, key_width, eps, scale):
    """One row's q, k of key head kh L2-normalized (q times scale), then S = exp(g) S; S += k (beta (v - k^T S))^T
    -> (S, o = q^T S) for value head h, value dims vv. Shared by the step and the prompt kernels."""
    q = tl.load(row + kh * DK + kk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + key_width + kh * DK + kk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_width + h * DV + vv, mask=mv, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
    s = s * tl.exp(g)
    pred = tl.sum(k[:, None] * s, 0)  # [BV]
    delta = (v - pred) * beta
    s = s + k[:, None] * delta[None, :]
    return s, tl.sum(q[:, None] * s, 0)


@triton.jit
def _recurrent_kernel(
    y_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
    HK, HV, DK, DV, key_width, g_stride, beta_stride, eps, scale,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Row b, value head h, value dims vb * BV..: `_recur_row` with S [Dk, BV] read and written once."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    kh = h // (HV // HK)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    kk = tl.arange(0, BK)
    mk = kk < DK
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    mv = vv < DV
    g = tl.load(g_ptr + b * g_stride + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * beta_stride + h).to(tl.float32)
    sp = state_ptr + (slot * HV + h) * DK * DV + kk[:, None] * DV + vv[None, :]
    sm = mk[:, None] & mv[None, :]
    s, o = _recur_row(y_ptr + b * (2 * key_width + HV * DV), g, beta, tl.load(sp, mask=sm, other=0.0), kh, h, kk,
                      mk, vv, mv, DK, DV, key_width, eps, scale)
    tl.store(sp, s, mask=sm)
    tl.store(o_ptr + (b * HV + h) * DV + vv, o, mask=mv)


@triton.jit
def _recurrent_prompt_kernel(
    y_ptr, g_ptr, beta_ptr, state_ptr, o_ptr,
    T, HK, HV, DK, DV, key_width, g_stride, beta_stride, eps, scale,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """T rows of one sequence in order, value head h, value dims vb * BV..: `_recur_row` for each, S [Dk, BV] kept
    in registers from the first row to the last (float32 throughout: the step's bits, row after row); state_ptr:
    the slot's [HV, DK, DV]."""
    h = tl.program_id(0).to(tl.int64)
    kh = h // (HV // HK)
    kk = tl.arange(0, BK)
    mk = kk < DK
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    mv = vv < DV
    sp = state_ptr + h * DK * DV + kk[:, None] * DV + vv[None, :]
    sm = mk[:, None] & mv[None, :]
    s = tl.load(sp, mask=sm, other=0.0)
    for t in range(T):
        g = tl.load(g_ptr + t * g_stride + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * beta_stride + h).to(tl.float32)
        s, o = _recur_row(y_ptr + t * (2 * key_width + HV * DV), g, beta, s, kh, h, kk, mk, vv, mv, DK, DV,
                          key_width, eps, scale)
        tl.store(o_ptr + (t * HV + h) * DV + vv, o, mask=mv)
    tl.store(sp, s, mask=sm)


def delta_decode_step(
    mixed: torch.Tensor,
    z: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int] | torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> torch.Tensor:
    """`decode_step_reference` with the conv step and the recurrence as two kernels (the layout kernels/delta_rule.py
    `_fused_layout` checks: contiguous states, rows with unit column strides, distinct slots)."""
    b, c = mixed.shape
    taps = conv_weight.shape[1]
    ids = torch.as_tensor(slots, dtype=torch.long).to(mixed.device)
    y = torch.empty(b, c, dtype=mixed.dtype, device=mixed.device)
    block = min(1024, next_pow2(c))
    _conv_step_kernel[(b, triton.cdiv(c, block))](mixed, conv_weight, conv_state, ids, y, c, mixed.stride(0),
                                                  TAPS=taps, BLOCK=block)
    core = torch.empty(b, v_heads, v_dim, dtype=torch.float32, device=mixed.device)
    bv = min(64, next_pow2(v_dim))
    _recurrent_kernel[(b, v_heads, triton.cdiv(v_dim, bv))](
        y, g, beta, ssm_state, ids, core, k_heads, v_heads, k_dim, v_dim, k_heads * k_dim, g.stride(0),
        beta.stride(0), QK_EPS, k_dim**-0.5, BK=next_pow2(k_dim), BV=bv)
    normed = gated_rms_norm(core.to(mixed.dtype), z.reshape(b, v_heads, v_dim), norm_weight, eps)
    return normed.reshape(b, v_heads * v_dim)


def delta_prompt_rows(
    mixed: torch.Tensor,
    z: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slot: int,
    norm_weight: torch.Tensor,
    eps: float,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> torch.Tensor:
    """T rows of one sequence (mixed [T, C], ...) through the layer's glue, its states at row `slot`: what T calls
    of `delta_decode_step` give, row after row, in two launches (the conv over channels, the recurrence over value
    heads and blocks of value dims, each walking the rows in order)."""
    t, c = mixed.shape
    taps = conv_weight.shape[1]
    y = torch.empty(t, c, dtype=mixed.dtype, device=mixed.device)
    block = min(1024, next_pow2(c))
    _conv_prompt_kernel[(triton.cdiv(c, block),)](mixed, conv_weight, conv_state[slot], y, t, c, mixed.stride(0),
                                                  TAPS=taps, BLOCK=block)
    core = torch.empty(t, v_heads, v_dim, dtype=torch.float32, device=mixed.device)
    bv = min(64, next_pow2(v_dim))
    _recurrent_prompt_kernel[(v_heads, triton.cdiv(v_dim, bv))](
        y, g, beta, ssm_state[slot], core, t, k_heads, v_heads, k_dim, v_dim, k_heads * k_dim, g.stride(0),
        beta.stride(0), QK_EPS, k_dim**-0.5, BK=next_pow2(k_dim), BV=bv)
    normed = gated_rms_norm(core.to(mixed.dtype), z.reshape(t, v_heads, v_dim), norm_weight, eps)
    return normed.reshape(t, v_heads * v_dim)
