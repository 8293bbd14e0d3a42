"""Weight-only int4 GEMV/GEMM with bf16 (or float32) activations: y = x W^T, W dequantized on the fly.

Weight layout: the int4 format's stored state (quant/int4.py `Int4Linear._state`): qweight uint8
[N, K / 2], byte j of a row holds codes 2j (low nibble) and 2j + 1 (high nibble); scale and zero
[N, K / group]; W[n, k] = (code - 8) * scale[n, k // group] + zero[n, k // group] (zero is the
value of code 8, as torch's packed CPU kernel has it). Even and odd k are handled as two halves
of the tile, so each byte is loaded once and never interleaved in registers.

Up to 4 activation rows (decode) take `_int4_gemv_kernel`: tiles of whole groups [rows, groups, bytes],
each group's scale and zero loaded once and applied to its partial sum (sum_k x w = s sum_k x (c - 8)
+ z sum_k x), and few output rows per program so that even a 896-row matrix fills an H100/H200's
132 SMs (the GEMM kernel's 16 rows a program gave down_proj 56 programs: 40 us for 4 MiB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import interpreted, next_pow2, round_to


@triton.jit
def _int4_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, o_ptr,
    M, N, K, x_row, qw_row, s_row, o_row, group,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr, DOT: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, mm < M
    n64, m64 = n.to(tl.int64), mm.to(tl.int64)
    dot_ty = tl.float32 if F32_DOT else x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, 2 * BLOCK_KH):
        j = k0 // 2 + tl.arange(0, BLOCK_KH)  # byte index: codes k = 2j, 2j + 1
        j_ok = 2 * j < K
        wm = n_ok[:, None] & j_ok[None, :]
        b = tl.load(qw_ptr + n64[:, None] * qw_row + j[None, :], mask=wm, other=0).to(tl.int32)
        g = (2 * j) // group  # both codes of a byte share a group (group is even)
        sc = tl.load(s_ptr + n64[:, None] * s_row + g[None, :], mask=wm, other=0.0).to(tl.float32)
        zr = tl.load(z_ptr + n64[:, None] * s_row + g[None, :], mask=wm, other=0.0).to(tl.float32)
        w_lo = ((b & 15) - 8).to(tl.float32) * sc + zr  # [BLOCK_N, BLOCK_KH], k = 2j
        w_hi = ((b >> 4) - 8).to(tl.float32) * sc + zr  # k = 2j + 1
        xm = m_ok[:, None] & j_ok[None, :]
        x_ev = tl.load(x_ptr + m64[:, None] * x_row + 2 * j[None, :], mask=xm, other=0.0)
        x_od = tl.load(x_ptr + m64[:, None] * x_row + 2 * j[None, :] + 1, mask=xm, other=0.0)
        if DOT:
            acc += tl.dot(x_ev.to(dot_ty), tl.trans(w_lo.to(dot_ty)), input_precision="ieee")
            acc += tl.dot(x_od.to(dot_ty), tl.trans(w_hi.to(dot_ty)), input_precision="ieee")
        else:
            # GEMV: BLOCK_M == 1, float32 multiply-adds (bandwidth-bound; no tensor cores needed)
            xe, xo = x_ev.to(tl.float32), x_od.to(tl.float32)
            acc += tl.sum(xe[:, None, :] * w_lo[None, :, :] + xo[:, None, :] * w_hi[None, :, :], 2)
    ot = o_ptr.dtype.element_ty
    tl.store(o_ptr + m64[:, None] * o_row + n[None, :], round_to(acc, ot).to(ot), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def int4_gemv_step(
    xe, xo, g, n_groups, qw_ptr, s_ptr, z_ptr, n64, n_ok, qw_row, s_row, HALF_G: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N]: one step's inputs xe, xo [G, HALF_G] (float32: codes 2j and 2j + 1 of groups g [G])
    times the int4 rows n64 of W (masked n_ok), each group's scale and zero applied once to its partial sum
    (sum x w = s sum x (c - 8) + z sum x). Multiply-adds are explicit fma: the same bits whatever a kernel's
    enable_fp_fusion."""
    jj = tl.arange(0, HALF_G)  # bytes of a group
    g_ok = g < n_groups
    byte = g[:, None] * HALF_G + jj[None, :]  # [G, HG]: byte j holds codes k = 2j, 2j + 1
    wm = n_ok[:, None, None] & g_ok[None, :, None]
    b = tl.load(qw_ptr + n64[:, None, None] * qw_row + byte[None, :, :], mask=wm, other=0).to(tl.int32)
    lo = ((b & 15) - 8).to(tl.float32)  # [BN, G, HG]
    hi = ((b >> 4) - 8).to(tl.float32)
    part = tl.sum(tl.fma(lo, xe[None, :, :], hi * xo[None, :, :]), 2)  # [BN, G]: sum x (c - 8) per group
    xsum = tl.sum(xe + xo, 1)  # [G]
    sm = n_ok[:, None] & g_ok[None, :]
    sc = tl.load(s_ptr + n64[:, None] * s_row + g[None, :], mask=sm, other=0.0).to(tl.float32)
    zr = tl.load(z_ptr + n64[:, None] * s_row + g[None, :], mask=sm, other=0.0).to(tl.float32)
    return tl.sum(tl.fma(sc, part, zr * xsum[None, :]), 1)


