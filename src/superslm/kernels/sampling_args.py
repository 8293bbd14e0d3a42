"""The arguments of device-side sampling's kernels (kernels/triton/sampling.py): each row's logit bias and penalties.

sampling/batch.py builds them; sampling/on_device.py holds the kernels' torch references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogitBias(NamedTuple):
    """Every row's logit_bias as CSR: row b's pairs are tokens / values[offsets[b]:offsets[b + 1]]."""

    offsets: torch.Tensor
    """int32 [B + 1], ascending, offsets[0] = 0."""
    tokens: torch.Tensor
    """int32 [K]: token ids, distinct within a row."""
    values: torch.Tensor
    """float32 [K]: the biases."""


class Penalties(NamedTuple):
    """Penalty inputs: `build_penalty_tensors` of the P rows that use penalties, and per-row factors."""

    rows: torch.Tensor
    """int32 [B]: row b's row in counts / prompt_mask, -1 for rows without penalties."""
    counts: torch.Tensor
    """int32 [P, V]: output token counts."""
    prompt_mask: torch.Tensor
    """bool [P, V]: tokens in the prompt."""
    factors: torch.Tensor
    """float32 [B, 3]: presence, frequency, repetition (read only where rows >= 0)."""
