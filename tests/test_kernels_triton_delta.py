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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 32), (1, 2, 32, 16)])
def test_prompt_kernels_are_the_steps_row_after_row(dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int) -> None:
    """A prompt's T rows in one call give each row what T decode-step kernel calls give, bit for bit, and leave the
    same states; within float32 sums of the torch reference; other slots untouched; a prompt cut in two pieces
    the same as whole."""
    mixed, z, gate, beta, conv_w, conv_state, ssm_state, norm_w = _inputs(dtype, 7, hk, hv, dk, dv, seed=3)
    slot = 2
    steps_conv, steps_ssm = conv_state.clone(), ssm_state.clone()
    want = torch.cat([tk.delta_decode_step(mixed[t:t + 1], z[t:t + 1], gate[t:t + 1], beta[t:t + 1], conv_w,
                                           steps_conv, steps_ssm, [slot], norm_w, 1e-6, hk, dk, hv, dv)
                      for t in range(7)])
    got_conv, got_ssm = conv_state.clone(), ssm_state.clone()
    got = tk.delta_prompt_rows(mixed, z, gate, beta, conv_w, got_conv, got_ssm, slot, norm_w, 1e-6, hk, dk, hv, dv)
    assert torch.equal(got, want)
    assert torch.equal(got_conv, steps_conv) and torch.equal(got_ssm, steps_ssm)
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    ref = torch.cat([delta_rule.decode_step_reference(mixed[t:t + 1], z[t:t + 1], gate[t:t + 1], beta[t:t + 1],
                                                      conv_w, ref_conv, ref_ssm, [slot], norm_w, 1e-6, hk, dk, hv, dv)
                     for t in range(7)])
    torch.testing.assert_close(got_ssm, ref_ssm, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert ((got.float() - ref.float()).abs() <= ref.float().abs().clamp_min(1e-3) * 2**-6).all()
    others = [s for s in range(conv_state.shape[0]) if s != slot]
    assert torch.equal(got_conv[others], conv_state[others]) and torch.equal(got_ssm[others], ssm_state[others])
    cut_conv, cut_ssm = conv_state.clone(), ssm_state.clone()
    parts = [tk.delta_prompt_rows(mixed[a:b], z[a:b], gate[a:b], beta[a:b], conv_w, cut_conv, cut_ssm, slot, norm_w,
                                  1e-6, hk, dk, hv, dv) for a, b in ((0, 3), (3, 7))]
    assert torch.equal(torch.cat(parts), got) and torch.equal(cut_ssm, got_ssm)


def test_deterministic_prompts_take_the_prompt_kernels(tmp_path, monkeypatch) -> None:
    """Deterministic mode on the Triton backend reads a hybrid model's prompt rows through the prompt kernels (one
    call a layer and sequence, not a step a token): its greedy tokens and logprobs those of the torch backend's
    deterministic mode, and the same whether the prompt is read in one chunk or several."""
    from superslm.engine import Request
    from superslm.model import load
    from superslm.sampling import Sampling
    from tests.tiny_models import build_hf_model

    build_hf_model("qwen3_5", tmp_path)
    model = load(str(tmp_path), device=DEV, dtype=torch.float32)
    requests = [Request(list(range(5, 29)), 3, Sampling(logprobs=0))]

    def run(**kw: int) -> list[tuple[list[int], list[float]]]:
        engine = model.engine(slots=1, context=64, prefix_caching=False, deterministic=True, **kw)
        return [(o.tokens, [lp.logprob for lp in o.logprobs]) for o in engine.generate(requests)]

    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    want = run()
    monkeypatch.setenv("SUPERSLM_KERNELS", "triton")
    calls = []
    real = tk.delta_prompt_rows
    monkeypatch.setattr(tk, "delta_prompt_rows", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    got = run()
    assert calls and max(calls) > 1, "the prompt rows did not take the prompt kernels"
    chunked = run(chunk=8)
    assert got == chunked  # deterministic: the same bits however the prompt was cut
    for (gt, glp), (wt, wlp) in zip(got, want, strict=True):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(glp), torch.tensor(wlp), atol=1e-4, rtol=0)


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
