"""int8 KV rows on the Triton backend: its store writes the bits of cache.kv.quantize_rows, its attention reads the
rows as the torch reference does (codes times their row's scale, no dense copy), under TRITON_INTERPRET=1 on the
CPU and on the GPU where present; an engine on the Triton kernels and int8 pages answers as the torch path does."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.cache.kv import quantize_rows  # noqa: E402
from superslm.errors import InvalidArgument, UnsupportedModel  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from superslm.kernels.attention import paged_attention as attn_ref  # noqa: E402
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


def test_formats_the_kernels_do_not_take_are_refused(monkeypatch) -> None:
    meta, q, kc, vc = _int8_step([1, 1], [5, 9], 1, 16, torch.float32, seed=1)
    floats = torch.randn(vc.shape[0], vc.shape[1], 16, device=DEV)
    with pytest.raises(InvalidArgument, match="keys"):  # int8 keys beside float values: no such page format
        tk.paged_attention(q, kc, floats, meta, None, 0.25)
    monkeypatch.setattr(dispatch, "triton_kernels", lambda device: tk)  # the Triton backend, as on a GPU
    assert dispatch._kv_kernels(DEV, kc, vc) is tk
    packed = torch.zeros(kc.shape, dtype=torch.uint8, device=DEV)  # a page format the Triton kernels do not know
    with pytest.raises(UnsupportedModel, match="uint8"):
        dispatch.store_kv(packed, packed, torch.zeros(1, 1, 16, device=DEV), torch.zeros(1, 1, 16, device=DEV),
                          torch.tensor([0], device=DEV))


def test_an_engine_on_the_triton_kernels_reads_its_int8_pages(monkeypatch, tmp_path) -> None:
    """A whole engine on int8 pages, its attention on the Triton kernels: its logits are the torch path's on the
    same int8 pages (prompt chunks over pages, then decode rows), and the Triton attention read int8 rows."""
    import importlib

    import superslm
    from tests.test_engine import prompts
    from tests.tiny_models import build_hf_model

    build_hf_model("llama", tmp_path)
    model = superslm.load(tmp_path, device="cpu", dtype=torch.float32)
    pa = importlib.import_module("superslm.kernels.triton.paged_attention")
    seen: list[torch.dtype] = []
    attend = pa.attend
    monkeypatch.setattr(pa, "attend", lambda q, kc, *a, **kw: seen.append(kc.dtype) or attend(q, kc, *a, **kw))
    a, b = prompts(2, seed=5, lo=9, hi=14)
    logits = {}
    for kernels in ("triton", "torch"):
        monkeypatch.setenv(dispatch.ENV, kernels)
        engine = model.engine(slots=2, context=64, page_size=4, kv="int8")
        rows = [(t, 0) for t in a] + [(t, 1) for t in b]
        wanted = [False] * len(rows)
        wanted[len(a) - 1] = wanted[-1] = True
        first = engine.step([t for t, _ in rows], [s for _, s in rows], wanted)
        nxt = engine.step([int(first[0].argmax()), int(first[1].argmax())], [0, 1], [True, True])
        logits[kernels] = torch.cat([first, nxt])
    assert seen and set(seen) == {torch.int8}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
