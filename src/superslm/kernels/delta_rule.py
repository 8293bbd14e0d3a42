"""The gated delta rule (Qwen3.5 and Qwen3-Next linear attention) and its causal convolution, in torch.

A delta-rule layer keeps, per sequence and value head, a state S [Dk, Dv]. Each token decays it by exp(g),
reads its key's prediction k^T S, writes the correction beta * (v - k^T S) along k, and answers q^T S:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,    o_t = q_t^T S_t

`recurrent` runs that token by token (decode: one row per sequence, all sequences at once); `chunked` runs
a prompt in chunks of 64, as flash-linear-attention does: inside a chunk the corrections solve one
unit-lower-triangular system, so a chunk costs a few matmuls and the state is read and written once.
q and k arrive L2-normalized and q scaled by Dk^-0.5 (`normalize_qk`); the state stays float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from superslm import cext
from superslm.kernels import dispatch

#: rows per chunk of the prompt form (flash-linear-attention's chunk size)
CHUNK = 64


#: the q/k L2 norms' epsilon (transformers' and flash-linear-attention's l2norm; the C++ and Triton steps use it too)
QK_EPS = 1e-6


def normalize_qk(q: torch.Tensor, k: torch.Tensor, eps: float = QK_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> float32, each head vector L2-normalized (x / sqrt(|x|^2 + eps)) and q scaled by
    Dk^-0.5, as the checkpoints were trained (transformers' and flash-linear-attention's l2norm)."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k


def _expand(x: torch.Tensor, v_heads: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D]: each key head serves Hv / Hk consecutive value heads."""
    rep = v_heads // x.shape[-2]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-2)


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hk, Dk] (normalized), v [B, Hv, Dv], g, beta [B, Hv],
    state [B, Hv, Dk, Dv] float32 -> (o [B, Hv, Dv] float32, the new state)."""
    hv = v.shape[-2]
    q, k = _expand(q, hv), _expand(k, hv)
    s = state * g.float().exp()[..., None, None]
    pred = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v.float() - pred) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def recurrent_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """`recurrent` with `state` [B, Hv, Dk, Dv] float32 updated in place (a view of the engine's state rows: no
    gathered copy, no temporaries of the state's size) -> o [B, Hv, Dv] float32. Elementwise in each row, as
    `recurrent`, so a row's bits do not depend on the rows beside it."""
    hv = v.shape[-2]
    q, k = _expand(q, hv), _expand(k, hv)
    state.mul_(g.float().exp()[..., None, None])
    pred = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v.float() - pred) * beta.float()[..., None]
    state.addcmul_(k[..., :, None], delta[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q, state)


#: value heads the prompt form works on at once: its float32 temporaries scale with heads x rows (at 16 heads
#: and 512 rows ~60 MB live, a peak RSS rise of ~90 MB on Qwen3.5-0.8B); each head's arithmetic is its own
HEAD_GROUP = 4


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
    head_group: int = HEAD_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence: q, k [T, Hk, Dk] (normalized), v [T, Hv, Dv], g, beta [T, Hv], state
    [Hv, Dk, Dv] float32 -> (o [T, Hv, Dv] float32, the state after the last token); `head_group` value heads
    at a time (rounded up to whole key heads)."""
    hk, hv = k.shape[-2], v.shape[-2]
    rep = hv // hk
    step = max(rep, head_group // rep * rep)  # value heads per group: whole key heads' worth
    if step >= hv:
        return _chunked(q, k, v, g, beta, state, chunk)
    outs, states = [], []
    for h0 in range(0, hv, step):
        h1 = min(h0 + step, hv)  # value heads h0..h1 read key heads h0 / rep..h1 / rep
        ks = slice(h0 // rep, h1 // rep)
        o, st = _chunked(q[:, ks], k[:, ks], v[:, h0:h1], g[:, h0:h1], beta[:, h0:h1], state[h0:h1], chunk)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` on all the heads it is given at once."""
    t, hv = v.shape[0], v.shape[-2]
    pad = (-t) % chunk  # padded rows have k = 0 and g = 0: they leave the state as it was

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(0, 1)  # [T, H, ...] -> [H, T, ...]
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(hv, -1, chunk, *x.shape[2:])  # [H, chunks, C, ...]

    q, k, v = heads_first(_expand(q, hv)), heads_first(_expand(k, hv)), heads_first(v)
    g, beta = heads_first(g), heads_first(beta)
    cum = g.cumsum(-1)  # [H, N, C]: log decay from the chunk's start through each row
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (row i reads what row j wrote), 0 above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
    kb = k * beta[..., None]
    # (I + L) U = beta v - beta exp(cum) k S0, with L[i, j] = beta_i exp(cum_i - cum_j) k_i . k_j below the diagonal
    system = (kb @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_s = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay  # [H, N, C, C]: q_i . k_j exp(cum_i - cum_j), j <= i
    q_in = q * cum.exp()[..., None]  # what each row reads of the chunk's starting state
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]  # each row's write, decayed to the chunk's end
    end = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    s = state.float()
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        u = u_v[:, n] - u_s[:, n] @ s  # [H, C, Dv]: the corrections written by the chunk's rows
        out[:, n] = q_in[:, n] @ s + scores[:, n] @ u
        s = s * end[:, n] + k_out[:, n].transpose(-1, -2) @ u
    out = out.reshape(hv, -1, out.shape[-1])[:, :t].transpose(0, 1)  # [H, T+pad, Dv] -> [T, H, Dv]
    return out, s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution, then SiLU, over T rows of one sequence: x [T, C], weight [C, K],
    state [C, K - 1] (the last K - 1 inputs before these rows; zeros at a sequence's start) -> (y [T, C] in
    x's dtype, the new state)."""
    taps, t = weight.shape[1], x.shape[0]
    seq = torch.cat([state.to(x.dtype).transpose(0, 1), x], dim=0)  # [K - 1 + T, C]
    # K shifted multiply-adds over [T, C] in float32, then one rounding to the weight's dtype as conv1d's
    # output: torch's depthwise conv1d in bf16 on the CPU took ~27 ms for 4 rows of 6144 channels
    w, sf = weight.float(), seq.float()
    y = sf[0:t] * w[:, 0]
    for j in range(1, taps):
        y.addcmul_(sf[j : j + t], w[:, j])
    return F.silu(y.to(weight.dtype)).to(x.dtype), seq[seq.shape[0] - (taps - 1):].transpose(0, 1)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of each of B sequences: x [B, C], weight [C, K], state [B, C, K - 1] -> (y [B, C], new state)."""
    seq = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    y = (seq.to(weight.dtype) * weight).sum(-1)
    return F.silu(y).to(x.dtype), seq[:, :, 1:]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta-rule output's norm: rms_norm(x) * weight (cast to x's dtype first), times silu(z) in float32;
    x, z [..., Dv]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(z.float())).to(x.dtype)


def decode_step_reference(
    mixed: torch.Tensor,
    z: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int],
    norm_weight: torch.Tensor,
    eps: float,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> torch.Tensor:
    """`decode_step` in torch ops: the causal conv step, the q/k norms, `recurrent_` and the gated norm."""
    b, key_width = mixed.shape[0], k_heads * k_dim
    ids = list(slots)
    idx = torch.tensor(ids, dtype=torch.long, device=mixed.device)
    y, conv_state[idx] = causal_conv_step(mixed, conv_weight, conv_state[idx])
    q, k, v = torch.split(y, [key_width, key_width, v_heads * v_dim], dim=1)
    q, k = normalize_qk(q.reshape(b, k_heads, k_dim), k.reshape(b, k_heads, k_dim))
    v = v.reshape(b, v_heads, v_dim)
    if ids == list(range(ids[0], ids[0] + b)):
        # slots in a run (one sequence, or a full batch in slot order): the state rows updated in place
        core = recurrent_(q, k, v, g, beta, ssm_state[ids[0] : ids[0] + b])
    else:
        state = ssm_state[idx]
        core = recurrent_(q, k, v, g, beta, state)
        ssm_state[idx] = state
    normed = gated_rms_norm(core.to(mixed.dtype), z.reshape(b, v_heads, v_dim), norm_weight, eps)
    return normed.reshape(b, v_heads * v_dim)


def decode_step(
    mixed: torch.Tensor,
    z: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int],
    norm_weight: torch.Tensor,
    eps: float,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> torch.Tensor:
    """One new row of each of B sequences through a delta-rule layer's glue: mixed [B, C] (q, k, v before the
    conv), z [B, Hv * Dv] (the norm's gate), g (float32) and beta [B, Hv]; conv_state [S, C, K - 1] and
    ssm_state [S, Hv, Dk, Dv] float32 updated in place at rows `slots` (distinct) -> the gated norm's output
    [B, Hv * Dv] in mixed's dtype. On the CPU one C++ call (kernels/cpu/delta_step.cpp: ~40 small torch ops
    otherwise), each row computed alone, so its bits do not depend on the rows beside it; on the Triton backend
    two kernels (kernels/triton/delta_rule.py: the conv step, then the recurrence); else, and where the extension
    is off or the layout is not one they take, `decode_step_reference`."""
    args = (mixed, z, g, beta, conv_weight, conv_state, ssm_state, slots, norm_weight, eps,
            k_heads, k_dim, v_heads, v_dim)
    t = dispatch.triton_kernels(mixed.device)
    if t is not None:
        return t.delta_decode_step(*args) if _fused_layout(*args) else decode_step_reference(*args)
    ext = _cpu_extension(mixed.device)
    if ext is None or not _fused_layout(*args):
        return decode_step_reference(*args)
    ids = torch.tensor(list(slots), dtype=torch.long)
    return ext.delta_decode_step(mixed, z, g, beta, conv_weight, conv_state, ssm_state, ids, norm_weight, eps,
                                 k_heads, k_dim, v_heads, v_dim)


def prompt_rows(
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
) -> torch.Tensor | None:
    """T rows of one sequence through the layer's glue (as `decode_step`'s arguments, its states at row `slot`)
    where a kernel walks them in order: on the Triton backend, kernels/triton/delta_rule.py's prompt kernels, which
    give each row what `decode_step` would (so deterministic mode reads a prompt in one call, not T steps). None
    elsewhere, or for a layout they do not take: the caller runs its own prompt form."""
    t = dispatch.triton_kernels(mixed.device)
    if t is None or mixed.dim() != 2 or mixed.shape[0] == 0:
        return None
    first = (mixed[:1], z[:1], g[:1], beta[:1], conv_weight, conv_state, ssm_state, [slot], norm_weight, eps,
             k_heads, k_dim, v_heads, v_dim)
    n = mixed.shape[0]
    if not _fused_layout(*first) or any(x.shape[0] != n for x in (z, g, beta)):  # type: ignore[arg-type]
        return None
    return t.delta_prompt_rows(mixed, z, g, beta, conv_weight, conv_state, ssm_state, slot, norm_weight, eps,
                               k_heads, k_dim, v_heads, v_dim)


def _cpu_extension(device: torch.device) -> Any:
    """The C++ extension where the fused step runs on `device` (the CPU, the torch backend), else None."""
    if device.type != "cpu" or dispatch.backend(device) != "torch":
        return None
    return cext.extension()


_FLOATS = (torch.float32, torch.bfloat16)


def _fused_layout(
    mixed: torch.Tensor,
    z: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: Sequence[int],
    norm_weight: torch.Tensor,
    eps: float,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> bool:
    """Whether the C++ step (or the Triton kernels) takes these tensors as they are (dtypes, shapes, unit column
    strides, contiguous states, one device): the checks it would raise on, made here so the model's calls fall
    back rather than fail."""
    b, c = mixed.shape if mixed.dim() == 2 else (-1, -1)
    taps = conv_weight.shape[-1]
    rows = (mixed, z, g, beta)
    return (
        mixed.dtype in _FLOATS and z.dtype == mixed.dtype and beta.dtype == mixed.dtype and g.dtype == torch.float32
        and conv_weight.dtype in _FLOATS and conv_state.dtype in _FLOATS and norm_weight.dtype in _FLOATS
        and ssm_state.dtype == torch.float32
        and all(t.dim() == 2 and t.shape[0] == b and t.stride(1) == 1 for t in rows)
        and c == 2 * k_heads * k_dim + v_heads * v_dim and v_heads % k_heads == 0
        and tuple(z.shape) == (b, v_heads * v_dim) and tuple(g.shape) == (b, v_heads) == tuple(beta.shape)
        and tuple(conv_weight.shape) == (c, taps) and taps >= 2 and conv_weight.is_contiguous()
        and conv_state.dim() == 3 and tuple(conv_state.shape[1:]) == (c, taps - 1) and conv_state.is_contiguous()
        and tuple(ssm_state.shape) == (conv_state.shape[0], v_heads, k_dim, v_dim) and ssm_state.is_contiguous()
        and tuple(norm_weight.shape) == (v_dim,) and norm_weight.is_contiguous()
        and len(set(slots)) == len(slots) == b and all(0 <= s < conv_state.shape[0] for s in slots)
        and all(t.device == mixed.device for t in (*rows, conv_weight, conv_state, ssm_state, norm_weight))
    )
