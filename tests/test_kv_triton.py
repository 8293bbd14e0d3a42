"""int8 and rotated 4-bit KV rows on the Triton backend: its store writes the bits of cache.kv.quantize_rows (and of
quantize_rows4 after cache.kv.rotate), its attention reads the rows as the torch reference does (codes times their
row's scale, no dense copy; over 4-bit rows q rotated into the keys' basis, the output rotated back), keys and
values each in their own format, under TRITON_INTERPRET=1 on the CPU and on the GPU where present; an engine on
the Triton kernels and int8 or 4-bit pages answers as the torch path does."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.cache import kv as kvmod  # noqa: E402
from superslm.cache.kv import quantize_rows, quantize_rows4, rotate  # noqa: E402
from superslm.errors import InvalidArgument, UnsupportedModel  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.attention import paged_attention as attn_ref  # noqa: E402
from superslm.kernels.triton.paged_args import paged_args  # noqa: E402
from superslm.kernels.triton.paged_attention import Prep, attend  # noqa: E402
from tests.test_kernels_triton import gen, make_step  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_writes_quantize_rows_bits(dtype: torch.dtype) -> None:
    g = gen(3)
    n, kv_heads, head_dim, slots = 7, 3, 20, 40  # 3 heads and 20 dims: masked lanes in the kernel's tile
    k = (torch.randn(n, kv_heads, head_dim, generator=g) * 3).to(DEV, dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(DEV, dtype)
    k[0, 0] = 0  # a zero row: codes 0, scale 0
    k[1, 1, 3] = float("nan")  # scale NaN, codes 0
    k[2, 2, 5] = float("inf")  # inf / inf: code 0
    v[3, 0] = 2.5  # every code a tie (127 after the scale): rounding as torch.round
    v[4, 1] = (torch.arange(head_dim) * 0.5 - 4.75).to(dtype)
    slot_mapping = torch.tensor([3, 17, 9, 30, 0, 39, -1], device=DEV)  # the last a padding row: not written
    kc = torch.full((slots, kv_heads, head_dim + 4), 7, dtype=torch.int8, device=DEV)
    vc = kc.clone()
    tk.store_kv(kc, vc, k, v, slot_mapping)
    written = slot_mapping[:-1]
    assert torch.equal(kc[written], quantize_rows(k[:-1])) and torch.equal(vc[written], quantize_rows(v[:-1]))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[written.cpu()] = False
    assert bool((kc[untouched.to(DEV)] == 7).all()) and bool((vc[untouched.to(DEV)] == 7).all())


def _rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x's rows in the format of `bits` as cache.kv.write_rows writes them (8: int8, 4: rotated 4-bit)."""
    return quantize_rows(x) if bits == 8 else quantize_rows4(rotate(x))


