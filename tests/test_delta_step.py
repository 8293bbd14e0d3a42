"""The fused decode step of the gated delta rule (kernels/cpu/delta_step.cpp) against its torch twin
(kernels/delta_rule.py decode_step_reference): outputs, states updated in place, batch invariance, bad inputs."""

from __future__ import annotations

import pytest
import torch

from superslm import cext
from superslm.kernels import delta_rule

EXT = cext.extension()
needs_ext = pytest.mark.skipif(EXT is None or not hasattr(EXT, "delta_decode_step"),
                               reason="the C++ extension is not built here")

TAPS = 4


def _layer(k_heads: int, k_dim: int, v_heads: int, v_dim: int, dtype: torch.dtype, slots: int, seed: int):
    """Random weights and states of one layer: (conv_weight, norm_weight, conv_state, ssm_state)."""
    gen = torch.Generator().manual_seed(seed)
    c = 2 * k_heads * k_dim + v_heads * v_dim
    conv_weight = (torch.randn(c, TAPS, generator=gen) * 0.5).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(v_dim, generator=gen)).to(dtype)
    conv_state = torch.randn(slots, c, TAPS - 1, generator=gen).to(dtype)
    ssm_state = torch.randn(slots, v_heads, k_dim, v_dim, generator=gen) * 0.1
    return conv_weight, norm_weight, conv_state, ssm_state


def _rows(b: int, k_heads: int, k_dim: int, v_heads: int, v_dim: int, dtype: torch.dtype, seed: int):
    """Random rows of one step: (mixed, z, g, beta); mixed and z are column slices of one projection, as the layer
    splits them."""
    gen = torch.Generator().manual_seed(seed)
    c, vw = 2 * k_heads * k_dim + v_heads * v_dim, v_heads * v_dim
    proj = torch.randn(b, c + vw + 2 * v_heads, generator=gen).to(dtype)
    mixed, z, bb, a = torch.split(proj, [c, vw, v_heads, v_heads], dim=1)
    beta = torch.sigmoid(bb)
    g = -torch.rand(v_heads, generator=gen).exp() * torch.nn.functional.softplus(a.float())
    return mixed, z, g, beta


def _fused(*args) -> torch.Tensor:
    mixed, z, g, beta, conv_weight, conv_state, ssm_state, slots, norm_weight, eps, kh, kd, vh, vd = args
    ids = torch.tensor(slots, dtype=torch.long)
    return EXT.delta_decode_step(mixed, z, g, beta, conv_weight, conv_state, ssm_state, ids, norm_weight, eps,
                                 kh, kd, vh, vd)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a bf16 rounding or two where a float intermediate lands next to a rounding boundary
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-3)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 32, 4, 32), (2, 64, 4, 64), (1, 128, 2, 128), (4, 32, 4, 64)])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_fused_step_equals_the_torch_twin(dtype: torch.dtype, heads: tuple[int, int, int, int], b: int) -> None:
    kh, kd, vh, vd = heads
    n_slots = 11
    slots = [9, 2, 5, 0, 7, 10, 3, 6][:b]  # not a run, not in order
    conv_weight, norm_weight, conv_state, ssm_state = _layer(kh, kd, vh, vd, dtype, n_slots, seed=b)
    conv_state[slots[0]].zero_()  # one sequence starts from zeros
    ssm_state[slots[0]].zero_()
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    for step in range(3):  # later steps start from states the earlier steps wrote
        mixed, z, g, beta = _rows(b, kh, kd, vh, vd, dtype, seed=100 * b + step)
        common = (mixed, z, g, beta, conv_weight)
        tail = (slots, norm_weight, 1e-6, kh, kd, vh, vd)
        got = _fused(*common, conv_state, ssm_state, *tail)
        want = delta_rule.decode_step_reference(*common, ref_conv, ref_ssm, *tail)
        assert got.dtype == dtype and got.shape == (b, vh * vd)
        _close(got, want, dtype)
        _close(conv_state, ref_conv, dtype)
        torch.testing.assert_close(ssm_state, ref_ssm, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3)
        # the reference took the fused states' values after the first step: each step compares one step's work
        ref_conv.copy_(conv_state)
        ref_ssm.copy_(ssm_state)
    untouched = [s for s in range(n_slots) if s not in slots]
    fresh = _layer(kh, kd, vh, vd, dtype, n_slots, seed=b)
    assert torch.equal(conv_state[untouched], fresh[2][untouched])
    assert torch.equal(ssm_state[untouched], fresh[3][untouched])


