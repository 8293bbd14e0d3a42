"""Weight-only int8 GEMV/GEMM with bf16, fp16 or float32 activations: y = x (codes * scale)^T.

Weight layout: the int8 format's stored state (quant/dense.py `Int8Linear`): codes int8 [N, K] and
one scale per output channel [N]. The scale is applied once per output after the K loop: the int8
codes are exact in bf16/fp16, so tl.dot multiplies them without a rounding and only the float32
accumulation (in another order than the reference's) differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import interpreted, round_to


@triton.jit
def _int8_kernel(
    x_ptr, c_ptr, s_ptr, o_ptr,
    M, N, K, x_row, c_row, o_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, mm < M
    n64, m64 = n.to(tl.int64), mm.to(tl.int64)
    dot_ty = tl.float32 if F32_DOT else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        c = tl.load(c_ptr + n64[:, None] * c_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        xt = tl.load(x_ptr + m64[:, None] * x_row + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            # codes (|c| <= 127) are exact in bf16/fp16: tensor cores, no rounding of the weight
            acc += tl.dot(xt.to(dot_ty), tl.trans(c.to(dot_ty)), input_precision="ieee")
        else:
            # GEMV: BLOCK_M == 1, float32 multiply-adds (bandwidth-bound; no tensor cores needed)
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * c.to(tl.float32)[None, :, :], 2)
    s = tl.load(s_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    ot = o_ptr.dtype.element_ty
    y = acc * s[None, :]
    tl.store(o_ptr + m64[:, None] * o_row + n[None, :], round_to(y, ot).to(ot), mask=m_ok[:, None] & n_ok[None, :])


def int8_config(m: int, interp: bool) -> dict[str, int]:
    """Tiles of `_int8_kernel` for m activation rows. Up to 4 rows: one GEMV program per row (the
    others re-read the weight from L2, not memory); more: tl.dot tiles of 16 or 64 rows."""
    if m <= 4:
        return {"block_m": 1, "block_n": 32 if interp else 16, "block_k": 128, "num_warps": 4}
    block_m = 16 if m <= 16 else 64
    return {"block_m": block_m, "block_n": 32, "block_k": 64, "num_warps": 8 if block_m == 64 else 4}


def int8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, tile_rows: int | None = None
) -> torch.Tensor:
    """x [..., K] @ (codes * scale[:, None])^T -> [..., N] in x's dtype, accumulated in float32.

    codes int8 [N, K], scale [N] (bf16 as Int8Linear stores it, or any float dtype).
    Same signature and meaning as kernels.dispatch.int8_matmul_reference; `tile_rows` as int4_matmul's.
    """
    k = x.shape[-1]
    n = codes.shape[0]
    if codes.dim() != 2 or codes.shape[1] != k or codes.dtype != torch.int8 or scale.shape != (n,):
        raise InvalidArgument(f"int8: x {tuple(x.shape)}, codes {tuple(codes.shape)} {codes.dtype}, "
                              f"scale {tuple(scale.shape)}")  # fmt: skip
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        return out.zero_().view(*x.shape[:-1], n)
    codes, scale = codes.contiguous(), scale.contiguous()
    interp = interpreted(x)
    cfg = int8_config(m if tile_rows is None else tile_rows, interp)
    if tile_rows is not None and cfg["block_m"] != tile_rows:
        raise InvalidArgument(f"int8: tiles of {tile_rows} rows are not a configuration of the kernel")
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int8_kernel[grid](
        x2, codes, scale, out, m, n, k, x2.stride(0), codes.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["block_k"], DOT=block_m > 1,
        F32_DOT=interp or x.dtype == torch.float32, num_warps=cfg["num_warps"], enable_fp_fusion=True,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
