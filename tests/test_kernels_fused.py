"""The fused per-layer kernels (prepare_qkv: bias, q/k norms, RoPE, KV store; gated_act) equal their
torch references, which are the layer's own unfused steps: under TRITON_INTERPRET=1 on the CPU, on the
GPU where present. A layer through the dispatcher's Triton path equals the torch path.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.kernels import dispatch, fused  # noqa: E402
from superslm.kernels.attention import QKVSpec, store_kv  # noqa: E402
from superslm.kernels.norm import rms_norm  # noqa: E402
from superslm.kernels.rope import apply_rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(out: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0) -> None:
    """Equal but for one rounding of the result (float32: a sum's order)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        eps = torch.finfo(ref.dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), atol=eps * 0.05, rtol=eps * ulps)


def qkv_case(n: int, heads: int, kv: int, d: int, rot: int, dtype: torch.dtype, seed: int, bias: bool, norm: bool):
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv) * d
    qkv = torch.randn(n, width + 8, generator=g)[:, 3 : 3 + width]  # a strided view, as a matmul's slice may be
    b = torch.randn(width, generator=g) * 0.5 if bias else None
    qn = torch.rand(d, generator=g) + 0.5 if norm else None
    kn = torch.rand(d, generator=g) + 0.5 if norm else None
    ang = torch.rand(n, rot // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slots = 4 * n + 3
    kc = torch.full((slots, kv, d), 7.0)
    vc = torch.full((slots, kv, d), 7.0)
    mapping = torch.randperm(slots, generator=g)[:n]
    to = lambda t: None if t is None else t.to(DEV, dtype)  # noqa: E731
    return to(qkv), to(b), to(qn), to(kn), to(cos), to(sin), to(kc), to(vc), mapping.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n,heads,kv,d,rot,bias,norm,norm_float",
    [
        (1, 4, 2, 16, 16, False, False, False),  # Llama
        (3, 6, 2, 32, 32, True, False, False),  # Qwen2: qkv bias
        (2, 4, 1, 16, 16, False, True, False),  # Qwen3: q/k norms
        (2, 2, 1, 32, 32, False, True, True),  # Gemma-3: norms with the weight in float32
        (3, 3, 3, 24, 12, True, True, False),  # partial rotary, head_dim not a power of two
    ],
)
def test_prepare_qkv(n, heads, kv, d, rot, bias, norm, norm_float, dtype) -> None:
    case = qkv_case(n, heads, kv, d, rot, dtype, n * 7 + d, bias, norm)
    qkv, b, qn, kn, cos, sin, kc, vc, mapping = case
    kc2, vc2 = kc.cpu().clone(), vc.cpu().clone()
    q = tk.prepare_qkv(qkv, QKVSpec(heads, kv, b, qn, kn, 1e-6, norm_float), cos, sin, kc, vc, mapping)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    ref = fused.prepare_qkv(qkv.cpu(), QKVSpec(heads, kv, cpu(b), cpu(qn), cpu(kn), 1e-6, norm_float), cos.cpu(),
                            sin.cpu(), kc2, vc2, mapping.cpu())  # fmt: skip
    close(q.cpu(), ref)
    close(kc.cpu(), kc2)
    close(vc.cpu(), vc2)