@needs_ext
def test_mixed_weight_dtypes_equal_the_torch_twin() -> None:
    """A bf16 model with float32 conv and norm weights (and the reverse) rounds where the twin rounds."""
    kh, kd, vh, vd = 2, 32, 4, 32
    for dtype, wdtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        conv_weight, norm_weight, conv_state, ssm_state = _layer(kh, kd, vh, vd, dtype, 4, seed=3)
        conv_weight, norm_weight = conv_weight.to(wdtype), norm_weight.to(wdtype)
        ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
        mixed, z, g, beta = _rows(3, kh, kd, vh, vd, dtype, seed=4)
        tail = ([3, 0, 1], norm_weight, 1e-6, kh, kd, vh, vd)
        got = _fused(mixed, z, g, beta, conv_weight, conv_state, ssm_state, *tail)
        want = delta_rule.decode_step_reference(mixed, z, g, beta, conv_weight, ref_conv, ref_ssm, *tail)
        _close(got, want, torch.bfloat16)
        torch.testing.assert_close(ssm_state, ref_ssm, rtol=1e-4, atol=1e-3)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    kh, kd, vh, vd = 2, 64, 4, 64
    conv_weight, norm_weight, conv_state, ssm_state = _layer(kh, kd, vh, vd, dtype, 8, seed=5)
    mixed, z, g, beta = _rows(8, kh, kd, vh, vd, dtype, seed=6)
    slots = [4, 1, 7, 0, 6, 2, 5, 3]
    conv_a, ssm_a = conv_state.clone(), ssm_state.clone()
    batched = _fused(mixed, z, g, beta, conv_weight, conv_a, ssm_a, slots, norm_weight, 1e-6, kh, kd, vh, vd)
    for i in (0, 3, 7):
        conv_b, ssm_b = conv_state.clone(), ssm_state.clone()
        r = slice(i, i + 1)
        alone = _fused(mixed[r], z[r], g[r], beta[r], conv_weight, conv_b, ssm_b, [slots[i]], norm_weight, 1e-6,
                       kh, kd, vh, vd)
        assert torch.equal(alone[0], batched[i])
        assert torch.equal(conv_b[slots[i]], conv_a[slots[i]])
        assert torch.equal(ssm_b[slots[i]], ssm_a[slots[i]])


@needs_ext
def test_bad_inputs_raise() -> None:
    kh, kd, vh, vd = 2, 32, 4, 32
    conv_weight, norm_weight, conv_state, ssm_state = _layer(kh, kd, vh, vd, torch.float32, 4, seed=7)
    mixed, z, g, beta = _rows(2, kh, kd, vh, vd, torch.float32, seed=8)
    good = [mixed, z, g, beta, conv_weight, conv_state, ssm_state, [0, 1], norm_weight, 1e-6, kh, kd, vh, vd]
    _fused(*good)
    bad = {
        0: mixed[:, 1:],  # a column short
        1: z.to(torch.bfloat16),  # not mixed's dtype
        2: g.double(),
        3: beta[:1],  # a row short
        4: conv_weight[:, :1],  # one tap
        5: conv_state.transpose(1, 2),  # not [S, C, K - 1]
        6: ssm_state.to(torch.bfloat16),
        7: [0, 9],  # out of range
        8: norm_weight[:-1],
        13: vd + 1,
    }
    for i, value in bad.items():
        args = list(good)
        args[i] = value
        with pytest.raises(RuntimeError, match="delta_decode_step"):
            _fused(*args)
    args = list(good)
    args[7] = [1, 1]
    with pytest.raises(RuntimeError, match="given twice"):
        _fused(*args)
    # the wrapper takes the twin for what the C++ step refuses rather than failing
    z_rows = z.to(torch.bfloat16)
    args = list(good)
    args[1] = z_rows
    assert not delta_rule._fused_layout(*args)


def test_decode_step_without_the_extension_is_the_twin(monkeypatch) -> None:
    """Where the extension is off, decode_step is its torch twin, bit for bit."""
    kh, kd, vh, vd = 2, 32, 4, 32
    conv_weight, norm_weight, conv_state, ssm_state = _layer(kh, kd, vh, vd, torch.float32, 4, seed=9)
    mixed, z, g, beta = _rows(2, kh, kd, vh, vd, torch.float32, seed=10)
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    tail = ([2, 0], norm_weight, 1e-6, kh, kd, vh, vd)
    monkeypatch.setattr(cext, "extension", lambda: None)
    got = delta_rule.decode_step(mixed, z, g, beta, conv_weight, conv_state, ssm_state, *tail)
    want = delta_rule.decode_step_reference(mixed, z, g, beta, conv_weight, ref_conv, ref_ssm, *tail)
    assert torch.equal(got, want) and torch.equal(conv_state, ref_conv) and torch.equal(ssm_state, ref_ssm)
