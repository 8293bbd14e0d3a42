"""A rotated int4 linear's input made inside its GEMV: (add +) norm or the MLP's activation, the linear's cast,
padding and Hadamard rotation in the prologue of the int4 GEMV, one launch where norm_rotate.py's kernels and
int4_gemv.py's took two. References: kernels.fused.norm_rotate_int4 and gated_act_rotate_int4 (same signatures).

At a few rows every program of a row makes the part of the row's rotated input that each GEMV step needs, in
registers: a step covers RB whole rotation blocks (512 or 1024 inputs, whole groups), made as
kernels/triton/norm_rotate.py rounds them and rotated by butterflies (`fwht_rows`), then split into the even and
odd inputs that the int4 bytes' two nibbles multiply (`int4_gemv_step`, shared with int4_gemv.py). The norm's sum
of squares takes a first pass over the row; the programs of the first column write the new residual (to its own
buffer: every program still reads the old one). Each program repeats the prologue for its row (the row is read
from cache); nothing is shared between programs. Results equal the two kernels' but for the order of the norm's
float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superslm.kernels import fused as ref
from superslm.kernels.norm import norm_dtype
from superslm.kernels.triton._util import FLOATS, interpreted, round_to
from superslm.kernels.triton.fused import gated_value
from superslm.kernels.triton.hadamard import h_scale, rotated_input
from superslm.kernels.triton.int4_gemv import gemv_config, int4_gemv_step, int4_matmul
from superslm.kernels.triton.norm_rotate import gated_act_rotate, norm_rotate, rotation_ok
from superslm.kernels.triton.rmsnorm import normalized

#: most activation rows the fused kernel takes (the int4 GEMV's own limit; more rows run the two kernels)
MAX_ROWS = 4


@triton.jit
def _rotate_int4_kernel(
    x_ptr, r_ptr, nw_ptr, sg_ptr, ro_ptr, qw_ptr, sc_ptr, z_ptr, o_ptr,
    x_row, r_row, width, k, eps, hs, N, qw_row, s_row, o_row,
    GATED: tl.constexpr, ADD: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, NORM_ROUND: tl.constexpr,
    ACT: tl.constexpr, RB: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HALF_G: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    xt = x_ptr.dtype.element_ty
    ot = o_ptr.dtype.element_ty  # the linear's compute dtype
    tile = tl.arange(0, RB)[:, None] * B + tl.arange(0, B)[None, :]  # [RB, b]: a step's input offsets
    # width: the norm's dim, or the activation's inputs (gate_up's half); inputs past it up to k are padding
    inv = 0.0
    if not GATED:
        # pass 1: the row's sum of squares (the programs of the first column write the new residual)
        writes = (tile * 0 + pid) == 0  # a scalar condition in a mask trips the interpreter
        ss = tl.zeros([RB, B], tl.float32)
        for c0 in range(0, width, RB * B):
            c = c0 + tile
            m = c < width
            v = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
            if ADD:
                v = round_to(v + tl.load(r_ptr + row * r_row + c, mask=m, other=0.0).to(tl.float32), xt)
                tl.store(ro_ptr + row * width + c, v.to(xt), mask=m & writes)
            ss += v * v
        inv = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(ss, 1), 0) / width + eps)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)
    gi = tl.arange(0, GROUPS)
    n_groups = k // (2 * HALF_G)
    acc = tl.zeros([BLOCK_N], tl.float32)
    # pass 2: each GEMV step's rotated inputs (RB * b of them: GROUPS whole groups), then its multiply-adds
    for c0 in range(0, k, RB * B):
        c = c0 + tile
        m = c < width
        if GATED:
            g = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + row * x_row + width + c, mask=m, other=0.0).to(tl.float32)
            y = gated_value(g, u, ACT, xt)
        else:
            v = tl.load(x_ptr + row * x_row + c, mask=m, other=0.0).to(tl.float32)
            if ADD:
                v = round_to(v + tl.load(r_ptr + row * r_row + c, mask=m, other=0.0).to(tl.float32), xt)
            w = tl.load(nw_ptr + c, mask=m, other=0.0).to(tl.float32)
            y = normalized(v, inv, w, xt, WEIGHT_IN_FLOAT, NORM_ROUND)
        # [RB, b]: the linear's input, 0 past k
        h = rotated_input(y, tl.load(sg_ptr + c, mask=c < k, other=0.0).to(tl.float32), hs, ot, RB, B, LOG_B)
        xe, xo = tl.split(tl.reshape(h, [GROUPS, HALF_G, 2]))  # [G, HG]: inputs 2j and 2j + 1 of each byte j
        acc += int4_gemv_step(xe, xo, c0 // (2 * HALF_G) + gi, n_groups, qw_ptr, sc_ptr, z_ptr, n64, n_ok,
                              qw_row, s_row, HALF_G)  # fmt: skip
    tl.store(o_ptr + row * o_row + n, round_to(acc, ot).to(ot), mask=n_ok)


def rotate_gemv_config(k: int, n: int, block: int, group: int, interp: bool) -> dict[str, int] | None:
    """Tiles of `_rotate_int4_kernel`: the int4 GEMV's (`gemv_config`; None where it has none), whose step of
    2 * groups * half_g inputs (512 or more: whole groups) is RB whole rotation blocks."""
    gv = gemv_config(n, k, group, interp)
    if gv is None or (2 * gv["groups"] * gv["half_g"]) % block:
        return None
    return {**gv, "rb": 2 * gv["groups"] * gv["half_g"] // block}


def _fits(x: torch.Tensor, width: int, signs: torch.Tensor, block: int, dtype: torch.dtype,
          w4: ref.Int4Weight) -> bool:  # fmt: skip
    """Whether the fused kernel takes these operands: 1 to MAX_ROWS dense 2-d rows, float dtypes, a rotation
    `rotation_ok` takes, and an int4 weight over the rotation's k inputs in the GEMV's layout."""
    k, n = signs.shape[0], w4.qweight.shape[0]
    return (
        x.dtype in FLOATS and dtype in FLOATS and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1 and rotation_ok(width, signs, block)
        and w4.group > 0 and w4.group % 2 == 0 and k % w4.group == 0 and w4.qweight.shape == (n, k // 2)
        and w4.scale.shape == (n, k // w4.group) and w4.zero.shape == w4.scale.shape
    )  # fmt: skip


def _launch(x, residual, nw, signs, block, dtype, w4, width, cfg, gated, act, eps, weight_in_float):  # type: ignore[no-untyped-def]
    """Launch `_rotate_int4_kernel`: (out [rows, N] in dtype, the new residual or None)."""
    rows, k, n = x.shape[0], signs.shape[0], w4.qweight.shape[0]
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    qw, sc, zr = w4.qweight.contiguous(), w4.scale.contiguous(), w4.zero.contiguous()
    _rotate_int4_kernel[(triton.cdiv(n, cfg["block_n"]), rows)](
        x, residual if residual is not None else x, nw, signs.to(x.device).contiguous(),
        res_out if res_out is not None else out, qw, sc, zr, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, width, k, float(eps), h_scale(block, dtype),
        n, qw.stride(0), sc.stride(0), out.stride(0),
        GATED=gated, ADD=residual is not None, WEIGHT_IN_FLOAT=weight_in_float,
        NORM_ROUND=not gated and norm_dtype(x.dtype, nw.dtype, weight_in_float) == x.dtype,
        ACT=ref.ACTIVATIONS.index(act) if gated else 0, RB=cfg["rb"], B=block, LOG_B=block.bit_length() - 1,
        BLOCK_N=cfg["block_n"], GROUPS=cfg["groups"], HALF_G=cfg["half_g"], num_warps=cfg["num_warps"],
        enable_fp_fusion=False,  # the references' roundings, step by step
    )  # fmt: skip
    return out, res_out


def norm_rotate_int4(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
    w4: ref.Int4Weight,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same signature and meaning as kernels.fused.norm_rotate_int4, one launch at up to MAX_ROWS rows.

    Operands the fused kernel does not take run `norm_rotate`'s kernel, then `int4_matmul`'s."""
    dim = x.shape[-1]
    cfg = None
    ok = residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    if ok and _fits(x, dim, signs, block, dtype, w4) and weight.shape == (dim,):
        cfg = rotate_gemv_config(signs.shape[0], w4.qweight.shape[0], block, w4.group, interpreted(x))
    if cfg is None:
        xr, h = norm_rotate(x, residual, weight, eps, weight_in_float, signs, block, dtype)
        return int4_matmul(xr, *w4), h
    return _launch(x, residual, weight.contiguous(), signs, block, dtype, w4, dim, cfg, False, None, eps,
                   weight_in_float)  # fmt: skip


def gated_act_rotate_int4(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype, w4: ref.Int4Weight
) -> torch.Tensor:
    """Same signature and meaning as kernels.fused.gated_act_rotate_int4, one launch at up to MAX_ROWS rows.

    Operands the fused kernel does not take run `gated_act_rotate`'s kernel, then `int4_matmul`'s."""
    inter = gate_up.shape[-1] // 2
    cfg = None
    if act in ref.ACTIVATIONS and gate_up.shape[-1] % 2 == 0 and _fits(gate_up, inter, signs, block, dtype, w4):
        cfg = rotate_gemv_config(signs.shape[0], w4.qweight.shape[0], block, w4.group, interpreted(gate_up))
    if cfg is None:
        return int4_matmul(gated_act_rotate(gate_up, act, signs, block, dtype), *w4)
    return _launch(gate_up, None, signs, signs, block, dtype, w4, inter, cfg, True, act, 0.0, False)[0]
