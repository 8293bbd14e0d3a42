"""Block Hadamard rotation of a linear's input dimension, so that int4/int8 groups see no outliers.

R = blockdiag(H_b, ..., H_b) · diag(signs): H_b is the orthonormal Walsh-Hadamard matrix of size b (a
power of two, 128 by default) and `signs` are seeded random ±1 over the input dimension K. R is
orthogonal, so for any W [out, K] and x [..., K]:

    W x == rotate_weight(W, seed) · rotate_activation(x, seed)        (W R^T · R x)

`rotate_weight` runs once, at conversion, before quantizing; `rotate_activation` (or the `Rotation`
module, its fast run-time form) runs on every call. Rotating one row of W is the same map as rotating
one activation row, so both are `fwht(v * signs)` blockwise.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from superslm.errors import InvalidArgument
from superslm.kernels import dispatch

#: the default (and largest) Hadamard block: the issue's 128 inputs
BLOCK = 128


def pick_block(k: int, largest: int = BLOCK) -> int:
    """The largest power of two <= `largest` that divides `k` (SmolLM2's 576 gives 64)."""
    if k <= 0 or largest <= 0:
        raise InvalidArgument(f"cannot rotate an input dimension of {k} with blocks of {largest}")
    b = 1
    while b * 2 <= largest and k % (b * 2) == 0:
        b *= 2
    return b


def _check_block(k: int, block: int | None) -> int:
    block = pick_block(k) if block is None else block
    if block < 1 or block & (block - 1) or k % block:
        raise InvalidArgument(f"Hadamard block {block} must be a power of two dividing the input dimension {k}")
    return block


def random_signs(k: int, seed: int) -> torch.Tensor:
    """Seeded ±1 float32 [k]: the same seed gives the same signs on every machine (CPU generator)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (k,), generator=g, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each run of `block` values along the last axis.

    Vectorised butterflies: log2(block) steps over the whole tensor (no loop over rows), ping-ponging
    between two buffers; the result is x · H_b per block with H_b symmetric, so it is its own inverse.
    """
    k = x.shape[-1]
    block = _check_block(k, block)
    y = x.reshape(-1, block).clone()  # [rows * blocks, b]
    out = torch.empty_like(y)
    h = 1
    while h < block:
        # pairs (i, i + h) inside every run of 2h: [rows * blocks, b / 2h, 2, h]
        yv, ov = y.view(-1, block // (2 * h), 2, h), out.view(-1, block // (2 * h), 2, h)
        a, c = yv[:, :, 0], yv[:, :, 1]
        torch.add(a, c, out=ov[:, :, 0])
        torch.sub(a, c, out=ov[:, :, 1])
        y, out = out, y
        h *= 2
    return (y * (1.0 / math.sqrt(block))).view(x.shape)


@functools.lru_cache(maxsize=16)
def _matrix(block: int, dtype: torch.dtype) -> torch.Tensor:
    return fwht(torch.eye(block, dtype=torch.float64), block).to(dtype)


def _blocks_times_h(x: torch.Tensor, block: int) -> torch.Tensor:
    """x · H_b per block as one matmul: the same transform as `fwht`, ~15x faster on this CPU for whole
    weights (torch's elementwise passes are the bottleneck there, a GEMM is not)."""
    h = _matrix(block, x.dtype).to(x.device)
    return (x.reshape(-1, block) @ h).view(x.shape)


def _wide(x: torch.Tensor) -> torch.Tensor:
    # float32 at least (float64 stays float64)
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rotate_activation(x: torch.Tensor, seed: int, block: int | None = None) -> torch.Tensor:
    """R x for activations x [..., K] (computed in float32 or wider, returned in x's dtype)."""
    block = _check_block(x.shape[-1], block)
    signs = random_signs(x.shape[-1], seed).to(x.device)
    return _blocks_times_h(_wide(x) * signs, block).to(x.dtype)


def rotate_weight(w: torch.Tensor, seed: int, block: int | None = None) -> torch.Tensor:
    """W R^T for a weight W [out, K]: each row rotated as an activation is (returned in w's dtype)."""
    return rotate_activation(w, seed, block)


def unrotate_weight(w: torch.Tensor, seed: int, block: int | None = None) -> torch.Tensor:
    """The inverse of `rotate_weight`: W_rot R, i.e. each row v -> R^T v = signs * fwht(v)."""
    block = _check_block(w.shape[-1], block)
    signs = random_signs(w.shape[-1], seed).to(w.device)
    return (_blocks_times_h(_wide(w), block) * signs).to(w.dtype)


def hadamard_matrix(block: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix H_b [b, b] in float32 (Sylvester order, as `fwht`)."""
    return _matrix(_check_block(block, block), torch.float32).clone()


class Rotation(nn.Module):
    """x -> R x at run time: a sign flip and one batched matmul with H_b (2 dispatches, H_b cached).

    The matmul form beats the butterflies on CPU (log2(b) steps of several ops each) at decode sizes;
    both compute the same R (tests check). Runs in x's dtype: in bf16 the one extra rounding is that of
    the rotated activation, which the packed kernels would round to bf16 anyway.
    """

    def __init__(self, k: int, seed: int, block: int | None = None) -> None:
        super().__init__()
        self.k, self.seed, self.block = k, int(seed), _check_block(k, block)
        self.register_buffer("signs", random_signs(k, seed), persistent=False)
        self.register_buffer("h", hadamard_matrix(self.block), persistent=False)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # ±1 signs are exact in any dtype; 1/sqrt(128) rounds to bf16 with a 1e-4 relative error
        got = self._cast.get(dtype)
        if got is None or got[0].device != self.signs.device:
            got = (self.signs.to(dtype), self.h.to(dtype))
            self._cast[dtype] = got
        return got

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dispatch.backend(x.device) == "triton":  # one kernel on a GPU (butterflies in registers)
            return dispatch.hadamard_rotate(x, self.signs, self.block)
        signs, h = self._tables(x.dtype)
        lead = x.shape[:-1]
        y = (x * signs).view(*lead, self.k // self.block, self.block)  # [..., blocks, b]
        return torch.matmul(y, h).view(*lead, self.k)

    def extra_repr(self) -> str:
        return f"k={self.k}, block={self.block}, seed={self.seed}"

    def describe(self) -> str:
        return f"hadamard b{self.block} seed {self.seed}"
