"""A decode step's attention kernel doing prepare_qkv's work itself (kernels/triton/paged_attention.py, `prep`):
q heads in registers, each row's k and v stored by the program that reads them first. It equals prepare_qkv's
kernel followed by the attention kernel (bit for bit under TRITON_INTERPRET=1: the same arithmetic), caches
included, and the torch reference (kernels.fused.prepare_attention); tiny models on the Triton path run one
launch fewer a layer a decode step and compute what they computed before.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.kernels import dispatch, fused  # noqa: E402
from superslm.kernels.attention import AttnMetadata  # noqa: E402
from tests.test_kernels_triton import make_step  # noqa: E402

pa = sys.modules["superslm.kernels.triton.paged_attention"]

# (kv_heads, groups, head_dim, bias, q/k norms, norm weight in float32, rotary dims): Qwen2.5 (bias), Qwen3
# (q/k norms), Gemma-3 (norms, weight in float32, head_dim 256), partial rotary (dims past it pass through)
VARIANTS = {
    "qwen2": (2, 7, 64, True, False, False, 64),
    "qwen3": (2, 2, 128, False, True, False, 128),
    "gemma3": (1, 4, 256, False, True, True, 256),
    "partial": (1, 3, 32, False, False, False, 16),
}


def operands(variant: str, dtype: torch.dtype, padding: bool, seed: int = 0):
    kv_heads, groups, head_dim, has_bias, norms, wf, rot = VARIANTS[variant]
    meta, _, kc, vc = make_step([1, 1, 1, 1], [1, 8, 9, 45], 8, kv_heads, groups, head_dim, dtype, seed=seed)
    if padding:  # a graph's padding row: slot -1, no key to read
        meta = AttnMetadata(torch.cat([meta.positions, meta.positions.new_zeros(1)]),
                            torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((1,), -1)]),
                            (*meta.query_start, meta.query_start[-1] + 1), (*meta.seq_lens, 0),
                            (*meta.block_tables, ()), meta.page_size)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    n, heads = meta.query_start[-1], kv_heads * groups
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(n, width, generator=g).to(DEV, dtype)
    bias = (torch.randn(width, generator=g) * 0.5).to(DEV, dtype) if has_bias else None
    qn = kn = None
    if norms:
        wdt = torch.float32 if wf else dtype
        qn = (1 + torch.randn(head_dim, generator=g) * 0.3).to(DEV, wdt)
        kn = (1 + torch.randn(head_dim, generator=g) * 0.3).to(DEV, wdt)
    angle = torch.rand(n, rot, generator=g) * 6
    cos, sin = angle.cos().to(DEV, dtype), angle.sin().to(DEV, dtype)
    return meta, kc, vc, (qkv, bias, heads, kv_heads, qn, kn, 1e-6, wf, cos, sin), 1 / math.sqrt(head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits,window,padding", [(1, None, False), (3, None, True), (2, 7, False)])
def test_decode_attention_prepares_its_own_inputs(dtype, variant, splits, window, padding) -> None:
    meta, kc, vc, prep_in, scale = operands(variant, dtype, padding)
    qkv, bias, heads, kv_heads, qn, kn, eps, wf, cos, sin = prep_in
    args = tk.paged_args(meta, DEV)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = tk.prepare_qkv(*prep_in, kc1, vc1, meta.slot_mapping)
    want = tk.paged_attention_args(q, kc1, vc1, args, window, scale, num_splits=splits)
    prep = pa.Prep(bias, qn, kn, eps, wf, cos, sin, meta.slot_mapping)
    got = tk.paged_attention_args(qkv, kc2, vc2, args, window, scale, num_splits=splits, prep=prep)
    if ON_GPU:  # the same arithmetic but for fused multiply-adds in the attention
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    else:
        assert torch.equal(got, want)
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)  # every row's k and v stored, nothing else
    assert not torch.equal(kc2, kc)
    if padding:
        assert torch.equal(got[-1].float(), torch.zeros_like(got[-1].float()))
    # the torch reference: prepare_qkv's steps, then the attention over what they stored
    kc3, vc3 = kc.clone().cpu(), vc.clone().cpu()
    m = meta.query_start[-1] - padding  # the reference has no padding rows (its store takes no slot -1)
    cpu_in = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in prep_in)
    cpu_in = (cpu_in[0][:m], *cpu_in[1:8], cpu_in[8][:m], cpu_in[9][:m])
    s = len(meta.seq_lens) - padding
    cpu_meta = AttnMetadata(meta.positions[:m].cpu(), meta.slot_mapping[:m].cpu(), meta.query_start[: s + 1],
                            meta.seq_lens[:s], meta.block_tables[:s], meta.page_size)  # fmt: skip
    ref = fused.prepare_attention(*cpu_in, kc3, vc3, cpu_meta, window, scale)
    got = got[:m]
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # the q/k norms' sums in another order: the stored keys within a rounding
    torch.testing.assert_close(kc2.cpu(), kc3, **tol)
    assert torch.equal(vc2.cpu(), vc3)
    torch.testing.assert_close(got.cpu(), ref, **tol)


def test_steps_with_prompt_rows_prepare_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a prompt chunk: prepare_qkv's kernel, then the attention kernel (the store must precede
    every program's reads); the same result as the reference."""
    called: list[int] = []
    real = pa.prepare_qkv
    monkeypatch.setattr(pa, "prepare_qkv", lambda *a: called.append(1) or real(*a))
    meta, _, kc, vc = make_step([3, 1], [7, 10], 4, 2, 2, 64, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(4, 8 * 64, generator=g).to(DEV)
    angle = torch.rand(4, 64, generator=g)
    prep_in = (qkv, None, 4, 2, None, None, 1e-6, False, angle.cos().to(DEV), angle.sin().to(DEV))
    kc1, vc1 = kc.clone(), vc.clone()
    got = tk.prepare_attention(*prep_in, kc1, vc1, meta, None, 0.125)
    assert called == [1]
    kc2, vc2 = kc.clone().cpu(), vc.clone().cpu()
    cpu_meta = AttnMetadata(meta.positions.cpu(), meta.slot_mapping.cpu(), meta.query_start, meta.seq_lens,
                            meta.block_tables, meta.page_size)  # fmt: skip
    ref = fused.prepare_attention(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in prep_in), kc2, vc2,
                                  cpu_meta, None, 0.125)  # fmt: skip
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(kc1.cpu(), kc2)


