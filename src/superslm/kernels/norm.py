"""RMS norm (torch reference)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, the statistics in float32.

    Llama casts the normalized x back to its dtype before the weight; Gemma multiplies in float32
    (`weight_in_float`). Both are exact in float32 and differ only by one rounding in bf16.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float:
        return (y * weight.float()).to(x.dtype)
    return weight * y.to(x.dtype)


def norm_dtype(x: torch.dtype, weight: torch.dtype, weight_in_float: bool) -> torch.dtype:
    """The dtype `rms_norm(x, weight, ...)` returns (Llama's `weight * y` promotes)."""
    return x if weight_in_float else torch.promote_types(x, weight)
