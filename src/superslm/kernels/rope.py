"""Rotary position embedding, NeoX layout (rotate halves), on the first `rotary_dim` dims of a head."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, rotary_dim] for positions [N] (computed in float32, then cast, as HF does)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated on its first cos.shape[-1] dims."""
    rot = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat((xr * c + torch.cat((-x2, x1), dim=-1) * s, xp), dim=-1)
