"""A rotated (int4/int8) o projection's input made where the attention's key splits are merged
(kernels/triton/attention_linear.py `attention_rotate`): equal to the attention, then the linear's cast, padding and
Hadamard rotation (kernels.fused.attention_rotate), under TRITON_INTERPRET=1 on the CPU and on the GPU; a rotated
int4 model launches neither the merge nor o's Hadamard kernel in a split decode step, with the same tokens.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpret import DEV, import_kernels

tk = import_kernels()
pytestmark = pytest.mark.usefixtures("triton_interpret")

from superslm.kernels import dispatch, fused  # noqa: E402
from superslm.kernels.attention import AttnMetadata  # noqa: E402
from superslm.kernels.hadamard import random_signs  # noqa: E402
from tests.test_kernels_prepare_attention import operands, with_spec  # noqa: E402

pa = sys.modules["superslm.kernels.triton.paged_attention"]
al = sys.modules["superslm.kernels.triton.attention_linear"]


class Spy:
    """Counts a kernel's launches (kernel[grid](...))."""

    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "partial"])
@pytest.mark.parametrize("splits,padding", [(1, False), (3, True), (2, False)])
@pytest.mark.parametrize("pad_to,block", [(0, 128), (64, 64), (0, 16)])  # the linear's zero padding; small blocks
def test_the_merge_rotates_o_input(dtype, variant, splits, padding, pad_to, block, monkeypatch) -> None:
    monkeypatch.setattr(pa, "_num_splits", lambda *a: splits)
    spy = Spy(al._merge_rotate_kernel)
    monkeypatch.setattr(al, "_merge_rotate_kernel", spy)
    meta, kc, vc, prep_in, scale = operands(variant, dtype, padding, seed=4)
    width = prep_in[2] * kc.shape[-1]
    k = -(-(width + pad_to) // block) * block
    signs = random_signs(k, 11).to(DEV)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    n = meta.query_start[-1]
    attn = tk.prepare_attention(*with_spec(prep_in, None, scale), kc1, vc1, meta).reshape(n, -1)
    want = fused.linear_input(attn, signs, block, torch.bfloat16, tk.hadamard_rotate)
    got = tk.attention_rotate(*with_spec(prep_in, None, scale), kc2, vc2, meta, signs, block, torch.bfloat16)
    assert spy.launches == (splits > 1)
    assert got.shape == (n, k) and got.dtype == torch.bfloat16
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    # the merge's float32 sums in another order: the attention's output within a rounding, then the rotation
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    if padding:  # a padding row attends to nothing: zeros, rotated
        assert torch.equal(got[-1].float(), torch.zeros(k))
    # the torch reference, on the rows that are not padding
    m = n - padding
    s = len(meta.seq_lens) - padding
    cpu_in = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in prep_in)
    cpu_in = (cpu_in[0][:m], *cpu_in[1:8], cpu_in[8][:m], cpu_in[9][:m])
    cpu_meta = AttnMetadata(meta.positions[:m].cpu(), meta.slot_mapping[:m].cpu(), meta.query_start[: s + 1],
                            meta.seq_lens[:s], meta.block_tables[:s], meta.page_size)  # fmt: skip
    ref = fused.attention_rotate(*with_spec(cpu_in, None, scale), kc.clone().cpu(), vc.clone().cpu(), cpu_meta,
                                 signs.cpu(), block, torch.bfloat16)  # fmt: skip
    torch.testing.assert_close(got[:m].float().cpu(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.slow
def test_a_rotated_model_merges_into_o_rotation(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen2 re-quantized to rotated int4 (bf16), two key splits a decode step: no merge and no o Hadamard
    launch in decode steps; the tokens of the attention's merge followed by the Hadamard kernel."""
    import superslm
    from superslm import Request, Sampling
    from superslm.quant.int4 import Int4Linear
    from tests.tiny_models import build_hf_model, two_layers

    build_hf_model("qwen2", tmp_path, spec=two_layers("qwen2"))
    model = superslm.load(tmp_path, device=DEV, dtype="bf16", quant="int4")
    if DEV.type == "cpu":
        for layer in model.net.layers:
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if isinstance(m, Int4Linear):
                    m._relayout("nibbles")  # what a GPU holds
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setattr(pa, "_num_splits", lambda *a: 2)
    merge, had = Spy(pa._merge_kernel), {"n": 0}
    monkeypatch.setattr(pa, "_merge_kernel", merge)
    real_had = tk.hadamard_rotate
    count = lambda *a: had.__setitem__("n", had["n"] + 1) or real_had(*a)  # noqa: E731
    monkeypatch.setattr(tk, "hadamard_rotate", count)
    monkeypatch.setattr(al, "hadamard_rotate", count)  # the prompt step's fallback
    fused_fn = tk.attention_rotate

    def apart(*a):  # type: ignore[no-untyped-def]
        *prep, signs, block, dtype = a
        o = tk.prepare_attention(*prep)
        return fused.linear_input(o.reshape(o.shape[0], -1), signs, block, dtype, tk.hadamard_rotate)

    out = {}
    for name, fn in (("fused", fused_fn), ("apart", apart)):
        monkeypatch.setattr(tk, "attention_rotate", fn)
        merge.launches, had["n"] = 0, 0
        engine = model.engine(slots=2, context=64, page_size=4, graphs=False)
        (done,) = engine.generate([Request([5, 17, 99, 3, 250, 41, 7], 6, Sampling(ignore_eos=True, logprobs=0))])
        out[name] = (done, merge.launches, had["n"])
    layers, decode = len(model.net.layers), 5
    assert out["fused"][1] == 0 and out["apart"][1] == layers * decode
    assert out["apart"][2] - out["fused"][2] == layers * decode
    assert out["fused"][0].tokens == out["apart"][0].tokens
    lp = [torch.tensor([p.logprob for p in out[r][0].logprobs]) for r in ("fused", "apart")]
    torch.testing.assert_close(lp[0], lp[1], atol=0.05, rtol=0.05)
