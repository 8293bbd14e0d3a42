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

import torch
import torch.nn.functional as F

#: rows per chunk of the prompt form (flash-linear-attention's chunk size)
CHUNK = 64


def normalize_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
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


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence: q, k [T, Hk, Dk] (normalized), v [T, Hv, Dv], g, beta [T, Hv], state
    [Hv, Dk, Dv] float32 -> (o [T, Hv, Dv] float32, the state after the last token)."""
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
    taps = weight.shape[1]
    seq = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
    y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    return F.silu(y).to(x.dtype).transpose(0, 1), seq[:, seq.shape[1] - (taps - 1):]


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
