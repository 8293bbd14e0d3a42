"""The Hadamard rotation of a rotated int4/int8 linear's input fused into the step that makes the input.

References in kernels/fused.py (`norm_rotate`, `gated_act_rotate`; same signatures). A rotated linear after
an RMS norm or the MLP's activation otherwise costs one more launch (kernels/triton/hadamard.py) and a round
trip of the activation through memory: three a layer. `_norm_rotate_kernel` runs one program per row (the
norm needs the whole row): the row as a [blocks, b] tile, the norm rounded as kernels/triton/rmsnorm.py
rounds it, then the linear's cast and the rotation by `fwht_rows`. `_gated_act_rotate_kernel` takes
(row, block) pairs as the Hadamard kernel does. Results equal the references but for float32 sums. Shapes
the fused kernels do not take (a row of more than MAX_ROW_BLOCKS blocks, strided rows) run the same steps as
separate kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels import fused as ref
from superslm.kernels.norm import norm_dtype
from superslm.kernels.triton._util import FLOATS, interpreted, next_pow2, round_to
from superslm.kernels.triton.fused import gated_act, gated_value
from superslm.kernels.triton.hadamard import h_scale, hadamard_config, hadamard_rotate, rotated_input
from superslm.kernels.triton.rmsnorm import add_rms_norm, normalized, rms_norm

#: most blocks a row may hold for the one-program-per-row norm (64 x 128 inputs: registers beyond)
MAX_ROW_BLOCKS = 64


@triton.jit
def _norm_rotate_kernel(
    x_ptr, r_ptr, w_ptr, s_ptr, o_ptr, ro_ptr,
    x_row, r_row, dim, k, nb, eps, hs,
    ADD: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, NORM_ROUND: tl.constexpr,
    NBP: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NBP)[:, None] * B + tl.arange(0, B)[None, :]  # [blocks, b]: input index
    m = c < dim  # inputs past dim up to k = nb * b: the linear's zero padding
    xt = x_ptr.dtype.element_ty
    ot = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
    if ADD:
        x = round_to(x + tl.load(r_ptr + row * r_row + c, mask=m, other=0.0).to(tl.float32), xt)
        tl.store(ro_ptr + row * dim + c, x.to(xt), mask=m)  # the new residual
    inv = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(x * x, 1), 0) / dim + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    y = normalized(x, inv, w, xt, WEIGHT_IN_FLOAT, NORM_ROUND)  # Llama's product: x's dtype unless w is wider
    r = rotated_input(y, tl.load(s_ptr + c, mask=m, other=0.0).to(tl.float32), hs, ot, NBP, B, LOG_B)
    tl.store(o_ptr + row * k + c, r.to(ot), mask=c < k)


@triton.jit
def _gated_act_rotate_kernel(
    gu_ptr, s_ptr, o_ptr,
    R, NB, inter, k, gu_row, hs,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (row, block) pairs: row r // NB, block r % NB
    r_ok = (r < R)[:, None]
    row = (r // NB).to(tl.int64)[:, None]
    c = ((r % NB) * B)[:, None] + tl.arange(0, B)[None, :]  # [pairs, b]: input index
    gt = gu_ptr.dtype.element_ty
    ot = o_ptr.dtype.element_ty
    m = r_ok & (c < inter)  # inputs past inter up to k: the linear's zero padding
    g = tl.load(gu_ptr + row * gu_row + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_row + inter + c, mask=m, other=0.0).to(tl.float32)
    y = gated_value(g, u, ACT, gt)
    h = rotated_input(y, tl.load(s_ptr + c, mask=r_ok, other=0.0).to(tl.float32), hs, ot, BLOCK_R, B, LOG_B)
    tl.store(o_ptr + row * k + c, h.to(ot), mask=r_ok)


def rotation_ok(width: int, signs: torch.Tensor, block: int) -> bool:
    """A power-of-two block <= 128 dividing the rotation's width len(signs) >= the input's width."""
    k = signs.shape[0]
    return signs.dim() == 1 and 1 <= block <= 128 and not block & (block - 1) and k % block == 0 and k >= width


def norm_rotate(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same signature and meaning as kernels.fused.norm_rotate, one program per row."""
    dim, k = x.shape[-1], signs.shape[-1]
    if x.dtype not in FLOATS or dtype not in FLOATS:
        return ref.norm_rotate(x, residual, weight, eps, weight_in_float, signs, block, dtype)
    dense = x.dim() == 2 and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    if (not dense or not rotation_ok(dim, signs, block) or k // block > MAX_ROW_BLOCKS
            or (residual is not None and residual.shape != x.shape)):
        # the same steps as separate kernels (a row too wide for one program, a strided row, a bad argument)
        if residual is None:
            y, h = rms_norm(x, weight, eps, weight_in_float), None
        else:
            y, h = add_rms_norm(x, residual, weight, eps, weight_in_float)
        return ref.linear_input(y, signs, block, dtype, hadamard_rotate), h
    n = x.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if n == 0:
        return out, res_out
    nb = k // block
    _norm_rotate_kernel[(n,)](
        x, residual if residual is not None else x, weight.contiguous(), signs.to(x.device).contiguous(), out,
        res_out if res_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, dim, k, nb, float(eps),
        h_scale(block, dtype),
        ADD=residual is not None, WEIGHT_IN_FLOAT=weight_in_float,
        NORM_ROUND=norm_dtype(x.dtype, weight.dtype, weight_in_float) == x.dtype,
        NBP=next_pow2(nb), B=block, LOG_B=block.bit_length() - 1, num_warps=4 if dim <= 2048 else 8,
        enable_fp_fusion=False,  # the reference's roundings, step by step
    )  # fmt: skip
    return out, res_out


def gated_act_rotate(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.gated_act_rotate, (row, block) pairs a program."""
    inter = gate_up.shape[-1] // 2
    if gate_up.dtype not in FLOATS or dtype not in FLOATS:
        return ref.gated_act_rotate(gate_up, act, signs, block, dtype)
    if (act not in ref.ACTIVATIONS or gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2
            or not rotation_ok(inter, signs, block)):
        # the same steps as separate kernels
        return ref.linear_input(gated_act(gate_up, act), signs, block, dtype, hadamard_rotate)
    n, k = gate_up.shape[0], signs.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=gate_up.device)
    rows = n * (k // block)  # (row, block) pairs
    if rows == 0:
        return out
    interp = interpreted(gate_up)
    cfg = hadamard_config(rows, block, interp)
    _gated_act_rotate_kernel[(triton.cdiv(rows, cfg["block_r"]),)](
        gate_up, signs.to(gate_up.device).contiguous(), out, rows, k // block, inter, k, gate_up.stride(0),
        h_scale(block, dtype),
        ACT=ref.ACTIVATIONS.index(act), BLOCK_R=cfg["block_r"], B=block, LOG_B=block.bit_length() - 1,
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
