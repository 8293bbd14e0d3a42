"""A dense GEMM with fixed tiles for deterministic mode: y = x W^T (+ b), each row's bits its own.

cuBLAS chooses its kernel, and with it the order of a dot product's terms, by the matrix shape, so
deterministic mode multiplied dense linears 16 rows a call (kernels/row_blocks.py): a 2,048-token
prompt chunk took 128 calls per linear. Here one launch does every row: each program takes a tile of
`tile_rows` rows and BLOCK_N outputs and walks K in BLOCK_K steps in a fixed order, so a row's
products and their sums are the same whichever tile it sits in and however many rows the call has.
The bias is added in float32 before the one rounding to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import FLOATS, interpreted, round_to

#: the tiles: rows come from the caller (`tile_rows`), outputs and the K step are fixed whatever the call
BLOCK_N, BLOCK_K = 64, 64


@triton.jit
def _dense_kernel(
    x_ptr, w_ptr, b_ptr, o_ptr,
    M, N, K, x_row, w_row, o_row,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
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
        w = tl.load(w_ptr + n64[:, None] * w_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + m64[:, None] * x_row + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # bf16 operands on a GPU (exact products into float32); float32 ones under the interpreter, whose bf16
        # tl.dot is wrong, and for float32 weights ("ieee": no tf32 rounding of the operands)
        acc += tl.dot(xt.to(dot_ty), tl.trans(w.to(dot_ty)), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ot = o_ptr.dtype.element_ty
    tl.store(o_ptr + m64[:, None] * o_row + n[None, :], round_to(acc, ot).to(ot), mask=m_ok[:, None] & n_ok[None, :])


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile_rows: int = 16
) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., N] in x's dtype, tile_rows rows a program.

    weight [N, K] in x's dtype, bias [N] (any float dtype) or None. Same signature and meaning as
    kernels.dispatch.dense_matmul_reference: a row's bits depend on its own values only.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or x.dtype not in FLOATS:
        raise InvalidArgument(f"dense: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and bias.shape != (n,):
        raise InvalidArgument(f"dense: bias {tuple(bias.shape)} for {n} outputs")
    if tile_rows not in (16, 32, 64):
        raise InvalidArgument(f"dense: tiles of {tile_rows} rows are not a configuration of the kernel")
    x2 = x.reshape(x.shape[:-1].numel(), k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    if k == 0:
        out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand(m, n))
        return out.view(*x.shape[:-1], n)
    weight = weight.contiguous()
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, tile_rows))
    _dense_kernel[grid](
        x2, weight, weight if bias is None else bias.contiguous(), out, m, n, k,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=tile_rows, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        F32_DOT=interpreted(x) or x.dtype == torch.float32, num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
