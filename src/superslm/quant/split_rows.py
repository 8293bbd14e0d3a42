"""Activation rows split per group of 32 into two int8 parts (kernels/cpu/vnni.h split_groups: x ~ sl (254 hi + lo),
~15 significant bits) and the torch twins of the kernels built on that split: the int5 kernels' (quant/int5.py)
and the AVX2 prompt kernel for weights whose values are int8 (kernels/cpu/avx2_rows.cpp pair_rows: IQ4's table
values, int8 codes), bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c of float32 tensors rounded once, as the kernels' FMA: the product is exact in float64, and the
    sum's rounding to float64 and then float32 differs from one rounding only on an exact float32 halfway point."""
    return (a.double() * b.double() + c.double()).float()


def split_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of kernels/cpu/vnni.h split_groups for rows x float32 [M, K] in groups of 32 -> (hi, lo int64 [M, K],
    sum of each group float32 [M, G], its low part's scale float32 [M, G], whether each row splits bool [M])."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)  # [M, G, 32]
    gsum = torch.zeros(m, k // 32)
    for i in range(32):  # the kernels' order: one element after the other, in float32
        gsum = gsum + xg[..., i]
    amax = xg.abs().amax(-1)
    sq = xg.double() ** 2
    rest = (sq.sum(-1) - amax.double() ** 2).clamp(min=0) / 31
    zero = (xg == 0).all(-1)
    ok = torch.isfinite(xg).all(-1) & (amax >= 1e-30) & ~((rest > 0) & (amax.double() ** 2 > 4096 * rest))
    ok = (ok | zero).all(-1)
    sh = torch.where(zero, torch.ones_like(amax), amax / 127)[..., None]  # an all-zero group: zero parts
    sl = sh / 254
    qh = torch.round(xg / sh).clamp(-127, 127)
    # x - qh sh: GCC contracts it to one FMA (C++ allows it by default), rounded once
    ql = torch.round(_fma(-qh, sh.expand_as(qh), xg) / sl).clamp(-127, 127)
    gsl = torch.where(zero, torch.zeros_like(amax), sl[..., 0])
    return qh.long().view(m, k), ql.long().view(m, k), gsum, gsl, ok


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c of float32 tensors rounded once to float32, as the FMA instruction does (finite values)."""
    p = a.double() * b.double()  # exact: 24 + 24 significant bits
    cd = c.double()
    s = p + cd
    bv = s - p
    e = (p - (s - bv)) + (cd - bv)  # TwoSum: s + e == p + c exactly
    r = s.float()
    # rounding s once more is rounding p + c, except where s lies halfway between two floats: then e's sign says
    # on which side of that halfway point p + c lies
    rd = r.double()
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    dn = torch.nextafter(r, torch.full_like(r, float("-inf")))
    half_up = (s > rd) & (2 * (s - rd) == up.double() - rd) & (e > 0)
    half_dn = (s < rd) & (2 * (rd - s) == rd - dn.double()) & (e < 0)
    return torch.where(half_up, up, torch.where(half_dn, dn, r))


def pair_rows_reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                        declined: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The torch twin of kernels/cpu/avx2_rows.cpp pair_rows, bit for bit: x [M, K] times the weight scale * values
    (values integers [N, K] within int8's range, scales float32 [N, K / 32]) -> [M, N] bf16. Each row rounded to
    bf16 and split (`split_groups`), per output and group the exact integer sum of the values times 254 hi + lo
    rounded once to float32, then per group in order y = fma(scale, sum * sl, y). Rows that do not split (a NaN, an
    inf, an outlier) get `declined(their rows as bf16)`, as the kernel hands them to its caller's fallback."""
    xf = x.to(torch.bfloat16).float().cpu()
    m, k = xf.shape
    n, g = values.shape[0], k // 32
    hi, lo, _, gsl, ok = split_groups(xf)
    x16 = (254 * hi + lo).view(m, g, 32)
    comb = torch.einsum("mgk,ngk->mng", x16, values.cpu().long().view(n, g, 32)).float()  # exact in int64, rounded
    s = scales.cpu().float()
    y = torch.zeros(m, n)
    for j in range(g):
        y = fma32(s[:, j].expand(m, n), comb[..., j] * gsl[:, j : j + 1], y)
    out = y.to(torch.bfloat16)
    if not ok.all():
        out[~ok] = declined(x[~ok].to(torch.bfloat16).cpu()).to(torch.bfloat16)
    return out


def int8_prompt_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's int8_prompt_avx2: x [M, K] times int8 codes [N, K] with a bf16 scale [N]
    -> [M, N] bf16 (`pair_rows_reference`; rows that do not split take torch's int8 kernel, as the kernel's)."""
    n, k = codes.shape
    return pair_rows_reference(x, codes, scale.cpu().float()[:, None].expand(n, k // 32),
                               lambda rows: torch._weight_int8pack_mm(rows, codes.cpu(), scale.cpu()))