@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])  # 96: blocks of 32, one masked block in the tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_quantize_rows4_bits(head_dim: int, dtype: torch.dtype) -> None:
    g = gen(head_dim)
    n, kv_heads, slots = 6, 3, 12  # 3 heads: a masked head in the kernel's tile
    k = (torch.randn(n, kv_heads, head_dim, generator=g) * 3).to(DEV, dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(DEV, dtype)
    k[0, 0] = 0  # a zero row: codes 8, scale 0
    k[1, 1, 3] = float("nan")  # spread by the rotation over its block: scale NaN, codes 8
    k[2, 2, 5] = float("inf")  # inf and inf - inf over its block: scale NaN, codes 8
    v[3, 0] = 2.5  # a constant head: rotated, one lane holds it all
    v[4, 1, 7] = 1e30  # an outlier the rotation spreads over its block
    slot_mapping = torch.tensor([3, 11, 9, 0, 5, -1], device=DEV)  # the last a padding row: not written
    written = slot_mapping[:-1]
    kw = [_rows(k[:-1], 4), quantize_rows(k[:-1])]
    vw = [_rows(v[:-1], 4), quantize_rows(v[:-1])]
    # k4v4, then keys and values in different formats (k8v4, k4v8)
    for ki, vi in ((0, 0), (1, 0), (0, 1)):
        kc = torch.full((slots, kv_heads, kw[ki].shape[-1]), 7, dtype=kw[ki].dtype, device=DEV)
        vc = torch.full((slots, kv_heads, vw[vi].shape[-1]), 7, dtype=vw[vi].dtype, device=DEV)
        tk.store_kv(kc, vc, k, v, slot_mapping)
        assert torch.equal(kc[written], kw[ki]) and torch.equal(vc[written], vw[vi])
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[written.cpu()] = False
        assert bool((kc[untouched.to(DEV)] == 7).all()) and bool((vc[untouched.to(DEV)] == 7).all())
    codes = kw[0][..., :-4]
    assert bool(((codes & 15) >= 1).all() and ((codes >> 4) >= 1).all())  # 1..15: -7..7 around 8
    assert torch.equal(kw[0][0, 0, :-4], torch.full_like(kw[0][0, 0, :-4], 0x88))


def test_store_writes_unrotated_4bit_rows_where_the_rotation_is_off(monkeypatch) -> None:
    """benchmarks/kv_quality.py's plain 4-bit comparison turns cache.kv's rotation off: rows of the values as they
    are, read without rotating q or the output."""
    monkeypatch.setattr(kvmod, "_ROTATE", False)
    g = gen(9)
    k = torch.randn(4, 2, 64, generator=g).to(DEV)
    slot_mapping = torch.tensor([0, 2, 3, 1], device=DEV)
    kc = torch.zeros(4, 2, 36, dtype=torch.uint8, device=DEV)
    tk.store_kv(kc, kc.clone(), k, k, slot_mapping)
    assert torch.equal(kc[slot_mapping], quantize_rows4(k))
    meta, q, kf, vf = make_step([1, 2], [5, 9], 4, 2, 1, 64, torch.float32, seed=2)
    kc, vc = quantize_rows4(kf), quantize_rows4(vf)
    torch.testing.assert_close(tk.paged_attention(q, kc, vc, meta, None, 0.125),
                               attn_ref(q, kc, vc, meta, None, 0.125), atol=2e-5, rtol=2e-5)  # fmt: skip


def _int8_step(q_lens: list[int], ctx_lens: list[int], groups: int, head_dim: int, dtype: torch.dtype, seed: int):
    meta, q, kc, vc = make_step(q_lens, ctx_lens, 4, 2, groups, head_dim, dtype, seed=seed)
    return meta, q, quantize_rows(kc), quantize_rows(vc)


@pytest.mark.parametrize(
    "q_lens,ctx_lens,groups,head_dim,dtype,window",
    [([1, 1, 1, 1], [1, 8, 9, 45], 2, 64, torch.float32, None),  # decode rows: one key, a page, pages
     ([1, 1, 1], [3, 21, 40], 1, 32, torch.bfloat16, 7),
     ([6, 1, 5, 9], [6, 19, 14, 30], 3, 96, torch.float32, None),  # prompts, chunks, masked tile rows and dims
     ([6, 1, 5], [6, 19, 14], 2, 64, torch.bfloat16, 5)],
)  # fmt: skip
def test_attention_reads_int8_rows_as_the_reference(q_lens, ctx_lens, groups, head_dim, dtype, window) -> None:
    meta, q, kc, vc = _int8_step(q_lens, ctx_lens, groups, head_dim, dtype, seed=groups + head_dim)
    scale = head_dim**-0.5
    want = attn_ref(q.float(), kc, vc, meta, window, scale)  # the reference dequantizes the rows it gathers
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for splits in (1, 3):
        out = tk.paged_attention(q, kc, vc, meta, window, scale, num_splits=splits)
        torch.testing.assert_close(out.float(), want, **tol)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(attn_ref(q, kc, vc, meta, window, scale).float(), want, **tol)
    # the batch-invariant kernel reads the same rows: one sequence alone or beside the others, the same bits
    both = tk.paged_attention_invariant(q, kc, vc, meta, window, scale)
    torch.testing.assert_close(both.float(), want, **tol)


@pytest.mark.parametrize("formats", [(8, 4), (4, 8), (4, 4)], ids=["k8v4", "k4v8", "k4v4"])
@pytest.mark.parametrize(
    "q_lens,ctx_lens,groups,head_dim,dtype,window",
    [([1, 1, 1], [1, 8, 45], 2, 64, torch.float32, None),  # decode rows: one key, a page, pages
     ([1, 1], [21, 40], 1, 32, torch.bfloat16, 7),
     ([6, 1, 5], [6, 19, 14], 3, 96, torch.float32, None),  # prompts, chunks; blocks of 32, a masked block
     ([5, 1, 4], [5, 17, 12], 2, 64, torch.bfloat16, 5)],
)  # fmt: skip
def test_attention_reads_4bit_rows_as_the_reference(formats, q_lens, ctx_lens, groups, head_dim, dtype,
                                                    window) -> None:  # fmt: skip
    kb, vb = formats
    meta, q, kf, vf = make_step(q_lens, ctx_lens, 4, 2, groups, head_dim, dtype, seed=groups + head_dim + kb)
    kc, vc = _rows(kf, kb), _rows(vf, vb)
    scale = head_dim**-0.5
    want = attn_ref(q.float(), kc, vc, meta, window, scale)  # rotates q and the output around its SDPA
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for splits in (1, 3):  # with splits the merge rotates the output back
        out = tk.paged_attention(q, kc, vc, meta, window, scale, num_splits=splits)
        torch.testing.assert_close(out.float(), want, **tol)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(attn_ref(q, kc, vc, meta, window, scale).float(), want, **tol)
    both = tk.paged_attention_invariant(q, kc, vc, meta, window, scale)
    torch.testing.assert_close(both.float(), want, **tol)


def test_formats_the_kernels_do_not_take_are_refused(monkeypatch) -> None:
    meta, q, kc, vc = _int8_step([1, 1], [5, 9], 1, 32, torch.float32, seed=1)
    floats = torch.randn(vc.shape[0], vc.shape[1], 32, device=DEV)
    packed = torch.zeros(kc.shape[0], kc.shape[1], 32 // 2 + 4, dtype=torch.uint8, device=DEV)
    for keys, values in ((kc, floats), (floats, packed)):  # quantized rows beside float values: no such format
        with pytest.raises(InvalidArgument, match="keys"):
            tk.paged_attention(q, keys, values, meta, None, 0.25)
    with pytest.raises(InvalidArgument, match="store_kv"):  # 4-bit rows of another head_dim
        tk.store_kv(packed, packed, torch.zeros(1, 2, 16, device=DEV), torch.zeros(1, 2, 16, device=DEV),
                    torch.tensor([0], device=DEV))
    monkeypatch.setattr(dispatch, "triton_kernels", lambda device: tk)  # the Triton backend, as on a GPU
    assert dispatch._kv_kernels(DEV, kc, vc) is tk and dispatch._kv_kernels(DEV, packed, kc) is tk
    odd = torch.zeros(kc.shape, dtype=torch.int16, device=DEV)  # a page format the Triton kernels do not know
    for keys, values in ((odd, odd), (kc, odd)):
        with pytest.raises(UnsupportedModel, match="int16"):
            dispatch.store_kv(keys, values, torch.zeros(1, 1, 32, device=DEV), torch.zeros(1, 1, 32, device=DEV),
                              torch.tensor([0], device=DEV))
    # the kernel that prepares its own q, k and v stores float rows: quantized pages are refused, not written
    prep = Prep(None, None, None, 1e-6, False, q, q, meta.slot_mapping)
    with pytest.raises(InvalidArgument, match="prepar"):
        attend(q.reshape(q.shape[0], -1), packed, packed, paged_args(meta, DEV), None, 0.25, prep=prep)


@pytest.mark.parametrize("kv", ["int8", "k4v4"])
def test_an_engine_on_the_triton_kernels_reads_its_quantized_pages(monkeypatch, tmp_path, kv: str) -> None:
    """A whole engine on int8 or 4-bit pages, its attention on the Triton kernels: its logits are the torch path's
    on the same pages (prompt chunks over pages, then decode rows), and the Triton attention read those rows."""
    import importlib

    import superslm
    from tests.test_engine import prompts
    from tests.tiny_models import build_hf_model

    build_hf_model("llama" if kv == "int8" else "qwen3", tmp_path)  # 4-bit rows: qwen3's heads of 32
    want = kvmod.KVCache(1, 1, 4, 1, 32, kv=kv)  # the keys' dtype the attention reads
    model = superslm.load(tmp_path, device="cpu", dtype=torch.float32)
    pa = importlib.import_module("superslm.kernels.triton.paged_attention")
    seen: list[torch.dtype] = []
    attend = pa.attend
    monkeypatch.setattr(pa, "attend", lambda q, kc, *a, **kw: seen.append(kc.dtype) or attend(q, kc, *a, **kw))
    a, b = prompts(2, seed=5, lo=9, hi=14)
    logits = {}
    for kernels in ("triton", "torch"):
        monkeypatch.setenv(dispatch.ENV, kernels)
        engine = model.engine(slots=2, context=64, page_size=4, kv=kv)
        rows = [(t, 0) for t in a] + [(t, 1) for t in b]
        wanted = [False] * len(rows)
        wanted[len(a) - 1] = wanted[-1] = True
        first = engine.step([t for t, _ in rows], [s for _, s in rows], wanted)
        nxt = engine.step([int(first[0].argmax()), int(first[1].argmax())], [0, 1], [True, True])
        logits[kernels] = torch.cat([first, nxt])
    assert seen and set(seen) == {want.k.dtype}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
