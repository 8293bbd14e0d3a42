"""The recurrent states of gated delta-rule layers: one row per sequence slot, beside the KV pages.

A delta-rule layer keeps, for each running sequence, the last inputs of its causal convolution and its
delta-rule state; unlike KV pages they are overwritten every token, so a sequence owns one row (a state
slot) while it runs. The scheduler grants and frees rows; a row is zeroed when its sequence starts.
"""

from __future__ import annotations

import torch


class RecurrentStates:
    """conv [layers, slots, channels, taps - 1] (the compute dtype) and ssm [layers, slots, v_heads, k_dim,
    v_dim] (float32) of `layers` delta-rule layers."""

    def __init__(self, layers: int, slots: int, channels: int, taps: int, v_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.layers, self.slots = layers, slots
        self.conv = torch.zeros(layers, slots, channels, taps - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(layers, slots, v_heads, k_dim, v_dim, dtype=torch.float32, device=device)

    @staticmethod
    def slot_bytes(layers: int, channels: int, taps: int, v_heads: int, k_dim: int, v_dim: int,
                   dtype: torch.dtype) -> int:
        """Bytes one slot's states take across all layers."""
        size = torch.empty((), dtype=dtype).element_size()
        return layers * (channels * (taps - 1) * size + v_heads * k_dim * v_dim * 4)

    def rows(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of these slots (copies): conv [layers, n, ...], ssm [layers, n, ...]."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        return self.conv[:, idx].clone(), self.ssm[:, idx].clone()

    def write(self, slots: list[int], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        self.conv[:, idx] = conv.to(self.conv)
        self.ssm[:, idx] = ssm.to(self.ssm)