def test_prepare_qkv_reference_is_the_layer_steps() -> None:
    """The reference is what Layer.forward did step by step before the fusion."""
    qkv, b, qn, kn, cos, sin, kc, vc, mapping = (t.cpu() if t is not None else None
                                                 for t in qkv_case(3, 4, 2, 16, 16, torch.bfloat16, 1, True, True))
    kc2, vc2 = kc.clone(), vc.clone()
    q = fused.prepare_qkv(qkv, QKVSpec(4, 2, b, qn, kn, 1e-6, False), cos, sin, kc, vc, mapping)
    x = qkv + b
    q2, k2, v2 = x[:, :64].view(3, 4, 16), x[:, 64:96].view(3, 2, 16), x[:, 96:].view(3, 2, 16)
    q2, k2 = apply_rope(rms_norm(q2, qn, 1e-6), cos, sin), apply_rope(rms_norm(k2, kn, 1e-6), cos, sin)
    store_kv(kc2, vc2, k2, v2, mapping)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_prepare_qkv_padding_rows_store_nothing() -> None:
    """Rows past slot_mapping (deterministic mode's padding) and negative slots (graph padding) write no slot."""
    qkv, b, qn, kn, cos, sin, kc, vc, mapping = qkv_case(4, 4, 2, 16, 16, torch.float32, 3, False, False)
    mapping = torch.tensor([5, -1, 9], device=DEV)  # the fourth row is past the mapping
    kc_before, kc2, vc2 = kc.clone(), kc.clone(), vc.clone()
    q = tk.prepare_qkv(qkv, QKVSpec(4, 2, None, None, None, 1e-6, False), cos, sin, kc, vc, mapping)
    assert q.shape == (4, 4, 16)
    changed = (kc != kc_before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [5, 9]
    plain = QKVSpec(4, 2)
    fused.prepare_qkv(qkv, plain, cos, sin, kc2, vc2, mapping[mapping >= 0][:1])
    fused.prepare_qkv(qkv[2:3], plain, cos[2:3], sin[2:3], kc2, vc2, mapping[2:])
    close(kc, kc2)  # slot 9 holds row 2's key, not the padding row's
    close(vc, vc2)
    # no row at all to store
    tk.prepare_qkv(qkv, QKVSpec(4, 2, None, None, None, 1e-6, False), cos, sin, kc, vc, mapping[:0])


def test_prepare_qkv_mixed_dtypes_take_the_reference() -> None:
    """A float32 norm weight beside bf16 activations promotes in torch: the kernel hands such calls over."""
    qkv, b, qn, kn, cos, sin, kc, vc, mapping = qkv_case(2, 4, 2, 16, 16, torch.bfloat16, 4, False, True)
    qn32, kn32 = qn.float(), kn.float()
    kc2, vc2 = kc.clone(), vc.clone()
    q = tk.prepare_qkv(qkv, QKVSpec(4, 2, None, qn32, kn32, 1e-6, False), cos, sin, kc, vc, mapping)
    ref = fused.prepare_qkv(qkv, QKVSpec(4, 2, None, qn32, kn32, 1e-6, False), cos, sin, kc2, vc2, mapping)
    assert q.dtype == ref.dtype == torch.float32
    assert torch.equal(q, ref) and torch.equal(kc, kc2)
    # padding rows (slot -1, as graph steps pad) write nothing there either
    before = kc.clone()
    spec = QKVSpec(4, 2, None, qn32, kn32, 1e-6, False)
    tk.prepare_qkv(qkv, spec, cos, sin, kc, vc, torch.tensor([-1, -1], device=DEV))
    assert torch.equal(kc, before)


@pytest.mark.parametrize("act", fused.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 96), (3, 1100)])  # 1100: past one 1024 block, not a power of two
def test_gated_act(act: str, dtype: torch.dtype, n: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter + n)
    gu = (torch.randn(n, 2 * inter, generator=g) * 3).to(DEV, dtype)
    out = tk.gated_act(gu, act)
    ref = fused.gated_act(gu.cpu(), act)
    close(out.cpu(), ref, ulps=2.0)  # the activation's float32 transcendental, then two roundings


def test_dispatch_picks_the_fused_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    gu = torch.randn(2, 64).to(DEV)
    calls = []
    monkeypatch.setattr(tk, "gated_act", lambda *a: calls.append("triton") or fused.gated_act(*a))
    monkeypatch.setenv(dispatch.ENV, "triton")
    dispatch.gated_act(gu, "silu")
    monkeypatch.setenv(dispatch.ENV, "torch")
    dispatch.gated_act(gu, "silu")
    assert calls == ["triton"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_families_through_the_kernels(family: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt and decode steps of each family through the Triton kernels (qkv bias folded into prepare_qkv,
    q/k norms, Gemma-3's post norms and gelu, the residual carried into the next norm): the torch path's
    logits and transformers' greedy tokens."""
    import superslm
    from superslm import Request, Sampling
    from tests.tiny_models import build_hf_model, hf_greedy

    hf = build_hf_model(family, tmp_path)
    model = superslm.load(tmp_path, device=DEV.type, dtype="fp32")
    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = {}
    for kind in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV, kind)
        engine = model.engine(slots=2, context=64, page_size=4, graphs=False)
        (done,) = engine.generate([Request(prompt, 6, Sampling(ignore_eos=True, logprobs=0))])
        out[kind] = done
    assert out["triton"].tokens == out["torch"].tokens == hf_greedy(hf, prompt, 6)
    # a hook on the qkv module sees its input on the Triton path too (calibration watches it)
    seen: list[int] = []
    handle = model.net.layers[0].qkv.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        model.engine(slots=1, context=32, page_size=4, graphs=False).generate([Request(prompt, 1)])
    finally:
        handle.remove()
    assert seen == [len(prompt)]
    lp = {k: [p.logprob for p in v.logprobs] for k, v in out.items()}
    assert len(lp["torch"]) == 6
    torch.testing.assert_close(torch.tensor(lp["triton"]), torch.tensor(lp["torch"]), atol=1e-4, rtol=1e-4)
