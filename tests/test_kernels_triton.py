"""Every Triton kernel equals its torch reference: under TRITON_INTERPRET=1 on the CPU, on the GPU where present.

Small shapes on purpose: the interpreter runs each program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.cache.kv import slot_mapping  # noqa: E402
from superslm.errors import InvalidArgument, UnsupportedModel  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.attention import AttnMetadata  # noqa: E402
from superslm.kernels.attention import paged_attention as attn_ref  # noqa: E402
from superslm.kernels.attention import store_kv as store_ref  # noqa: E402
from superslm.kernels.norm import rms_norm as norm_ref  # noqa: E402
from superslm.kernels.rope import apply_rope as rope_ref  # noqa: E402
from superslm.kernels.rope import rope_cos_sin  # noqa: E402
from superslm.kernels.triton import aot  # noqa: E402

BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- paged layout ---------------------------------------------------------------------------------


def make_step(
    q_lens: list[int], ctx_lens: list[int], page_size: int, kv_heads: int, groups: int, head_dim: int,
    dtype: torch.dtype, seed: int = 0,
) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A step whose sequence s has ctx_lens[s] keys, its last q_lens[s] tokens being this step's rows;
    pages handed out in shuffled order (plus spare pages nobody owns), caches and q random."""
    g = gen(seed)
    need = [-(-c // page_size) for c in ctx_lens]
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g).tolist()
    tables, i = [], 0
    for p in need:
        tables.append(tuple(perm[i : i + p]))
        i += p
    qs = [0]
    for n in q_lens:
        qs.append(qs[-1] + n)
    pos = [p for n, c in zip(q_lens, ctx_lens) for p in range(c - n, c)]
    slots = [x for s, (n, c) in enumerate(zip(q_lens, ctx_lens)) for x in slot_mapping(tables[s], c - n, c, page_size)]
    meta = AttnMetadata(
        positions=torch.tensor(pos, dtype=torch.long, device=DEV),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEV),
        query_start=tuple(qs),
        seq_lens=tuple(ctx_lens),
        block_tables=tuple(tables),
        page_size=page_size,
    )
    kc = torch.randn(total * page_size, kv_heads, head_dim, generator=g).to(DEV, dtype)
    vc = torch.randn(total * page_size, kv_heads, head_dim, generator=g).to(DEV, dtype)
    q = torch.randn(qs[-1], kv_heads * groups, head_dim, generator=g).to(DEV, dtype)
    return meta, q, kc, vc


def check_attention(
    out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttnMetadata,
    window: int | None, scale: float,
) -> None:  # fmt: skip
    """fp32: the reference, to float rounding. bf16: the float32 reference on the same bf16 inputs, to
    bf16's precision (the bf16 reference itself is held to the same bound)."""
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, attn_ref(q, kc, vc, meta, window, scale), atol=2e-5, rtol=2e-5)
        return
    truth = attn_ref(q.float(), kc.float(), vc.float(), meta, window, scale)
    torch.testing.assert_close(out.float(), truth, **BF16_TOL)
    torch.testing.assert_close(attn_ref(q, kc, vc, meta, window, scale).float(), truth, **BF16_TOL)


def test_paged_args_match_metadata() -> None:
    meta, *_ = make_step([3, 1], [7, 10], 4, 1, 1, 16, torch.float32)
    a = tk.build_paged_args(meta, DEV)
    assert a.query_start.tolist() == list(meta.query_start)
    assert a.seq_lens.tolist() == list(meta.seq_lens)
    for s, pages in enumerate(meta.block_tables):
        assert a.block_table[s, : len(pages)].tolist() == list(pages)
    assert (a.num_rows, a.max_query_len, a.max_seq_len) == (4, 3, 10)
    items, n = a.items(2)
    assert items[:n].tolist() == [[0, 0], [0, 2], [1, 3]]
    assert tk.paged_args(meta, DEV) is tk.paged_args(meta, DEV)  # built once per step
    bad = AttnMetadata(meta.positions, meta.slot_mapping, meta.query_start, (7, 13), meta.block_tables, 4)
    with pytest.raises(InvalidArgument):
        tk.build_paged_args(bad, DEV)


