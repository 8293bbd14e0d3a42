"""Device-side sampling: logits shaping and token selection, one program per row, no host sync.

Two kernels, each with the signature and meaning of its torch reference in sampling/on_device.py
(`shape_logits_reference`, `select_tokens_reference`), which run superslm.sampling's own stages:

- `shape_logits`: grammar bitmask, logit_bias, repetition/frequency/presence penalties, then the
  temperature (greedy rows are left undivided), in the sampler's order, tile by tile.
- `select_tokens`: greedy rows take the first argmax; sampled rows apply min_p, top_k, top_p and
  take the Gumbel race argmax(x + gumbel(seed, step, token)) of sampling/noise.py.

top_k and top_p need an order statistic. Each is found by a radix-16 search over the float32
values' order-preserving integer keys (8 passes of 16 thresholds over the row): top_k's k-th
largest value, and the value v* of top_p's last kept token, with the mass above it; tokens tied at
v* are then kept in token-id order, as the reference's stable sort does. The kept masses are
summed in float64 in another order than the reference's cumsum, so a nucleus cut could differ only
where a partial sum ties the limit to float64 rounding.

exp and log come from libdevice on the GPU (the CUDA / ROCm math library torch's kernels use); the
interpreter has numpy's, which differ from torch's CPU ones in the last bit: there a token can
differ from the reference's only where two noisy logits, or a mass and the top_p limit, are that
close.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from superslm.errors import InvalidArgument
from superslm.kernels.triton._util import interpreted

if TYPE_CHECKING:
    from superslm.kernels.sampling_args import LogitBias, Penalties

#: sampling.params.GREEDY_EPS: rows whose temperature is below it are greedy
GREEDY_EPS: tl.constexpr = tl.constexpr(1e-5)
#: a search bound below every float32 key (keys are int32)
KEY_LO: tl.constexpr = tl.constexpr(-(2**31) - 1)


@triton.jit
def _exp(x, LIBM: tl.constexpr):
    if LIBM:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBM: tl.constexpr):
    if LIBM:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _key(x):
    """int64 keys whose order is float32 x's order; -0.0 and +0.0 share key 0 (they compare equal)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _unkey(k):
    """The float32 value of an int64 key from `_key` (the map is its own inverse on int32 bits)."""
    b = k.to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _fmix32(h):
    # murmur3's finaliser on uint32 (multiplies wrap mod 2**32), as sampling/noise.py's _fmix32_
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _gumbel(cols, k0, k1, LIBM: tl.constexpr):
    """sampling.noise.gumbel_noise for token ids `cols` of the stream with keys (k0, k1), uint32."""
    h = _fmix32(_fmix32(cols.to(tl.uint32) ^ k0) ^ k1)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: exact, in (0, 1)
    return -_log(-_log(u, LIBM), LIBM)


