"""RMS norm and fused residual-add + RMS norm, one program per row, statistics in float32.

Rounding follows the torch reference (kernels.norm.rms_norm) step by step, so float32 results
agree to the last bits of the sum and bf16 results almost always bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.norm import norm_dtype
from superslm.kernels.triton._util import next_pow2, round_to


@triton.jit
def normalized(x, inv, w, T: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, ROUND: tl.constexpr):
    """A norm's output from x (float32, in T's values), its 1/rms and the weight w, as kernels.norm.rms_norm rounds
    it: Gemma (WEIGHT_IN_FLOAT) x * inv * w in float32, rounded to T; Llama x * inv rounded to T, times w, rounded to
    T again when ROUND (the product's promoted dtype is T: the weight is not wider)."""
    if WEIGHT_IN_FLOAT:
        y = round_to(x * inv * w, T)
    else:
        y = round_to(x * inv, T) * w
        if ROUND:
            y = round_to(y, T)
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr,
    inner, x_outer, x_inner, r_outer, r_inner, dim, eps,
    ADD: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    # rows of x [..., outer, inner, dim] may be strided views (q/k heads of a fused qkv)
    a, b = row // inner, row % inner
    c = tl.arange(0, BLOCK)
    m = c < dim
    xt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + a * x_outer + b * x_inner + c, mask=m, other=0.0).to(tl.float32)
    if ADD:
        res = tl.load(r_ptr + a * r_outer + b * r_inner + c, mask=m, other=0.0).to(tl.float32)
        x = round_to(x + res, xt)  # the new residual, as torch's `residual + x` rounds it
        tl.store(ro_ptr + row * dim + c, x.to(xt), mask=m)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / dim + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    ot = o_ptr.dtype.element_ty
    if WEIGHT_IN_FLOAT:
        y = x * inv * w
    else:
        y = round_to(x * inv, xt) * w  # Llama: normalized x back to its dtype, then the weight
    tl.store(o_ptr + row * dim + c, round_to(y, ot).to(ot), mask=m)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, weight_in_float: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    out_dtype = norm_dtype(x.dtype, weight.dtype, weight_in_float)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rows = x.numel() // dim if dim else 0
    if rows == 0:
        return out, res_out
    # a 3-d x may be a strided view (q/k heads of a fused qkv): rows are [outer, inner] with strides
    xv = x if x.stride(-1) == 1 else x.contiguous()
    if xv.dim() != 3:
        xv = xv.reshape(-1, dim)  # [rows, dim]
    inner, xo, xi = (xv.shape[1], xv.stride(0), xv.stride(1)) if xv.dim() == 3 else (1, xv.stride(0), 0)
    rv, ro, ri = xv, 0, 0
    if residual is not None:
        if residual.shape != x.shape:
            raise InvalidArgument(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
        rv = residual if residual.stride(-1) == 1 else residual.contiguous()
        if rv.dim() != 3:
            rv = rv.reshape(-1, dim)
        ro, ri = (rv.stride(0), rv.stride(1)) if rv.dim() == 3 else (rv.stride(0), 0)
    _rms_norm_kernel[(rows,)](
        xv, rv, weight.contiguous(), out, res_out if res_out is not None else out,
        inner, xo, xi, ro, ri, dim, float(eps),
        ADD=residual is not None, WEIGHT_IN_FLOAT=weight_in_float, BLOCK=next_pow2(dim),
        num_warps=4 if dim <= 2048 else 8, enable_fp_fusion=False,  # the reference's roundings, step by step
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False) -> torch.Tensor:
    """Same signature and meaning as kernels.norm.rms_norm: x / rms(x) * weight over the last dim."""
    return _launch(x, None, weight, eps, weight_in_float)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one pass; see kernels.dispatch.add_rms_norm."""
    out, res = _launch(x, residual, weight, eps, weight_in_float)
    assert res is not None
    return out, res