# Llama fp32; Qwen2 bf16 with graphs (bias); Qwen3 fp32 (q/k norms); Gemma-3 bf16 (sliding windows, norms)
@pytest.mark.parametrize("family,dtype,graphs", [("llama", "fp32", False), ("qwen2", "bf16", True),
                                                 ("qwen3", "fp32", True), ("gemma3", "bf16", False)])  # fmt: skip
def test_a_model_prepares_inside_its_decode_attention(family, dtype, graphs, tmp_path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the Triton path, decode steps launch no prepare_qkv kernel (prompt steps do); logprobs and tokens are
    those of prepare_qkv's kernel followed by the attention (bit for bit under the interpreter)."""
    import superslm
    from superslm import Request, Sampling
    from tests.tiny_models import build_hf_model

    build_hf_model(family, tmp_path)
    model = superslm.load(tmp_path, device=DEV, dtype=dtype)
    monkeypatch.setenv(dispatch.ENV, "triton")
    calls: list[int] = []
    real = pa.prepare_qkv
    monkeypatch.setattr(pa, "prepare_qkv", lambda *a: calls.append(1) or real(*a))
    fused_fn = tk.prepare_attention

    def apart(qkv, bias, heads, kv_heads, qn, kn, eps, nf, cos, sin, kc, vc, meta, window, scale):  # type: ignore[no-untyped-def]
        q = pa.prepare_qkv(qkv, bias, heads, kv_heads, qn, kn, eps, nf, cos, sin, kc, vc, meta.slot_mapping)
        return tk.paged_attention(q, kc, vc, meta, window, scale)

    prompt = [5, 17, 99, 3, 250, 41, 7]
    out = {}
    for name, fn in (("fused", fused_fn), ("apart", apart)):
        monkeypatch.setattr(tk, "prepare_attention", fn)
        calls.clear()
        engine = model.engine(slots=2, context=64, page_size=4, graphs=graphs)
        done = engine.generate([Request(prompt, 6, Sampling(ignore_eos=True, logprobs=0)),
                                Request(prompt[:3], 5, Sampling(ignore_eos=True, logprobs=0))])  # fmt: skip
        out[name] = (done, len(calls))
    layers = len(model.net.layers)
    assert out["fused"][1] < out["apart"][1]
    assert out["fused"][1] % layers == 0 and out["fused"][1] <= 2 * layers  # the prompt steps only
    for a, b in zip(out["fused"][0], out["apart"][0], strict=True):
        assert a.tokens == b.tokens
        lp = [torch.tensor([p.logprob for p in r.logprobs]) for r in (a, b)]
        if ON_GPU:
            torch.testing.assert_close(lp[0], lp[1], atol=1e-3, rtol=1e-3)
        else:
            assert torch.equal(lp[0], lp[1])
