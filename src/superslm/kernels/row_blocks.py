"""Fixed-shape matmuls for deterministic mode: every row block multiplied on its own.

BLAS libraries choose a kernel, and with it the order of a dot product's terms, by the matrix shape
and the thread count: MKL on an Intel Xeon gave the rows of a [64, 1536] @ [1536, 576] product other
bits than the same rows in a [16, 1536] product (2 threads). Padding a step's rows to a multiple of 16
is not enough there; multiplying each 16-row block on its own gives every call one shape, so a row's
bits do not depend on how many rows its step has.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: rows of every deterministic matmul (models/transformer.py pads a step's rows to a multiple of this)
BLOCK = 16


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x with zero rows appended up to a multiple of `multiple` rows."""
    pad = (-x.shape[0]) % multiple
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x


def by_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """fn(x) computed on `block` rows at a time (the last block zero-padded): x [N, ...] -> [N, ...].

    fn must treat rows independently (a linear, a low-rank product)."""
    n = x.shape[0]
    x = pad_rows(x, block)
    if x.shape[0] == block:
        return fn(x)[:n]
    return torch.cat([fn(rows) for rows in x.split(block)])[:n]
