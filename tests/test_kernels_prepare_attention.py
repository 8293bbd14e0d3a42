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
from superslm.kernels.attention import AttnMetadata, QKVSpec  # noqa: E402
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


def with_spec(prep_in, window: int | None = None, scale: float = 1.0) -> tuple:  # type: ignore[no-untyped-def]
    """operands' (qkv, bias, heads, kv_heads, q_norm, k_norm, eps, norm_float, cos, sin) as the kernels take
    them: (qkv, QKVSpec, cos, sin)."""
    qkv, bias, heads, kv_heads, qn, kn, eps, wf, cos, sin = tuple(prep_in)
    return qkv, QKVSpec(heads, kv_heads, bias, qn, kn, eps, wf, window, scale), cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits,window,padding", [(1, None, False), (3, None, True), (2, 7, False)])
def test_decode_attention_prepares_its_own_inputs(dtype, variant, splits, window, padding) -> None:
    meta, kc, vc, prep_in, scale = operands(variant, dtype, padding)
    qkv, bias, heads, kv_heads, qn, kn, eps, wf, cos, sin = prep_in
    args = tk.paged_args(meta, DEV)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = tk.prepare_qkv(*with_spec(prep_in), kc1, vc1, meta.slot_mapping)
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
    ref = fused.prepare_attention(*with_spec(cpu_in, window, scale), kc3, vc3, cpu_meta)
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
    got = tk.prepare_attention(*with_spec(prep_in, None, 0.125), kc1, vc1, meta)
    assert called == [1]
    kc2, vc2 = kc.clone().cpu(), vc.clone().cpu()
    cpu_meta = AttnMetadata(meta.positions.cpu(), meta.slot_mapping.cpu(), meta.query_start, meta.seq_lens,
                            meta.block_tables, meta.page_size)  # fmt: skip
    cpu_in = (t.cpu() if isinstance(t, torch.Tensor) else t for t in prep_in)
    ref = fused.prepare_attention(*with_spec(cpu_in, None, 0.125), kc2, vc2, cpu_meta)
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(kc1.cpu(), kc2)


# Llama fp32; Qwen2 bf16 with graphs (bias); Qwen3 fp32 (q/k norms); Gemma-3 bf16 (sliding windows, norms)
@pytest.mark.parametrize("family,dtype,graphs", [("llama", "fp32", False), ("qwen2", "bf16", True),
                                                 ("qwen3", "fp32", True), ("gemma3", "bf16", False)])  # fmt: skip
def test_a_model_prepares_inside_its_decode_attention(family, dtype, graphs, tmp_path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the Triton path, decode steps launch no prepare_qkv kernel (prompt steps do); logprobs and tokens are
    those of prepare_qkv's kernel followed by the attention (to float32 rounding)."""
    import superslm
    from superslm import Request, Sampling
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model(family, tmp_path, spec=two_layers(family))
    model = superslm.load(tmp_path, device=DEV, dtype=dtype)
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, "0")  # the o projection apart: its GEMV would take the attention
    calls: list[int] = []
    real = pa.prepare_qkv
    monkeypatch.setattr(pa, "prepare_qkv", lambda *a: calls.append(1) or real(*a))
    fused_fn = tk.prepare_attention

    def apart(qkv, spec, cos, sin, kc, vc, meta):  # type: ignore[no-untyped-def]
        q = pa.prepare_qkv(qkv, spec, cos, sin, kc, vc, meta.slot_mapping)
        return tk.paged_attention(q, kc, vc, meta, spec.window, spec.scale)

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
        # the kernels agree bit for bit (the tests above); a whole model's logprobs need not: its fp32 GEMMs
        # (torch's on the CPU) round by their operands' memory alignment, which varies from run to run
        tol = 1e-3 if ON_GPU else 1e-5
        torch.testing.assert_close(lp[0], lp[1], atol=tol, rtol=tol)