@triton.jit
def _shape_kernel(
    l_ptr, t_ptr, o_ptr, bm_ptr, bo_ptr, bt_ptr, bv_ptr, pr_ptr, c_ptr, pm_ptr, f_ptr,
    V, l_row, words, c_row,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PEN: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(t_ptr + row)
    # greedy rows keep their penalised logits (their argmax); x / 1 is exact
    temp = tl.where(temp >= GREEDY_EPS, temp, 1.0)
    b0, b1 = 0, 0
    if HAS_BIAS:
        b0 = tl.load(bo_ptr + row)
        b1 = tl.load(bo_ptr + row + 1)
    prow = -1
    presence, frequency, repetition = 0.0, 0.0, 1.0
    if HAS_PEN:
        prow = tl.load(pr_ptr + row).to(tl.int64)
        presence = tl.load(f_ptr + row * 3)
        frequency = tl.load(f_ptr + row * 3 + 1)
        repetition = tl.load(f_ptr + row * 3 + 2)
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(l_ptr + row * l_row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            # one int32 word per 32 tokens, bit j = token 32 w + j; tokens past 32 * words pass
            w = tl.load(bm_ptr + row * words + cols // 32, mask=ok & (cols < 32 * words), other=-1)
            x = tl.where(((w >> (cols % 32)) & 1) == 0, float("-inf"), x)
        if HAS_BIAS:
            # the row's (token, bias) pairs, BLOCK_B at a time, matched against the tile's ids
            for j0 in range(b0, b1, BLOCK_B):
                jj = j0 + tl.arange(0, BLOCK_B)
                tok = tl.load(bt_ptr + jj, mask=jj < b1, other=-1)
                val = tl.load(bv_ptr + jj, mask=jj < b1, other=0.0)
                hit = cols[:, None] == tok[None, :]
                add = tl.sum(tl.where(hit, val[None, :], 0.0), 1)  # one pair at most per token
                x = tl.where(tl.max(hit.to(tl.int32), 1) > 0, x + add, x)
        if HAS_PEN:
            if prow >= 0:
                cnt = tl.load(c_ptr + prow * c_row + cols, mask=ok, other=0)
                in_prompt = tl.load(pm_ptr + prow * c_row + cols, mask=ok, other=0) != 0
                in_out = cnt > 0
                rep = tl.where(in_out | in_prompt, repetition, 1.0)
                x = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
                x = x - frequency * cnt.to(tl.float32)
                x = x - presence * in_out.to(tl.float32)
        x = tl.math.div_rn(x, temp)  # torch's x / t is correctly rounded; triton's `/` is not
        tl.store(o_ptr + row * V + cols, x, mask=ok)


@triton.jit
def _filtered(base, cols, ok, top, lmp, kth):
    """The tile after min_p and top_k (dropped tokens -inf), as the reference's stages leave it."""
    x = tl.load(base + cols, mask=ok, other=float("-inf"))
    x = tl.where((x - top) < lmp, float("-inf"), x)
    return tl.where(_key(x) < kth, float("-inf"), x)


@triton.jit
def _kth_key(base, V, top, lmp, k, BLOCK: tl.constexpr):
    """Key of the k-th largest value after min_p: the largest key t with count(key >= t) >= k."""
    j16 = tl.arange(0, 16).to(tl.int64)
    lo = tl.full([], KEY_LO, tl.int64)  # count(key >= lo) = V >= k; at lo + 2**32, 0 < k
    step = tl.full([], 1 << 28, tl.int64)
    for _ in range(8):
        t = lo + j16 * step
        cnt = tl.zeros([16], tl.int32)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < V
            kk = _key(_filtered(base, cols, ok, top, lmp, KEY_LO))
            cnt += tl.sum(((kk[:, None] >= t[None, :]) & ok[:, None]).to(tl.int32), 0)
        lo += (tl.sum((cnt >= k).to(tl.int64), 0) - 1) * step  # counts fall with t: a prefix holds
        step = step // 16
    return lo


@triton.jit
def _top_p_cut(base, V, top, lmp, kth, top_p, LIBM: tl.constexpr, BLOCK: tl.constexpr):
    """(v*, G(v*), p(v*), limit): top_p's last kept value as a key, the mass above it, its mass,
    and top_p * total. G(t) = sum of exp(x - top) over key > t (float64); v* = min t, G(t) < limit."""
    j16 = tl.arange(0, 16).to(tl.int64)
    lo = tl.full([], KEY_LO, tl.int64)  # G(lo) = total >= limit; G(lo + 2**32) = 0 < limit
    step = tl.full([], 1 << 28, tl.int64)
    g_hi = tl.zeros([], tl.float64)
    limit = tl.zeros([], tl.float64)
    for i in range(8):
        t = lo + j16 * step
        g = tl.zeros([16], tl.float64)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < V
            x = _filtered(base, cols, ok, top, lmp, kth)
            p = tl.where(ok, _exp(x - top, LIBM).to(tl.float64), 0.0)
            g += tl.sum(tl.where(_key(x)[:, None] > t[None, :], p[:, None], 0.0), 0)
        if i == 0:
            limit = top_p.to(tl.float64) * tl.sum(tl.where(j16 == 0, g, 0.0), 0)  # G(KEY_LO): the total
        n = tl.sum((g >= limit).to(tl.int64), 0)  # G falls with t: thresholds 0..n-1 hold
        g_hi = tl.where(n < 16, tl.sum(tl.where(j16 == n, g, 0.0), 0), g_hi)
        lo += (n - 1) * step
        step = step // 16
    v = lo + 1
    return v, g_hi, _exp(_unkey(v) - top, LIBM).to(tl.float64), limit


@triton.jit
def _race(base, f_ptr, V, top, lmp, kth, v, g_v, q, limit, k0, k1,
          WRITE: tl.constexpr, LIBM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The final pass: keep what min_p, top_k and top_p keep, then argmax(x + gumbel), first on ties."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    run = tl.zeros([], tl.int32)  # tokens tied at v* in earlier tiles
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < V
        x = _filtered(base, cols, ok, top, lmp, kth)
        kk = _key(x)
        tie = ((kk == v) & ok).to(tl.int32)
        before = run + tl.cumsum(tie, 0) - tie  # the reference ranks ties by token id
        keep = (kk > v) | ((tie != 0) & (g_v + before.to(tl.float64) * q < limit))
        x = tl.where(keep, x, float("-inf"))
        run += tl.sum(tie, 0)
        if WRITE:
            tl.store(f_ptr + cols, x, mask=ok)
        z = tl.where(ok, x + _gumbel(cols, k0, k1, LIBM), float("-inf"))
        m, j = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best
        best_i = tl.where(better, c0 + j, best_i)
        best = tl.where(better, m, best)
    return best_i


@triton.jit
def _select_kernel(
    x_ptr, t_ptr, mp_ptr, k_ptr, p_ptr, key_ptr, tok_ptr, f_ptr, V, l_row,
    WRITE: tl.constexpr, LIBM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * l_row
    # pass 1: the row's max (min_p's and top_p's reference) and first argmax (greedy rows' token)
    top = tl.full([], float("-inf"), tl.float32)
    first = tl.zeros([], tl.int32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
        m, j = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        first = tl.where(m > top, c0 + j, first)
        top = tl.maximum(m, top)
    sampled = tl.load(t_ptr + row) >= GREEDY_EPS
    lmp = tl.where(sampled, tl.load(mp_ptr + row), float("-inf"))
    k = tl.load(k_ptr + row)
    top_p = tl.load(p_ptr + row)
    # "off" stages keep every token: a threshold key below every key
    kth = tl.full([], KEY_LO, tl.int64)
    v = tl.full([], KEY_LO, tl.int64)
    g_v = tl.zeros([], tl.float64)
    q = tl.zeros([], tl.float64)
    limit = tl.zeros([], tl.float64)
    if sampled & (k > 0) & (k < V):
        kth = _kth_key(base, V, top, lmp, k, BLOCK)
    if sampled & (top_p < 1.0):
        v, g_v, q, limit = _top_p_cut(base, V, top, lmp, kth, top_p, LIBM, BLOCK)
    k0 = tl.load(key_ptr + row * 2).to(tl.uint32)
    k1 = tl.load(key_ptr + row * 2 + 1).to(tl.uint32)
    token = first
    if WRITE:
        # greedy rows pass through unfiltered (every threshold off)
        chosen = _race(base, f_ptr + row * V, V, top, lmp, kth, v, g_v, q, limit, k0, k1, WRITE, LIBM, BLOCK)
        token = tl.where(sampled, chosen, first)
    else:
        if sampled:
            token = _race(base, f_ptr, V, top, lmp, kth, v, g_v, q, limit, k0, k1, WRITE, LIBM, BLOCK)
    tl.store(tok_ptr + row, token.to(tl.int64))


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise InvalidArgument(f"logits must be [rows, vocab], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _per_row(t: torch.Tensor, n: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    if t.shape != (n,):
        raise InvalidArgument(f"{name} must be [{n}], got {tuple(t.shape)}")
    return t.to(dtype).contiguous()


def shape_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bias: LogitBias | None = None,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """Shaped float32 [B, V] logits: bitmask, logit_bias, penalties, temperature (sampler order).

    Same signature and meaning as sampling.on_device.shape_logits_reference.
    """
    x = _rows(logits)
    n, vocab = x.shape
    temp = _per_row(temperature, n, "temperature", torch.float32)
    out = torch.empty(n, vocab, dtype=torch.float32, device=x.device)
    if n == 0 or vocab == 0:
        return out
    words, c_row = 0, 0
    bm = bo = bt = bv = pr = cnt = pm = fac = temp  # placeholders the kernel never reads
    if bitmask is not None:
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != n:
            raise InvalidArgument(f"bitmask must be int32 [{n}, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
        bm, words = bitmask.contiguous(), bitmask.shape[1]
    if bias is not None:
        offsets, tokens, values = bias
        if offsets.shape != (n + 1,) or tokens.shape != values.shape:
            raise InvalidArgument(f"logit bias offsets {tuple(offsets.shape)} do not fit {n} rows")
        bo, bt, bv = offsets.to(torch.int32), tokens.to(torch.int32), values.to(torch.float32).contiguous()
    if penalties is not None:
        rows, counts, prompt_mask, factors = penalties
        if counts.shape != prompt_mask.shape or counts.shape[1:] != (vocab,) or factors.shape != (n, 3):
            raise InvalidArgument(f"penalty counts {tuple(counts.shape)} / factors {tuple(factors.shape)} do not fit")
        pr = _per_row(rows, n, "penalty rows", torch.int32)
        cnt, pm = counts.to(torch.int32).contiguous(), prompt_mask.contiguous().view(torch.uint8)
        fac, c_row = factors.to(torch.float32).contiguous(), vocab
    interp = interpreted(x)
    _shape_kernel[(n,)](
        x, temp, out, bm, bo, bt, bv, pr, cnt, pm, fac, vocab, x.stride(0), words, c_row,
        HAS_MASK=bitmask is not None, HAS_BIAS=bias is not None, HAS_PEN=penalties is not None,
        BLOCK=256 if interp else 1024, BLOCK_B=16, num_warps=4,
        enable_fp_fusion=False,  # x - f * count rounds the product first, as torch does
    )  # fmt: skip
    return out


def select_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    log_min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [B]: each row's next token from shaped logits (greedy argmax, or filtered Gumbel race).

    Same signature and meaning as sampling.on_device.select_tokens_reference.
    """
    x = _rows(logits.to(torch.float32))
    n, vocab = x.shape
    tokens = torch.zeros(n, dtype=torch.int64, device=x.device)
    if n == 0 or vocab == 0:
        return tokens
    temp = _per_row(temperature, n, "temperature", torch.float32)
    lmp = _per_row(log_min_p, n, "log_min_p", torch.float32)
    ks = _per_row(top_k.clamp(min=0, max=vocab), n, "top_k", torch.int32)
    tp = _per_row(top_p, n, "top_p", torch.float32)
    if keys.shape != (n, 2):
        raise InvalidArgument(f"keys must be [{n}, 2], got {tuple(keys.shape)}")
    if filtered is not None and (filtered.shape != (n, vocab) or filtered.dtype != torch.float32
                                 or not filtered.is_contiguous()):  # fmt: skip
        raise InvalidArgument(f"filtered must be a contiguous float32 [{n}, {vocab}] tensor")
    interp = interpreted(x)
    _select_kernel[(n,)](
        x, temp, lmp, ks, tp, keys.to(torch.int64).contiguous(), tokens, filtered if filtered is not None else x,
        vocab, x.stride(0), WRITE=filtered is not None, LIBM=not interp, BLOCK=256 if interp else 512,
        num_warps=4 if interp else 8, enable_fp_fusion=False,
    )  # fmt: skip
    return tokens