@triton.jit
def int4_gemv_acc(
    xr_ptr, qw_ptr, s_ptr, z_ptr, n64, n_ok, K, qw_row, s_row,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_G: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N]: one activation row (xr_ptr, K inputs) times the int4 rows n64 of W (masked n_ok)."""
    gi = tl.arange(0, GROUPS)  # groups of this step
    jj = tl.arange(0, HALF_G)
    n_groups = K // (2 * HALF_G)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g = g0 + gi  # [G]
        byte = g[:, None] * HALF_G + jj[None, :]
        xm = (g < n_groups)[:, None]
        xe = tl.load(xr_ptr + 2 * byte, mask=xm, other=0.0).to(tl.float32)
        xo = tl.load(xr_ptr + 2 * byte + 1, mask=xm, other=0.0).to(tl.float32)
        acc += int4_gemv_step(xe, xo, g, n_groups, qw_ptr, s_ptr, z_ptr, n64, n_ok, qw_row, s_row, HALF_G)
    return acc


@triton.jit
def _int4_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, o_ptr,
    N, K, x_row, qw_row, s_row, o_row,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_G: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < N
    acc = int4_gemv_acc(x_ptr + row * x_row, qw_ptr, s_ptr, z_ptr, n.to(tl.int64), n_ok, K, qw_row, s_row,
                        BLOCK_N, GROUPS, HALF_G)  # fmt: skip
    ot = o_ptr.dtype.element_ty
    tl.store(o_ptr + row * o_row + n, round_to(acc, ot).to(ot), mask=n_ok)


def gemv_config(n: int, k: int, group: int, interp: bool) -> dict[str, int] | None:
    """Tiles of `_int4_gemv_kernel` (None where a group's bytes are not a power of two: the GEMM kernel
    runs): 4 output rows a program up to 4096 rows, 8 above; 256 bytes of each row a step, 512 where a row
    holds 1 KiB or more (its loop's steps run one after another: fewer, larger loads hide more latency).
    Under the interpreter, which runs every program in Python at a cost per operation that hardly depends on
    the tile: 2 programs a row where 8 to 128 output rows each make that (the second often partial), so a row
    still spans programs; an output row's sums do not depend on the rows beside it (the same bits at any
    block_n)."""
    half = group // 2
    if half & (half - 1) or half > 512:
        return None
    block_n = min(128, max(8, next_pow2(-(-n // 2)))) if interp else (4 if n <= 4096 else 8)
    step = 512 if k // 2 >= 1024 else 256
    return {"block_n": block_n, "groups": max(1, step // half), "half_g": half, "num_warps": 4}


def int4_config(m: int, interp: bool) -> dict[str, int]:
    """Tiles of `_int4_kernel` for m activation rows. Up to 4 rows: one GEMV program per row (the
    others re-read the weight from L2, not memory); more: tl.dot tiles of 16 or 64 rows."""
    if m <= 4:
        # 128 bytes of K per step: on an H200 (M = 1) down 896x4864 60.8 -> 39.6 us, gate_up 9728x896 20.6 -> 21.9
        return {"block_m": 1, "block_n": 32 if interp else 16, "block_kh": 128, "num_warps": 4}
    block_m = 16 if m <= 16 else 64
    return {"block_m": block_m, "block_n": 32, "block_kh": 64, "num_warps": 8 if block_m == 64 else 4}


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, W the int4 weight (layout in the module docstring).

    Same signature and meaning as kernels.dispatch.int4_matmul_reference. `tile_rows` (deterministic mode's
    16): every program takes that many rows with the tiles a call of exactly that many rows uses, so a row gets
    the bits it would get in such a call whatever the row count; None: tiles chosen by the row count.
    """
    k = x.shape[-1]
    n = qweight.shape[0]
    bad_scales = scale.shape != (n, k // group if group else 0) or zero.shape != scale.shape
    if qweight.shape[1] * 2 != k or group <= 0 or group % 2 or k % group or bad_scales:
        raise InvalidArgument(
            f"int4: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale {tuple(scale.shape)}, group {group}"
        )
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    qweight, scale, zero = qweight.contiguous(), scale.contiguous(), zero.contiguous()
    interp = interpreted(x)
    gv = gemv_config(n, k, group, interp) if m <= 4 and tile_rows is None else None
    if gv is not None:
        _int4_gemv_kernel[(triton.cdiv(n, gv["block_n"]), m)](
            x2, qweight, scale, zero, out, n, k, x2.stride(0), qweight.stride(0), scale.stride(0), out.stride(0),
            BLOCK_N=gv["block_n"], GROUPS=gv["groups"], HALF_G=gv["half_g"], num_warps=gv["num_warps"],
        )  # fmt: skip
        return out.view(*x.shape[:-1], n)
    cfg = int4_config(m if tile_rows is None else tile_rows, interp)
    if tile_rows is not None and cfg["block_m"] != tile_rows:
        raise InvalidArgument(f"int4: tiles of {tile_rows} rows are not a configuration of the kernel")
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int4_kernel[grid](
        x2, qweight, scale, zero, out, m, n, k, x2.stride(0), qweight.stride(0), scale.stride(0), out.stride(0), group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KH=cfg["block_kh"], DOT=block_m > 1,
        F32_DOT=interp or x.dtype == torch.float32, num_warps=cfg["num_warps"], enable_fp_fusion=True,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
