"""The kernels whose work the threads take in turn (kernels/cpu/dynamic_for.h: the Q6_K GEMV, the AVX2 int4 GEMV, the
delta-rule decode step): on two threads every output has the bits of the one-thread run, at shapes of many chunks
and of fewer chunks than threads, and the states are updated alike."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from superslm import cext
from superslm.quant.int4 import Int4Linear

EXT = cext.extension()
pytestmark = pytest.mark.skipif(EXT is None or os.environ.get("SUPERSLM_CPU_KERNELS") == "0",
                                reason="the C++ extension is not built here")


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """torch.set_num_threads for one test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _same_on_one_and_two(threads: Callable[[int], None], run: Callable[[], torch.Tensor]) -> torch.Tensor:
    threads(1)
    alone = run()
    threads(2)
    split = run()
    assert torch.equal(_bits(split), _bits(alone))
    return split


def _q6k_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q6_K blocks [n, k / 256 * 210] with a small positive f16 d (bytes 208..209 of each block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8, generator=g)
    d = torch.full((n, k // 256), 1e-3, dtype=torch.float16).view(torch.uint8).view(n, k // 256, 2)
    blocks[:, :, 208:] = d
    return blocks.view(n, -1).contiguous()


@pytest.mark.skipif(EXT is None or not EXT.q6k_available(), reason="the Q6_K GEMV is not built here")
@pytest.mark.parametrize("n,k", [(40000, 256), (3000, 1024), (7, 512)])
def test_q6k_gemv_split_has_the_one_thread_bits(threads, n: int, k: int) -> None:
    blocks = _q6k_blocks(n, k, seed=n)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 5, 16):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = _same_on_one_and_two(threads, lambda x=x: EXT.q6k_gemv(x, blocks))
        assert y.shape == (rows, n)


@pytest.mark.skipif(EXT is None or not EXT.q80_available(), reason="the Q8_0 GEMV is not built here")
@pytest.mark.parametrize("n,k", [(40001, 256), (3000, 1024), (7, 640)])
def test_q80_gemv_split_has_the_one_thread_bits(threads, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    d = torch.full((n, k // 32), 1e-3, dtype=torch.float16)
    for rows in (1, 5, 16):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = _same_on_one_and_two(threads, lambda x=x: EXT.q80_gemv(x, codes, d))
        assert y.shape == (rows, n)


@pytest.mark.skipif(EXT is None or not EXT.avx2_available(), reason="the AVX2 GEMV is not built here")
@pytest.mark.parametrize("n,k", [(8192, 256), (2048, 1024), (64, 512)])
def test_int4_gemv_split_has_the_one_thread_bits(threads, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    m = Int4Linear.from_dense(torch.randn(n, k, generator=g), group=32)
    x = torch.randn(1, m.k_pad, generator=g).bfloat16()
    y = _same_on_one_and_two(threads, lambda: EXT.int4_gemv_avx2(x, m.qweight, m.scales_zeros, 32, 0))
    assert y is not None and y.shape == (1, n)


@pytest.mark.parametrize("b", [1, 3, 16])
def test_delta_step_split_has_the_one_thread_bits(threads, b: int) -> None:
    kh, kd, vh, vd, taps, slots = 2, 32, 4, 16, 4, 16
    g = torch.Generator().manual_seed(b)
    c = 2 * kh * kd + vh * vd
    conv_weight = torch.randn(c, taps, generator=g).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(vd, generator=g)).bfloat16()
    conv0 = torch.randn(slots, c, taps - 1, generator=g).bfloat16()
    ssm0 = torch.randn(slots, vh, kd, vd, generator=g) * 0.1
    mixed = torch.randn(b, c, generator=g).bfloat16()
    z = torch.randn(b, vh * vd, generator=g).bfloat16()
    gate = -torch.rand(b, vh, generator=g)
    beta = torch.rand(b, vh, generator=g).bfloat16()
    ids = torch.randperm(slots, generator=g)[:b].contiguous()
    states = []

    def run() -> torch.Tensor:
        conv, ssm = conv0.clone(), ssm0.clone()
        states.append((conv, ssm))
        return EXT.delta_decode_step(mixed, z, gate, beta, conv_weight, conv, ssm, ids, norm_weight, 1e-6, kh, kd,
                                     vh, vd)

    _same_on_one_and_two(threads, run)
    (conv_a, ssm_a), (conv_b, ssm_b) = states
    assert torch.equal(conv_a.view(torch.int16), conv_b.view(torch.int16)) and torch.equal(ssm_a, ssm_b)
    assert not torch.equal(ssm_a, ssm0)  # the rows of `ids` were stepped
