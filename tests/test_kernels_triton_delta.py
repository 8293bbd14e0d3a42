"""The gated delta rule's decode-row kernels (kernels/triton/delta_rule.py) equal their torch reference
(kernels/delta_rule.py decode_step_reference): outputs and both states, float32 and bf16, grouped key heads,
slots out of order; and `decode_step` takes them on the Triton backend. Under TRITON_INTERPRET=1 on the CPU, on
the GPU where present. Small shapes: the interpreter runs each program in Python."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.kernels import delta_rule  # noqa: E402


def _inputs(dtype: torch.dtype, b: int, hk: int, hv: int, dk: int, dv: int, taps: int = 4, slots: int = 6,
            seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    mixed = r(b, c).to(dtype)
    z = r(b, hv * dv).to(dtype)
    gate = -torch.rand(b, hv, generator=g) * 0.5  # float32 log decay
    beta = torch.rand(b, hv, generator=g).to(dtype)
    conv_w = r(c, taps, scale=0.5).to(dtype)
    conv_state = r(slots, c, taps - 1).to(dtype)
    ssm_state = r(slots, hv, dk, dv, scale=0.1)
    norm_w = (1 + r(dv, scale=0.1)).to(dtype)
    return [t.to(DEV) for t in (mixed, z, gate, beta, conv_w, conv_state, ssm_state)] + [norm_w.to(DEV)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 32), (1, 2, 32, 16), (2, 4, 16, 16)])
def test_kernels_equal_the_reference(dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int) -> None:
    mixed, z, gate, beta, conv_w, conv_state, ssm_state, norm_w = _inputs(dtype, 3, hk, hv, dk, dv)
    slots = [4, 1, 2]
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    want = delta_rule.decode_step_reference(mixed, z, gate, beta, conv_w, ref_conv, ref_ssm, slots, norm_w, 1e-6,
                                            hk, dk, hv, dv)
    got = tk.delta_decode_step(mixed, z, gate, beta, conv_w, conv_state, ssm_state, slots, norm_w, 1e-6,
                               hk, dk, hv, dv)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(conv_state, ref_conv)  # the window shifted, the new inputs stored as they are
    torch.testing.assert_close(ssm_state, ref_ssm, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one bf16 rounding apart at most, where a float32 sum's order moved a value across a rounding edge
        ulp = want.float().abs().clamp_min(1e-3) * 2**-7
        assert ((got.float() - want.float()).abs() <= ulp).all()
    untouched = [s for s in range(conv_state.shape[0]) if s not in slots]
    assert torch.equal(conv_state[untouched], _inputs(dtype, 3, hk, hv, dk, dv)[5][untouched])


def test_decode_step_takes_the_kernels_on_the_triton_backend(monkeypatch) -> None:
    args = _inputs(torch.float32, 2, 2, 2, 16, 16)
    mixed, z, gate, beta, conv_w, conv_state, ssm_state, norm_w = args
    monkeypatch.setenv("SUPERSLM_KERNELS", "triton")
    calls = []
    real = tk.delta_decode_step
    monkeypatch.setattr(tk, "delta_decode_step", lambda *a: calls.append(1) or real(*a))
    want = delta_rule.decode_step_reference(mixed, z, gate, beta, conv_w, conv_state.clone(), ssm_state.clone(),
                                            [0, 3], norm_w, 1e-6, 2, 16, 2, 16)
    got = delta_rule.decode_step(mixed, z, gate, beta, conv_w, conv_state, ssm_state, [0, 3], norm_w, 1e-6,
                                 2, 16, 2, 16)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a layout the kernels do not take (repeated slots) runs the reference instead
    calls.clear()
    delta_rule.decode_step(mixed, z, gate, beta, conv_w, conv_state, ssm_state, [1, 1], norm_w, 1e-6, 2, 16, 2, 16)
    assert calls == []


@pytest.mark.slow
def test_a_hybrid_model_decodes_on_the_triton_backend(tmp_path, monkeypatch) -> None:
    """A tiny Qwen3.5 (delta-rule and gated attention layers) through the engine with every kernel on the Triton
    backend: its greedy tokens and logprobs those of the torch backend, the delta-rule decode rows on the kernels."""
    from superslm.engine import Request
    from superslm.model import load
    from superslm.sampling import Sampling
    from tests.tiny_models import build_hf_model

    build_hf_model("qwen3_5", tmp_path)
    model = load(str(tmp_path), device=DEV, dtype=torch.float32)
    requests = [Request(list(range(5, 40)), 6, Sampling(logprobs=0)),
                Request(list(range(7, 20)), 6, Sampling(logprobs=0))]

    def run() -> list[tuple[list[int], list[float]]]:
        engine = model.engine(slots=2, context=128, prefix_caching=False)
        return [(o.tokens, [lp.logprob for lp in o.logprobs]) for o in engine.generate(requests)]

    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    want = run()
    monkeypatch.setenv("SUPERSLM_KERNELS", "triton")
    calls = []
    real = tk.delta_decode_step
    monkeypatch.setattr(tk, "delta_decode_step", lambda *a: calls.append(1) or real(*a))
    got = run()
    assert calls, "the delta-rule decode rows did not take the kernels"
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(glp), torch.tensor(wlp), atol=1e-4, rtol=0)
