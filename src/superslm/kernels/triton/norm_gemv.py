"""A norm feeding a dense linear, as one GEMV launch: (add +) RMS norm in the prologue, the MLP's activation
in the epilogue of a fused gate_up. Reference: kernels.fused.norm_linear (same signature).

At a few rows a decode step's dense linears are GEMVs, and the launches around them (the norm before qkv,
the add + norm and the activation around gate_up, the final norm before the head) cost as much as the small
GEMVs themselves on a GPU. Each program here takes `BLOCK_N` outputs of one row: it first sums the squares
of its row (residual + x, written back as the new residual by the programs of the first column), then walks
the row again in chunks of `BLOCK_K`, normalizing each chunk as kernels/triton/rmsnorm.py rounds it before
the multiply-adds with the weight's tile; a gated program holds the gate's and the up's rows of the same
outputs and writes act(gate) * up, rounded as gated_act rounds. The row is re-read from cache, not memory.
Results equal the reference's but for the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels import fused as ref
from superslm.kernels.norm import norm_dtype
from superslm.kernels.triton._util import FLOATS, gemv_block_n, interpreted, next_pow2, round_to
from superslm.kernels.triton.fused import gated_act, gated_value
from superslm.kernels.triton.rmsnorm import add_rms_norm, normalized, rms_norm


@triton.jit
def _norm_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, o_ptr, ro_ptr,
    x_row, r_row, w_row, o_row, dim, n_out, up, eps,
    ADD: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    xt = x_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    # pass 1: the norm needs the whole row's sum of squares before any chunk is scaled; one column of programs
    # writes the new residual (to its own buffer: every program still reads the old one)
    ss = tl.zeros([BLOCK_K], tl.float32)
    writes = (kk * 0 + pid) == 0  # [BLOCK_K] (a scalar condition in a mask trips the interpreter)
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + kk
        m = k < dim
        v = tl.load(x_ptr + row * x_row + k, mask=m, other=0.0).to(tl.float32)
        if ADD:
            v = round_to(v + tl.load(r_ptr + row * r_row + k, mask=m, other=0.0).to(tl.float32), xt)
            tl.store(ro_ptr + row * dim + k, v.to(xt), mask=m & writes)
        ss += v * v
    inv = 1.0 / tl.sqrt_rn(tl.sum(ss, 0) / dim + eps)

    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    n64 = n.to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    # pass 2: the row again from cache (not kept in registers: a row may be 8k wide), normalized as rms_norm rounds
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + kk
        m = k < dim
        v = tl.load(x_ptr + row * x_row + k, mask=m, other=0.0).to(tl.float32)
        if ADD:
            v = round_to(v + tl.load(r_ptr + row * r_row + k, mask=m, other=0.0).to(tl.float32), xt)
        nw = tl.load(nw_ptr + k, mask=m, other=0.0).to(tl.float32)
        y = normalized(v, inv, nw, xt, WEIGHT_IN_FLOAT, True)  # `fits`: the norm's dtype is x's
        wm = n_ok[:, None] & m[None, :]
        wt = tl.load(w_ptr + n64[:, None] * w_row + k[None, :], mask=wm, other=0.0).to(tl.float32)
        acc += tl.sum(wt * y[None, :], 1)
        if GATED:
            wu = tl.load(w_ptr + (n64 + up)[:, None] * w_row + k[None, :], mask=wm, other=0.0).to(tl.float32)
            acc_u += tl.sum(wu * y[None, :], 1)
    out = round_to(acc, xt)  # the linear's output, as F.linear rounds it
    if GATED:
        out = gated_value(out, round_to(acc_u, xt), ACT, xt)
    tl.store(o_ptr + row * o_row + n, out.to(xt), mask=n_ok)


def norm_gemv_config(n_out: int, dim: int, interp: bool, gated: bool = False) -> dict[str, int]:
    """Tiles of `_norm_gemv_kernel`: BLOCK_N outputs a program, so that one row fills ~256 programs (an
    H100/H200 has 132 SMs; qkv of Qwen2.5-0.5B: 1152 outputs, 4 a program), at most 16; BLOCK_K inputs a
    step, 2048 weights a step in all (qkv: 512 bf16 = 1 KiB of each of 4 rows)."""
    if interp:  # the interpreter pays per program, not per element: few, wide programs
        return {"block_n": min(256, next_pow2(n_out)), "block_k": min(64, next_pow2(dim)), "num_warps": 4}
    block_n = gemv_block_n(n_out)
    if gated:  # two weight tiles a step (gate's and up's): half the outputs a program
        block_n = max(2, block_n // 2)
    # 2048 weights a step (16 a thread): [16, 512] bf16 tiles took ~200 registers on sm_90, these <= 48
    return {"block_n": block_n, "block_k": min(2048 // (block_n * (1 + gated)), next_pow2(dim)), "num_warps": 4}


def fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, weight_in_float: bool,
         w: torch.Tensor, act: str | None) -> bool:  # fmt: skip
    """Whether `_norm_gemv_kernel` takes these operands: dense 2-d rows, one float dtype for x, the norm's
    output and w, w [out, dim] (out even with `act`), at most 65535 rows (the grid's second axis)."""
    dt = x.dtype
    return (
        dt in FLOATS and x.dim() == 2 and x.stride(-1) == 1 and x.shape[0] <= 65535
        and w.dim() == 2 and w.shape[1] == x.shape[1]
        and w.dtype == dt and norm_dtype(dt, weight.dtype, weight_in_float) == dt
        and (residual is None or (residual.shape == x.shape and residual.dtype == dt and residual.stride(-1) == 1))
        and (act is None or (act in ref.ACTIVATIONS and w.shape[0] % 2 == 0))
    )  # fmt: skip


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    w: torch.Tensor,
    act: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same signature and meaning as kernels.fused.norm_linear: ((add +) norm, x w^T [, act]) in one launch.

    Operands the kernel does not take (`fits`) run the norm kernel, torch's matmul and the activation kernel."""
    if not fits(x, residual, weight, weight_in_float, w, act):
        if residual is None:
            h, y = None, rms_norm(x, weight, eps, weight_in_float)
        else:
            y, h = add_rms_norm(x, residual, weight, eps, weight_in_float)
        out = torch.nn.functional.linear(y, w)
        return (out if act is None else gated_act(out, act)), h
    rows, dim = x.shape
    n_out = w.shape[0] // 2 if act is not None else w.shape[0]
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    if rows == 0 or n_out == 0:
        return out, h
    w = w.contiguous()
    cfg = norm_gemv_config(n_out, dim, interpreted(x), act is not None)
    _norm_gemv_kernel[(triton.cdiv(n_out, cfg["block_n"]), rows)](
        x, residual if residual is not None else x, weight.contiguous(), w, out, h if h is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, w.stride(0), out.stride(0),
        dim, n_out, n_out, float(eps),
        ADD=residual is not None, WEIGHT_IN_FLOAT=weight_in_float, GATED=act is not None,
        ACT=ref.ACTIVATIONS.index(act) if act is not None else 0,
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"], enable_fp_fusion=False,
    )  # fmt: skip
    return out, h
