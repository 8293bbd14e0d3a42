"""GPTQ for int4: round each weight column in turn and move its rounding error onto the columns not yet
rounded, weighted by the inputs' second moments H = sum x x^T over calibration text (Frantar et al.,
2022). It minimizes the error of W x on those inputs rather than of W, which plain rounding does.

`Calibration` accumulates H for every linear of a layer from forward pre-hooks; `gptq_int4` returns
codes, scales and zeros in `quantize_groups`' terms, so `Int4Linear` takes them as they are. Each
group's (scale, zero) is fitted to the group's columns as GPTQ has updated them when it reaches the
group's first column; the rotation, when there is one, is applied to H as to the weight. (Columns in
order of decreasing H diagonal, "act order", with groups fixed up front measured worse here.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from superslm.errors import InvalidArgument
from superslm.kernels.hadamard import rotate_weight

#: columns updated together (the lazy batch update of the GPTQ paper)
_BLOCK = 128
#: damping added to H's diagonal, as a fraction of its mean (keeps the Cholesky factor stable)
DAMP = 0.01


class Calibration:
    """Sums x x^T (float64) of the inputs each named module sees, through forward pre-hooks."""

    def __init__(self) -> None:
        self.hessians: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    @contextmanager
    def watch(self, modules: dict[str, nn.Module]) -> Iterator[Calibration]:
        """Accumulate while the block runs; the hooks are removed after it."""
        handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):  # noqa: ANN202 - a torch hook
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            h = self.hessians.get(name)
            self.hessians[name] = x.T @ x if h is None else h.addmm_(x.T, x)
            self.rows[name] = self.rows.get(name, 0) + x.shape[0]

        return hook

    def pop(self, name: str) -> torch.Tensor | None:
        """The mean x x^T of `name`'s inputs (float32), forgotten here; None if it saw none."""
        h, n = self.hessians.pop(name, None), self.rows.pop(name, 0)
        return None if h is None or n == 0 else (h / n).float()


def rotated_hessian(h: torch.Tensor, seed: int, block: int) -> torch.Tensor:
    """M^T H M for the rotation x -> x M that `rotate_activation` applies (H symmetric)."""
    return rotate_weight(rotate_weight(h, seed, block).T.contiguous(), seed, block)


def _group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel_group_params` of each row of w [N, group], with the range search: unlike plain rounding
    (docs/quantization.md), GPTQ gains from it (SmolLM2 int4 g128 rotated: 16.4 -> 15.7 perplexity)."""
    from superslm.quant.int4 import kernel_group_params

    sb, zb = kernel_group_params(w[:, None, :], search=True)
    return sb[:, 0], zb[:, 0]


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group: int,
              damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 of w float32 [N, K] (K a multiple of `group`) for inputs with second moments h [K, K] ->
    (codes uint8 [N, K], scale bf16 [N, K / group], zero bf16 [N, K / group])."""
    n, k = w.shape
    if k % group or h.shape != (k, k):
        raise InvalidArgument(f"gptq: weight {tuple(w.shape)}, H {tuple(h.shape)}, group {group} do not fit")
    w = w.clone().float()
    h = h.clone().double()
    dead = torch.diagonal(h) <= 0
    live = torch.diagonal(h)[~dead]
    mean_diag = live.mean() if live.numel() else torch.tensor(1.0, dtype=h.dtype)
    # an input that is always 0 (or padding): its column is free, any code will do; its diagonal takes
    # the live mean so that neither it nor the damping depends on how many such columns there are
    h[dead, dead] = mean_diag
    w[:, dead] = 0.0
    h.diagonal().add_(damp * mean_diag)
    # the upper Cholesky factor of H^-1: row i holds how column i's error spreads to the columns after it
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // group)
    zero = torch.empty(n, k // group)
    sb = zb = torch.empty(0)
    for b0 in range(0, k, _BLOCK):
        b1 = min(b0 + _BLOCK, k)
        wb = w[:, b0:b1].clone()  # [N, B]: this block's columns as updated so far
        err = torch.empty_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:
                # the group's columns as they stand now (those past this block are updated in w)
                g = torch.cat([wb[:, j:], w[:, b1 : col + group]], dim=1)[:, :group]
                sb, zb = _group_params(g)
                scale[:, col // group], zero[:, col // group] = sb, zb
            x = wb[:, j]
            c = torch.round((x - zb) / sb + 8).clamp_(0, 15)
            codes[:, col] = c.to(torch.uint8)
            e = (x - ((c - 8) * sb + zb)) / hb[j, j]
            wb[:, j:].sub_(e[:, None] * hb[j, j:][None, :])
            err[:, j] = e
        w[:, b1:].sub_(err @ hinv[b0:b1, b1:])
    return codes, scale.to(torch.bfloat16), zero.to(torch.bfloat16)