al = sys.modules["superslm.kernels.triton.attention_linear"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits,padding", [(1, False), (3, True), (2, False)])
def test_the_o_projection_merges_the_key_splits(dtype, variant, splits, padding, monkeypatch) -> None:
    """attention_linear: with key splits, the o projection's GEMV merges them. With an identity o weight every
    output is one exact product: the merged attention, bit for bit as the merge kernel makes it; with a random
    weight, the attention and torch's matmul up to the sums' order, and the torch reference."""
    monkeypatch.setattr(pa, "_num_splits", lambda *a: splits)
    launched: list[int] = []
    real = al._merge_gemv_kernel

    class Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(1)
            return real[grid]

    monkeypatch.setattr(al, "_merge_gemv_kernel", Spy())
    meta, kc, vc, prep_in, scale = operands(variant, dtype, padding, seed=2)
    heads, head_dim = prep_in[2], kc.shape[-1]
    n = meta.query_start[-1]
    eye = torch.eye(heads * head_dim, dtype=dtype, device=DEV)
    kc1, vc1 = kc.clone(), vc.clone()
    attn = tk.prepare_attention(*with_spec(prep_in, None, scale), kc1, vc1, meta).reshape(n, -1)
    kc2, vc2 = kc.clone(), vc.clone()
    got = tk.attention_linear(*with_spec(prep_in, None, scale), kc2, vc2, meta, eye)
    assert torch.equal(got, attn) and torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    # a float32 norm weight beside bf16 activations: prepare_qkv's kernel first, then the attention and matmul
    fits = pa.prep_for(*with_spec(prep_in), kc, vc, meta, tk.paged_args(meta, DEV)) is not None
    assert fits == (variant != "gemma3" or dtype == torch.float32)
    assert len(launched) == (splits > 1 and fits)
    w = (torch.randn(48, heads * head_dim, generator=torch.Generator().manual_seed(3)) / head_dim).to(DEV, dtype)
    got = tk.attention_linear(*with_spec(prep_in, None, scale), kc.clone(), vc.clone(), meta, w)
    want = torch.nn.functional.linear(attn, w)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_a_model_merges_its_key_splits_in_the_o_projection(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2 (fp32) with two key splits a decode step: no merge launch at <= 4 rows (the o GEMV merges),
    the same tokens and logprobs (up to the sums' order) as the attention's merge and torch's matmul."""
    import superslm
    from superslm import Request, Sampling
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model("qwen2", tmp_path, spec=two_layers("qwen2"))
    model = superslm.load(tmp_path, device=DEV, dtype="fp32")
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setattr(pa, "_num_splits", lambda *a: 2)
    merges: list[int] = []
    real = pa._merge_kernel

    class Spy:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            merges.append(1)
            return real[grid]

    monkeypatch.setattr(pa, "_merge_kernel", Spy())
    out = {}
    for rows in (4, 0):
        monkeypatch.setenv(dispatch.GEMV_ROWS_ENV, str(rows))
        merges.clear()
        engine = model.engine(slots=2, context=64, page_size=4, graphs=True)
        (done,) = engine.generate([Request([5, 17, 99, 3, 250, 41, 7], 6, Sampling(ignore_eos=True, logprobs=0))])
        out[rows] = (done, len(merges))
    layers = len(model.net.layers)
    assert out[4][1] == 0 and out[0][1] >= 5 * layers
    assert out[4][0].tokens == out[0][0].tokens
    lp = [torch.tensor([p.logprob for p in out[r][0].logprobs]) for r in (4, 0)]
    torch.testing.assert_close(lp[0], lp[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_without_a_slot_store_nothing(dtype) -> None:
    """A real decode row whose slot is -1 stores no k/v (as prepare_qkv's kernel); a slot_mapping shorter than
    the rows (deterministic padding) sends the step to prepare_qkv's kernel first."""
    meta, kc, vc, prep_in, scale = operands("qwen2", dtype, False, seed=6)
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    meta = AttnMetadata(meta.positions, slots, meta.query_start, meta.seq_lens, meta.block_tables, meta.page_size)
    args = tk.paged_args(meta, DEV)
    assert pa.prep_for(*with_spec(prep_in), kc, vc, meta, args) is not None
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = tk.paged_attention_args(tk.prepare_qkv(*with_spec(prep_in), kc1, vc1, slots), kc1, vc1, args, None, scale)
    got = tk.prepare_attention(*with_spec(prep_in, None, scale), kc2, vc2, meta)
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    changed = (kc2 != kc).any(-1).any(-1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(s for s in slots.tolist() if s >= 0)
    if not ON_GPU:
        assert torch.equal(got, want)
    short = AttnMetadata(meta.positions, slots[:3], meta.query_start, meta.seq_lens, meta.block_tables,
                         meta.page_size)  # fmt: skip
    assert pa.prep_for(*with_spec(prep_in), kc, vc, short, tk.paged_args(short, DEV)) is None


@pytest.mark.skipif(not ON_GPU, reason="the interpreter runs programs one after another: no race to find")
def test_the_store_and_its_read_back_do_not_race_on_a_gpu() -> None:
    """Many splits, short key blocks, repeated: the program that stores a row's k/v and reads it back after the
    barrier must see its own stores every time (the separate path's caches and output, exactly)."""
    meta, kc, vc, prep_in, scale = operands("qwen3", torch.bfloat16, True, seed=8)
    qkv, bias, heads, kv_heads, qn, kn, eps, wf, cos, sin = prep_in
    args = tk.paged_args(meta, DEV)
    kc1, vc1 = kc.clone(), vc.clone()
    q = tk.prepare_qkv(*with_spec(prep_in), kc1, vc1, meta.slot_mapping)
    prep = pa.Prep(bias, qn, kn, eps, wf, cos, sin, meta.slot_mapping)
    for _ in range(50):
        kc2, vc2 = kc.clone(), vc.clone()
        got = tk.paged_attention_args(qkv, kc2, vc2, args, None, scale, num_splits=8, block_n=16, prep=prep)
        want = tk.paged_attention_args(q, kc1, vc1, args, None, scale, num_splits=8, block_n=16)
        assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
