"""The recurrent states of gated delta-rule layers: one row per sequence slot, beside the KV pages.

A delta-rule layer keeps, for each running sequence, the last inputs of its causal convolution and its
delta-rule state; unlike KV pages they are overwritten every token, so a sequence owns one row (a state
slot) while it runs. The scheduler grants and frees rows; a row is zeroed when its sequence starts.

Speculative decoding adds scratch rows after the slots' (`scratch_rows`): a step whose sequences carry drafts
keeps there the states after each of their rows but the last (engine/speculative.py), and once the drafts are
verified the state after a sequence's last kept row is copied back into its own row. They belong to the step that
writes them: nothing reads them after that step is accepted.
"""

from __future__ import annotations

import torch


class RecurrentStates:
    """conv [layers, slots + scratch, channels, taps - 1] (the compute dtype) and ssm [layers, slots + scratch,
    v_heads, k_dim, v_dim] (float32) of `layers` delta-rule layers: `slots` rows, then `scratch` rows for the
    states after a step's draft rows (see the module's docstring)."""

    def __init__(self, layers: int, slots: int, channels: int, taps: int, v_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", zeroed: bool = True,
                 scratch: int = 0) -> None:
        """zeroed=False leaves the rows unwritten (for rows always written before they are read: checkpoints),
        so on the CPU a row takes memory only once it is used; scratch rows are always left so."""
        self.layers, self.slots, self.scratch = layers, slots, scratch
        rows = slots + scratch
        self.conv = torch.empty(layers, rows, channels, taps - 1, dtype=dtype, device=device)
        self.ssm = torch.empty(layers, rows, v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
        if zeroed:
            self.conv[:, :slots].zero_()
            self.ssm[:, :slots].zero_()

    @property
    def scratch_rows(self) -> range:
        """The rows after the slots' that hold the states after a step's draft rows."""
        return range(self.slots, self.slots + self.scratch)

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

    def copy_row(self, src: RecurrentStates, src_row: int, row: int) -> None:
        """Row `row` of these states := row `src_row` of `src` (a checkpoint taken or resumed, a verified draft
        row's states kept)."""
        self.conv[:, row] = src.conv[:, src_row]
        self.ssm[:, row] = src.ssm[:, src_row]


class Checkpoints:
    """Which rows of a checkpoint store hold the recurrent states after which prefix, in plain Python: keys are
    the chained hashes of a prefix's last full page (cache.prefix_hash: they cover every token before and the
    salt), so a checkpoint stays right whatever happens to the pages; the least recently used goes first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a checkpoint store needs at least one row, got {capacity}")
        self.capacity = capacity
        self._rows: dict[bytes, int] = {}  # in use order: the first is the least recently used
        self._free = list(range(capacity))

    def __len__(self) -> int:
        return len(self._rows)

    def find(self, key: bytes) -> int | None:
        """The row holding the states after `key`'s prefix (now the most recently used), or None."""
        row = self._rows.pop(key, None)
        if row is not None:
            self._rows[key] = row
        return row

    def claim(self, key: bytes) -> int:
        """The row to write `key`'s states into: its own, a free one, or the least recently used one's."""
        row = self.find(key)
        if row is not None:
            return row
        if self._free:
            row = self._free.pop()
        else:
            oldest = next(iter(self._rows))
            row = self._rows.pop(oldest)
        self._rows[key] = row
        return row

    def clear(self) -> None:
        self._free = list(range(self.capacity))
        self._rows.clear()