@pytest.mark.parametrize(
    "groups,head_dim,dtype",
    [(1, 64, torch.float32), (2, 128, torch.bfloat16), (4, 64, torch.bfloat16), (4, 128, torch.float32),
     (3, 96, torch.float32)],  # G and head_dim not powers of two: masked tile rows and dims
)  # fmt: skip
def test_paged_attention_decode(groups: int, head_dim: int, dtype: torch.dtype) -> None:
    # contexts of 1 key, one page exactly, across page boundaries, several pages
    meta, q, kc, vc = make_step([1, 1, 1, 1], [1, 8, 9, 45], 8, 2, groups, head_dim, dtype, seed=groups)
    scale = head_dim**-0.5
    for splits in (1, 3):
        out = tk.paged_attention(q, kc, vc, meta, None, scale, num_splits=splits)
        check_attention(out, q, kc, vc, meta, None, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode_window(dtype: torch.dtype) -> None:
    meta, q, kc, vc = make_step([1, 1, 1], [3, 21, 40], 4, 1, 2, 64, dtype, seed=5)
    for splits in (1, 2):
        out = tk.paged_attention(q, kc, vc, meta, 7, 0.125, num_splits=splits)
        check_attention(out, q, kc, vc, meta, 7, 0.125)


@pytest.mark.parametrize(
    "groups,head_dim,dtype,window",
    [(1, 128, torch.float32, None), (2, 64, torch.bfloat16, None), (4, 64, torch.float32, 6),
     (2, 128, torch.bfloat16, 5)],
)  # fmt: skip
def test_paged_attention_mixed(groups: int, head_dim: int, dtype: torch.dtype, window: int | None) -> None:
    # a whole prompt, a decode row, a prefill chunk after a cached prefix, a chunk crossing pages
    meta, q, kc, vc = make_step([6, 1, 5, 9], [6, 19, 14, 30], 4, 2, groups, head_dim, dtype, seed=7)
    scale = head_dim**-0.5
    # 16 keys per iteration: several iterations, tiles that straddle pages and sequences' ends
    out = tk.paged_attention_args(q, kc, vc, tk.paged_args(meta, DEV), window, scale, block_n=16)
    check_attention(out, q, kc, vc, meta, window, scale)
    # splitting a prefill tile's keys gives the same result
    out = tk.paged_attention_args(q, kc, vc, tk.paged_args(meta, DEV), window, scale, num_splits=2, block_q=3)
    check_attention(out, q, kc, vc, meta, window, scale)


def test_paged_attention_leaves_padding_rows() -> None:
    meta, q, kc, vc = make_step([2, 1], [5, 9], 4, 1, 2, 64, torch.float32, seed=3)
    qp = torch.cat([q, torch.randn(3, *q.shape[1:], generator=gen(1)).to(DEV)])  # rows past query_start[-1]
    out = tk.paged_attention(qp, kc, vc, meta, None, 0.125)
    torch.testing.assert_close(out[:3], attn_ref(q, kc, vc, meta, None, 0.125), atol=2e-5, rtol=2e-5)


# --- store_kv -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])  # fmt: skip
def test_store_kv(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = gen(2)
    n, kv_heads, head_dim, slots = 5, 2, 64, 24
    qkv = torch.randn(n, (4 + 2 * kv_heads) * head_dim, generator=g).to(DEV, dtype)
    # k and v as the forward pass has them: strided views of a fused qkv
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
    slot_mapping = torch.randperm(slots, generator=g)[:n].to(DEV)
    base = torch.randn(slots, kv_heads, head_dim, generator=g).to(DEV, cache_dtype)
    kc, vc, kr, vr = base.clone(), base.clone(), base.clone(), base.clone()
    tk.store_kv(kc, vc, k, v, slot_mapping)
    store_ref(kr, vr, k, v, slot_mapping)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_store_kv_skips_negative_slots() -> None:
    k = torch.randn(3, 1, 16, generator=gen(4)).to(DEV)
    kc, vc = torch.zeros(8, 1, 16, device=DEV), torch.zeros(8, 1, 16, device=DEV)
    tk.store_kv(kc, vc, k, -k, torch.tensor([5, -1, 2], device=DEV))
    assert torch.equal(kc[5], k[0]) and torch.equal(vc[2], -k[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # row 1 written nowhere


# --- norms ----------------------------------------------------------------------------------------


def check_norm(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    else:
        # the same roundings in the same order: only a sum's order can flip the last bit, rarely
        assert (out == ref).float().mean() > 0.97
        torch.testing.assert_close(out, ref, atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float", [False, True])
def test_rms_norm(dtype: torch.dtype, weight_in_float: bool) -> None:
    g = gen(6)
    x = (torch.randn(7, 96, generator=g) * 3).to(DEV, dtype)
    w = (1 + torch.randn(96, generator=g) * 0.1).to(DEV, dtype)
    check_norm(tk.rms_norm(x, w, 1e-6, weight_in_float), norm_ref(x, w, 1e-6, weight_in_float))
    # q/k norm: heads of a fused qkv, a strided 3-d view
    qkv = torch.randn(5, 3 * 64 + 32, generator=g).to(DEV, dtype)
    q = qkv[:, 32:].view(5, 3, 64)
    wq = (1 + torch.randn(64, generator=g) * 0.1).to(DEV, dtype)
    check_norm(tk.rms_norm(q, wq, 1e-5, weight_in_float), norm_ref(q, wq, 1e-5, weight_in_float))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float", [False, True])
def test_add_rms_norm(dtype: torch.dtype, weight_in_float: bool) -> None:
    g = gen(8)
    x, h = (torch.randn(2, 6, 80, generator=g) * 2).to(DEV, dtype)
    w = (1 + torch.randn(80, generator=g) * 0.1).to(DEV, dtype)
    out, res = tk.add_rms_norm(x, h, w, 1e-6, weight_in_float)
    ref_out, ref_res = dispatch.add_rms_norm_reference(x, h, w, 1e-6, weight_in_float)
    assert torch.equal(res, ref_res) and torch.equal(ref_res, h + x)
    check_norm(out, ref_out)


# --- rope -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rope(dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    g = gen(9)
    n, heads = 6, 3
    positions = torch.tensor([0, 1, 2, 17, 300, 4095], device=DEV)
    inv_freq = (10000.0 ** (-torch.arange(0, rotary_dim, 2).float() / rotary_dim)).to(DEV)
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    qkv = torch.randn(n, (heads + 1) * head_dim, generator=g).to(DEV, dtype)
    x = qkv[:, head_dim:].view(n, heads, head_dim)  # strided, as q is in the forward pass
    out = tk.apply_rope(x, cos, sin)
    assert torch.equal(out, rope_ref(x, cos, sin))


# --- int4 -----------------------------------------------------------------------------------------


def random_int4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = gen(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zero = (torch.randn(n, k // group, generator=g) * 0.02).to(torch.bfloat16)
    return qweight.to(DEV), scale.to(DEV), zero.to(DEV)


def test_int4_reference_is_the_int4_format() -> None:
    from superslm.quant.int4 import Int4Linear

    w = torch.randn(40, 64, generator=gen(10))
    lin = Int4Linear.from_dense(w, group=32)
    state, meta = lin._state()
    x = torch.randn(3, 64, generator=gen(11))
    ref = dispatch.int4_matmul_reference(x, state["qweight"], state["scales"], state["zeros"], meta["group"])
    torch.testing.assert_close(ref, x @ lin.dequantize_stored().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "m,group,k",
    [(1, 32, 1088), (3, 128, 640), (2, 128, 2176), (4, 64, 256), (1, 48, 192), (8, 32, 256), (20, 128, 256)],
)  # GEMV (up to 4 rows): groups past one step of the tile (1088, 640; 2176: 512-byte steps); 48: bytes not a
# power of two; then GEMM tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul(m: int, group: int, k: int, dtype: torch.dtype) -> None:
    n = 40  # not a multiple of the tile
    qweight, scale, zero = random_int4(n, k, group, seed=m)
    x = torch.randn(m, k, generator=gen(12)).to(DEV, dtype)
    out = tk.int4_matmul(x, qweight, scale, zero, group)
    ref = dispatch.int4_matmul_reference(x, qweight, scale, zero, group)
    assert out.dtype == dtype and out.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --- dispatcher -----------------------------------------------------------------------------------


def test_dispatch_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert dispatch.backend(DEV) == "torch"
    monkeypatch.setenv(dispatch.ENV, "auto")
    assert dispatch.backend(torch.device("cpu")) == "torch"
    assert dispatch.backend(torch.device("cuda")) == "triton"  # triton imports here
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.backend(DEV) == "triton"
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(UnsupportedModel):
            dispatch.backend(DEV)
    monkeypatch.setenv(dispatch.ENV, "cuda")
    with pytest.raises(InvalidArgument):
        dispatch.backend(DEV)


def test_dispatch_runs_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    meta, q, kc, vc = make_step([3, 1], [3, 12], 4, 1, 2, 64, torch.float32, seed=13)
    ref = attn_ref(q, kc, vc, meta, None, 0.125)
    monkeypatch.setenv(dispatch.ENV, "triton")
    calls: list[str] = []
    monkeypatch.setattr(tk, "paged_attention", lambda *a: calls.append("triton") or ref)
    assert dispatch.paged_attention(q, kc, vc, meta, None, 0.125) is ref and calls == ["triton"]
    # deterministic steps keep the batch-invariant reference whatever the backend
    det = AttnMetadata(meta.positions, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables, 4,
                       deterministic=True)  # fmt: skip
    torch.testing.assert_close(dispatch.paged_attention(q, kc, vc, det, None, 0.125), ref, atol=1e-5, rtol=1e-5)
    assert calls == ["triton"]
    monkeypatch.setenv(dispatch.ENV, "torch")
    x = torch.randn(4, 32, generator=gen(14)).to(DEV)
    w = torch.ones(32, device=DEV)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), norm_ref(x, w, 1e-6))


# --- the compiler -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])  # one test each: two workers take them at once
def test_kernels_compile_for_gpus(target: str) -> None:
    """What the interpreter lets pass, the GPU compiler may refuse: compile each launcher's variants
    for sm_90 (H100/H200) and gfx942 (MI300) ahead of time, in a process without TRITON_INTERPRET."""
    code = f"import sys; from superslm.kernels.triton.aot import main; sys.exit(main(['--target', {target!r}]))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == len(aot.cases())


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 40])
def test_reference_attention_of_whole_prompts_is_causal_softmax(groups: int, window: int | None) -> None:
    """The torch reference sends whole prompts (and windows that do not cut them) to SDPA's causal kernel
    with GQA: it equals softmax attention written out in float64, head h reading kv head h // groups."""
    meta, q, kc, vc = make_step([21, 1, 9], [21, 30, 9], 8, 2, groups, 16, torch.float32, seed=groups)
    out = attn_ref(q, kc, vc, meta, window, 0.25)
    for s in range(meta.num_seqs):
        a, b = meta.query_start[s], meta.query_start[s + 1]
        slots = meta.key_slots(s)
        k, v = kc[slots].double(), vc[slots].double()  # [L, kv, D]
        pos = meta.positions[a:b]
        keys = torch.arange(len(slots))
        vis = keys[None, :] <= pos[:, None]
        if window is not None:
            vis &= keys[None, :] > pos[:, None] - window
        for h in range(q.shape[1]):
            sc = (q[a:b, h].double() @ k[:, h // groups].T) * 0.25
            p = sc.masked_fill(~vis, float("-inf")).softmax(-1)
            torch.testing.assert_close(out[a:b, h].double(), p @ v[:, h // groups], atol=1e-5, rtol=1e-5)
