"""Counter-based random streams: a request's noise is a pure function of (seed, step, token id).

Why not a torch.Generator per row: a generator is state that must be advanced in lock-step with
the request, costs one kernel launch per row, and draws different numbers on CPU and CUDA. A
counter-based stream (the idea behind Philox, and what vLLM's newer Gumbel sampler does in Triton)
needs no state beyond (seed, step), is computed for the whole batch in one set of elementwise tensor
ops, and gives bit-identical integers on every device, so a request's tokens cannot depend on which
other rows share its batch.

The exact function, so that a fused kernel can reproduce it bit for bit:

    key            = splitmix64(splitmix64(seed mod 2**64) xor (step mod 2**64))
    k0, k1         = key mod 2**32, key >> 32
    x(token)       = fmix32(fmix32(token xor k0) xor k1)          (murmur3's 32-bit finaliser)
    u(token)       = ((x >> 9) + 0.5) / 2**23                     (exact in float32, in [2**-24, 1 - 2**-24])
    gumbel(token)  = -log(-log(u))                                (float32)

Sampling then takes argmax(logits / temperature + gumbel) over the allowed tokens: the Gumbel-max
trick, equivalent to argmax(probs / Exponential(1)) (the "exponential race").
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from superslm.sampling._device import upload

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

# murmur3 fmix32 multipliers, stored as their negative int64 twins (c - 2**32): x * c then stays
# inside int64 for x < 2**32, and the low 32 bits of the product are the same
_FMIX_C1 = 0x85EBCA6B - (1 << 32)
_FMIX_C2 = 0xC2B2AE35 - (1 << 32)

#: the process RNG that seeds requests which did not bring a seed (seeded from the OS at import)
_PROCESS_RNG = random.Random()


def draw_seed(rng: random.Random | None = None) -> int:
    """A fresh 63-bit seed from `rng` (default: the process RNG), for a request without one."""
    return (rng or _PROCESS_RNG).getrandbits(63)


def splitmix64(x: int) -> int:
    """SplitMix64's mixing step on a Python int (taken mod 2**64); a bijection of 64-bit words."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of token number `step` of the stream `seed` (any Python ints)."""
    key = splitmix64(splitmix64(seed & MASK64) ^ (step & MASK64))
    return key & MASK32, key >> 32


def _fmix32_(x: Tensor) -> Tensor:
    """murmur3's finaliser on an int64 tensor holding values in [0, 2**32), in place."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_FMIX_C1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 13)
    x.mul_(_FMIX_C2).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def random_bits(keys: Tensor, vocab_size: int) -> Tensor:
    """The 32-bit hash x(token) of every token for every row: int64 [R, vocab_size] in [0, 2**32).

    Args:
        keys: int64 [R, 2], each row's (k0, k1) from `stream_key`; its device is the output's.
    """
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    x = tokens.unsqueeze(0) ^ keys[:, :1]  # [R, V]
    _fmix32_(x)
    x.bitwise_xor_(keys[:, 1:2])
    return _fmix32_(x)


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise, float32 [R, vocab_size], as a pure function of each row's keys."""
    x = random_bits(keys, vocab_size)
    # 23 bits + 0.5 fit float32's 24-bit significand: u is exact and never rounds to 0 or 1,
    # so the noise is always finite (a 1.0 would give +inf and win over masked tokens)
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return u.log_().neg_().log_().neg_()


def keys_tensor(seeds_and_steps: list[tuple[int, int]], device: torch.device | str) -> Tensor:
    """int64 [R, 2] keys for a list of (seed, step) pairs, built on the host and moved once."""
    keys = [stream_key(seed, step) for seed, step in seeds_and_steps]
    return upload(torch.tensor(keys, dtype=torch.int64).reshape(-1, 2), device)
