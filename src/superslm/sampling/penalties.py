"""Per-request token history for presence/frequency/repetition penalties, and its batched tensors.

The engine keeps one `PenaltyState` per request that uses penalties (and none for the others); each
step, `build_penalty_tensors` turns the states of the rows that need them into dense device tensors
by scattering only the (row, token) pairs that occur, so the host sends O(distinct tokens) numbers,
never O(vocab).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from superslm.sampling._device import upload


@dataclass
class PenaltyState:
    """The tokens one request has seen: its distinct prompt tokens and its output token counts."""

    prompt_token_ids: frozenset[int] = frozenset()
    """Distinct token ids of the prompt (they count for the repetition penalty only)."""
    output_counts: Counter[int] = field(default_factory=Counter)
    """How often each token id occurs in the output so far."""

    @classmethod
    def from_prompt(cls, prompt_token_ids: Iterable[int]) -> PenaltyState:
        """A fresh state for a request whose prompt is `prompt_token_ids`."""
        return cls(prompt_token_ids=frozenset(int(t) for t in prompt_token_ids))

    def append(self, token: int) -> None:
        """Record one more output token."""
        self.output_counts[int(token)] += 1

    def state(self) -> dict[str, Any]:
        """Plain, JSON-ready data: {"prompt": [ids], "output": [[id, count], ...]} (sorted)."""
        return {
            "prompt": sorted(self.prompt_token_ids),
            "output": [[t, n] for t, n in sorted(self.output_counts.items())],
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> PenaltyState:
        """Rebuild from `state()` output (ValueError for anything but token ids and positive counts)."""
        prompt = data["prompt"]
        counts = {t: n for t, n in data["output"]}
        if not all(type(t) is int and t >= 0 for t in [*prompt, *counts]) or not all(
                type(n) is int and n > 0 for n in counts.values()):
            raise ValueError("penalty state holds something other than token ids and counts")
        return cls(prompt_token_ids=frozenset(prompt), output_counts=Counter(counts))

    @property
    def token_ids(self) -> set[int]:
        """Every token id the state holds (for a check against the vocabulary)."""
        return set(self.prompt_token_ids) | set(self.output_counts)


def build_penalty_tensors(
    states: Sequence[PenaltyState], vocab_size: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Dense per-row token statistics for `apply_penalties`.

    Args:
        states: one state per row that uses penalties (rows without penalties are left out).
        vocab_size: V, the width of the logits.
        device: where the tensors live (the logits' device).

    Returns:
        (output_counts int32 [N, V], prompt_mask bool [N, V]) for the N = len(states) rows.
    """
    n = len(states)
    counts = torch.zeros((n, vocab_size), dtype=torch.int32, device=device)
    prompt_mask = torch.zeros((n, vocab_size), dtype=torch.bool, device=device)
    out_rows: list[int] = []
    out_tokens: list[int] = []
    out_counts: list[int] = []
    prompt_rows: list[int] = []
    prompt_tokens: list[int] = []
    for row, st in enumerate(states):
        out_rows.extend([row] * len(st.output_counts))
        out_tokens.extend(st.output_counts.keys())
        out_counts.extend(st.output_counts.values())
        prompt_rows.extend([row] * len(st.prompt_token_ids))
        prompt_tokens.extend(st.prompt_token_ids)
    if out_rows:
        # one [3, K] host tensor, one copy to the device
        packed = upload(torch.tensor([out_rows, out_tokens, out_counts], dtype=torch.int64), device)
        counts.index_put_((packed[0], packed[1]), packed[2].to(torch.int32))
    if prompt_rows:
        packed = upload(torch.tensor([prompt_rows, prompt_tokens], dtype=torch.int64), device)
        prompt_mask.index_put_((packed[0], packed[1]), torch.ones((), dtype=torch.bool, device=device))
    return counts, prompt_mask
