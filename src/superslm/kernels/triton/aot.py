"""Compile the kernels for a GPU target ahead of time, on any machine (no GPU needed).

The interpreter runs what the compiler may refuse (types, tile shapes, register-hungry tiles), so
CI compiles each kernel with the tile sizes its launcher picks: `python -m superslm.kernels.triton.aot
[--target cuda:90|hip:gfx942] [--all]`. Run it without TRITON_INTERPRET (the kernels must be jitted).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from superslm.kernels.triton._util import next_pow2
from superslm.kernels.triton.attention_linear import (
    _merge_gemv_kernel,
    _merge_rotate_kernel,
    merge_gemv_config,
    merge_rotate_config,
)
from superslm.kernels.triton.dense_gemm import BLOCK_K as DENSE_K
from superslm.kernels.triton.dense_gemm import BLOCK_N as DENSE_N
from superslm.kernels.triton.dense_gemm import _dense_kernel
from superslm.kernels.triton.fused import _gated_act_kernel, _prepare_qkv_kernel
from superslm.kernels.triton.hadamard import _hadamard_kernel, hadamard_config
from superslm.kernels.triton.int4_gemv import _int4_gemv_kernel, _int4_kernel, gemv_config, int4_config
from superslm.kernels.triton.int8_gemv import _int8_kernel, int8_config
from superslm.kernels.triton.norm_gemv import _norm_gemv_kernel, norm_gemv_config
from superslm.kernels.triton.norm_rotate import _gated_act_rotate_kernel, _norm_rotate_kernel
from superslm.kernels.triton.paged_attention import _attn_kernel, _merge_kernel, attn_config
from superslm.kernels.triton.rmsnorm import _rms_norm_kernel
from superslm.kernels.triton.rope import _rope_kernel
from superslm.kernels.triton.rotate_gemv import _rotate_int4_kernel, rotate_gemv_config
from superslm.kernels.triton.sampling import _select_kernel, _shape_kernel
from superslm.kernels.triton.store_kv import _store_kv_kernel

#: int arguments the launcher's real values make multiples of 16 (triton specializes those)
_DIVISIBLE = {
    "k_row", "k_head", "v_row", "v_head", "kc_slot", "kc_head", "vc_slot", "vc_head", "q_row", "q_head", "k_slot",
    "v_slot", "o_row", "o_head", "head_dim", "x_row", "x_outer", "x_inner", "r_outer", "r_inner", "dim", "cs_row",
    "qw_row", "K", "c_row", "w_row",
}  # fmt: skip
_FLOATS = {"qk_scale", "eps", "h_scale", "hs"}
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def parse_target(spec: str) -> GPUTarget:
    """"cuda:90" (sm_90, H100/H200) or "hip:gfx942" (MI300) -> a triton GPUTarget."""
    backend, _, arch = spec.partition(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch or 90), 32)
    if backend == "hip":
        return GPUTarget("hip", arch or "gfx942", 64)
    raise ValueError(f"target must be cuda:<sm> or hip:<gfx>, not {spec!r}")


def compile_kernel(
    kernel: Any, target: GPUTarget, ptrs: dict[str, str], num_warps: int = 4, fusion: bool = True, **constexprs: Any
) -> Any:
    """triton.compile `kernel` (a JITFunction) with pointer element types `ptrs`; other args are i32/fp32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n][0] == "*" or n in _DIVISIBLE}  # fmt: skip
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "enable_fp_fusion": fusion})


@dataclass
class Case:
    """One kernel variant as a launcher would pick it."""

    name: str
    kernel: Any
    ptrs: dict[str, str]
    num_warps: int
    constexprs: dict[str, Any]
    #: the launcher's enable_fp_fusion: off where the kernel repeats the reference's roundings
    fusion: bool = True

    def compile(self, target: GPUTarget) -> Any:
        return compile_kernel(self.kernel, target, self.ptrs, self.num_warps, self.fusion, **self.constexprs)


def cases(everything: bool = False) -> list[Case]:
    """Each kernel variant the launchers pick: bf16 on two model shapes; with `everything` fp32 and more shapes."""
    out: list[Case] = []
    dtypes = (torch.bfloat16, torch.float32) if everything else (torch.bfloat16,)
    # (G, head_dim): Qwen2.5-0.5B, Qwen2.5-1.5B; then MHA and Gemma 3's 256
    shapes = ((7, 64), (6, 128), (1, 128), (4, 256)) if everything else ((7, 64), (6, 128))
    norms = [(a, w) for a in (False, True) for w in (False, True)] if everything else [(True, False), (False, True)]
    for dt in dtypes:
        t, f32 = _TY[dt], dt == torch.float32
        kv = dict(k_ptr=t, v_ptr=t, kc_ptr=t, vc_ptr=t, slot_ptr="i64", sg_ptr=t)
        plain = dict(BLOCK_H=2, BLOCK_D=64, K_BITS=0, V_BITS=0, ROT=False, B=1, LOG_B=0)
        out.append(Case(f"store_kv {t}", _store_kv_kernel, kv, 4, plain, False))
        # int8 pages: codes then the row's float32 scale, written and read in the kernels
        kv8 = dict(kv, kc_ptr="i8", vc_ptr="i8")
        out.append(Case(f"store_kv {t} to int8 rows", _store_kv_kernel, kv8, 4, dict(plain, K_BITS=8, V_BITS=8),
                        False))  # fmt: skip
        # 4-bit rows: each head rotated (block Hadamard, fixed signs), then packed codes and the scale; keys and
        # values in their own formats (k8v4, k4v8, k4v4); heads of 64, 128 and Gemma 3's 256
        for kb, vb, heads, head_dim in ((8, 4, 2, 64), (4, 8, 8, 128), (4, 4, 2, 64), (4, 4, 1, 256)):
            c4 = dict(kv, kc_ptr="i8" if kb == 8 else "u8", vc_ptr="i8" if vb == 8 else "u8", sg_ptr="fp32")
            cx = dict(plain, BLOCK_H=heads, BLOCK_D=head_dim, K_BITS=kb, V_BITS=vb, ROT=True, B=min(head_dim, 256),
                      LOG_B=min(head_dim, 256).bit_length() - 1)  # fmt: skip
            out.append(Case(f"store_kv {t} to k{kb}v{vb} rows D={head_dim}", _store_kv_kernel, c4, 4, cx, False))
        attn = dict(q_ptr=t, k_ptr=t, v_ptr=t, o_ptr=t, part_ptr="fp32", ml_ptr="fp32", bt_ptr="i32",
                    sl_ptr="i32", qs_ptr="i32", pos_ptr="i64", item_ptr="i32", qb_ptr=t, qn_ptr=t, kn_ptr=t,
                    cos_ptr=t, sin_ptr=t, slot_ptr="i64", sg_ptr="fp32")  # fmt: skip
        # decode steps prepare q, k and v in the kernel (prepare_attention): with Qwen2.5's bias, Qwen3's norms
        for (groups, head_dim), prep in zip(shapes, ((True, False), (False, True), (False, True), (False, True))):
            for decode in (True, False):
                c = attn_config(groups, head_dim, dt, decode, False)
                cx = dict(G=groups, BLOCK_Q=c["block_q"], BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                          BLOCK_D=next_pow2(head_dim), SPLIT=decode, F32_DOT=f32, PREP=decode, HAS_BIAS=prep[0],
                          NORM=prep[1], WEIGHT_IN_FLOAT=head_dim == 256, K_BITS=0, V_BITS=0, K_ROT=False,
                          V_ROT=False, B=1, LOG_B=0)  # fmt: skip
                kind = "decode, prepares q/k/v" if decode else "mixed"
                out.append(Case(f"paged_attention {t} G={groups} D={head_dim} {kind}", _attn_kernel, attn,
                                c["num_warps"], cx, not decode))  # fmt: skip
                # int8 pages: q, k and v prepared outside (the launcher refuses prepare_qkv on them)
                out.append(Case(f"paged_attention {t} G={groups} D={head_dim} {'decode' if decode else 'mixed'}"
                                " on int8 rows", _attn_kernel, dict(attn, k_ptr="i8", v_ptr="i8"), c["num_warps"],
                                dict(cx, PREP=False, K_BITS=8, V_BITS=8), True))  # fmt: skip
                # 4-bit rows (rotated: q into the keys' basis, the output out of the values'), beside int8 ones
                block = min(head_dim, 256)
                for kb, vb in ((8, 4), (4, 8), (4, 4)):
                    ptrs = dict(attn, k_ptr="i8" if kb == 8 else "u8", v_ptr="i8" if vb == 8 else "u8")
                    out.append(Case(f"paged_attention {t} G={groups} D={head_dim} {'decode' if decode else 'mixed'}"
                                    f" on k{kb}v{vb} rows", _attn_kernel, ptrs, c["num_warps"],
                                    dict(cx, PREP=False, K_BITS=kb, V_BITS=vb, K_ROT=kb == 4, V_ROT=vb == 4, B=block,
                                         LOG_B=block.bit_length() - 1), True))  # fmt: skip
                if decode and everything:  # one split (short contexts); the decode kernel on a prepared q
                    out.append(Case(f"paged_attention {t} G={groups} D={head_dim} decode, one split", _attn_kernel,
                                    attn, c["num_warps"], dict(cx, SPLIT=False), False))  # fmt: skip
                    out.append(Case(f"paged_attention {t} G={groups} D={head_dim} decode", _attn_kernel, attn,
                                    c["num_warps"], dict(cx, PREP=False)))  # fmt: skip
        merge = dict(part_ptr="fp32", ml_ptr="fp32", o_ptr=t, sg_ptr="fp32")
        out.append(Case(f"merge {t}", _merge_kernel, merge, 4, dict(BLOCK_S=16, BLOCK_D=128, ROT=False, B=1, LOG_B=0)))
        # the merge of splits over rotated 4-bit values: each head rotated back
        for head_dim in (64, 128, 256):
            cx = dict(BLOCK_S=16, BLOCK_D=head_dim, ROT=True, B=head_dim, LOG_B=head_dim.bit_length() - 1)
            out.append(Case(f"merge {t} of 4-bit values D={head_dim}", _merge_kernel, merge, 4, cx))
        # the merge inside the o projection's GEMV: Qwen2.5-0.5B (14 x 64 -> 896), Qwen3-0.6B (16 x 128 -> 1024)
        for n_out, head_dim in ((896, 64), (1024, 128)):
            c = merge_gemv_config(n_out, head_dim, False)
            cx = dict(BLOCK_N=c["block_n"], BLOCK_H=c["block_h"], BLOCK_S=16, BLOCK_D=c["block_d"])
            out.append(Case(f"merge_gemv {t} out={n_out} D={head_dim}", _merge_gemv_kernel,
                            dict(part_ptr="fp32", ml_ptr="fp32", w_ptr=t, o_ptr=t), c["num_warps"], cx))
        # the merge making a rotated o projection's input (bf16 whatever the model's dtype): blocks of 128 and 64
        for b in (128, 64):
            c = merge_rotate_config(1024, b, False)
            cx = dict(BLOCK_R=c["block_r"], B=b, LOG_B=b.bit_length() - 1)
            out.append(Case(f"merge_rotate {t} b={b}", _merge_rotate_kernel,
                            dict(part_ptr="fp32", ml_ptr="fp32", s_ptr="fp32", o_ptr="bf16", t_ptr=t),
                            c["num_warps"], cx, False))  # fmt: skip
        norm = dict(x_ptr=t, r_ptr=t, w_ptr=t, o_ptr=t, ro_ptr=t)
        for add, wf in norms:
            out.append(Case(f"rms_norm {t} add={add} weight_in_float={wf}", _rms_norm_kernel, norm, 4,
                            dict(ADD=add, WEIGHT_IN_FLOAT=wf, BLOCK=1024), False))  # fmt: skip
        rope = dict(x_ptr=t, cos_ptr=t, sin_ptr=t, o_ptr=t)
        out.append(Case(f"rope {t}", _rope_kernel, rope, 4, dict(BLOCK_H=16, BLOCK_D=64), False))
        pq = dict(qkv_ptr=t, bias_ptr=t, qn_ptr=t, kn_ptr=t, cos_ptr=t, sin_ptr=t, kc_ptr=t, vc_ptr=t, slot_ptr="i64",
                  q_ptr=t)  # fmt: skip
        # Qwen2.5-0.5B (bias), Qwen3-0.6B (q/k norms), Gemma-3 (norms, weight in float32, head_dim 256)
        for bias, nrm, wf, hq, hk, d in ((True, False, False, 16, 2, 64), (False, True, False, 16, 8, 128),
                                         (False, True, True, 4, 1, 256)):
            cx = dict(HAS_BIAS=bias, NORM=nrm, WEIGHT_IN_FLOAT=wf, BLOCK_HQ=hq, BLOCK_HK=hk, BLOCK_D=d)
            out.append(Case(f"prepare_qkv {t} bias={bias} norm={nrm} D={d}", _prepare_qkv_kernel, pq, 4, cx, False))
        for act in (0, 1, 2):
            out.append(Case(f"gated_act {t} act={act}", _gated_act_kernel, dict(gu_ptr=t, o_ptr=t), 4,
                            dict(ACT=act, BLOCK=1024), False))  # fmt: skip
        int4 = dict(x_ptr=t, qw_ptr="u8", s_ptr="bf16", z_ptr="bf16", o_ptr=t)
        for n, k, group in ((896, 896, 128), (9728, 896, 128), (896, 4864, 128), (896, 896, 32)):
            c = gemv_config(n, k, group, False)
            assert c is not None
            cx = dict(BLOCK_N=c["block_n"], GROUPS=c["groups"], HALF_G=c["half_g"])
            out.append(Case(f"int4 gemv {t} n={n} k={k} g={group}", _int4_gemv_kernel, int4, c["num_warps"], cx))
        for m in (16, 64):
            c = int4_config(m, False)
            cx = dict(BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_KH=c["block_kh"], DOT=c["block_m"] > 1,
                      F32_DOT=f32)  # fmt: skip
            out.append(Case(f"int4_matmul {t} m={m}", _int4_kernel, int4, c["num_warps"], cx))
        int8 = dict(x_ptr=t, c_ptr="i8", s_ptr="bf16", o_ptr=t)
        for m in (1, 16, 64):
            c = int8_config(m, False)
            cx = dict(BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_K=c["block_k"], DOT=c["block_m"] > 1,
                      F32_DOT=f32)  # fmt: skip
            out.append(Case(f"int8_matmul {t} m={m}", _int8_kernel, int8, c["num_warps"], cx))
        # deterministic mode's dense linears: one tile shape, a bias (Qwen2's qkv) or none
        for bias in (True, False):
            cx = dict(HAS_BIAS=bias, BLOCK_M=16, BLOCK_N=DENSE_N, BLOCK_K=DENSE_K, F32_DOT=f32)
            out.append(Case(f"dense_matmul {t} bias={bias}", _dense_kernel,
                            dict(x_ptr=t, w_ptr=t, b_ptr=t, o_ptr=t), 4, cx))  # fmt: skip
        had = dict(x_ptr=t, s_ptr="fp32", o_ptr=t)
        # 128 and 64 (SmolLM2's 576), then blocks of 8
        for block in (128, 64, 8) if everything else (128, 64):
            c = hadamard_config(1024, block, False)
            cx = dict(BLOCK_R=c["block_r"], B=block, LOG_B=block.bit_length() - 1)
            out.append(Case(f"hadamard_rotate {t} b={block}", _hadamard_kernel, had, c["num_warps"], cx))
        # the rotation inside the norm (Qwen2.5-0.5B's 896, Qwen2.5-1.5B's 1536, SmolLM2's 576 padded to 640)
        # and inside the activation (4864, 8960), into bf16 whatever the model's dtype
        # (SmolLM2's int8 576 in blocks of 64; with everything: a float32 norm weight (no rounding to x's dtype),
        # the widest row one program takes, blocks of 8)
        nrot = dict(x_ptr=t, r_ptr=t, w_ptr=t, s_ptr="fp32", o_ptr="bf16", ro_ptr=t)
        rows = [(896, 896, 128, *norms[0], True), (1536, 1536, 128, *norms[-1], True),
                (576, 640, 128, True, False, True), (576, 576, 64, True, False, True)]
        if everything:
            rows += [(896, 896, 128, True, False, False), (8192, 8192, 128, True, False, True),
                     (40, 48, 8, True, False, True)]
        for dim, k, b, add, wf, rnd in rows:
            cx = dict(ADD=add, WEIGHT_IN_FLOAT=wf, NORM_ROUND=rnd, NBP=next_pow2(k // b), B=b, LOG_B=b.bit_length() - 1)
            warps = 4 if dim <= 2048 else 8  # as the launcher picks them
            out.append(Case(f"norm_rotate {t} dim={dim} k={k} b={b} add={add} round={rnd}", _norm_rotate_kernel, nrot,
                            warps, cx, False))  # fmt: skip
        for act, b in ((0, 128), (1, 64), (2, 8)) if everything else ((0, 128),):
            c = hadamard_config(8960 // b, b, False)
            cx = dict(ACT=act, BLOCK_R=c["block_r"], B=b, LOG_B=b.bit_length() - 1)
            out.append(Case(f"gated_act_rotate {t} act={act} b={b}", _gated_act_rotate_kernel,
                            dict(gu_ptr=t, s_ptr="fp32", o_ptr="bf16"), c["num_warps"], cx, False))  # fmt: skip
        # the same inside the int4 GEMV: Qwen2.5-0.5B's qkv (first layer: no residual), gate_up and down (SiLU);
        # SmolLM2's 576 padded to 640; with everything: Gemma-3's float32 norm weight and gelu-tanh, blocks of 8
        r4 = dict(x_ptr=t, r_ptr=t, nw_ptr=t, sg_ptr="fp32", t_ptr="bf16", ro_ptr=t, qw_ptr="u8", sc_ptr="bf16",
                  z_ptr="bf16", o_ptr="bf16")  # fmt: skip
        rot4 = [(1152, 896, 128, False, None), (9728, 896, 128, True, None), (896, 4864, 128, False, 0),
                (960, 640, 128, True, None)]
        if everything:
            rot4 += [(1536, 640, 128, True, None), (640, 2048, 128, False, 1), (64, 48, 8, True, None)]
        for n, k, b, add, act in rot4:
            c = rotate_gemv_config(k, n, b, 128 if k % 128 == 0 else 16, False)
            assert c is not None
            wf = everything and n == 1536  # Gemma-3: the norm's weight in float32, the product in float32
            cx = dict(GATED=act is not None, ADD=add, WEIGHT_IN_FLOAT=wf, NORM_ROUND=not wf, ACT=act or 0, RB=c["rb"],
                      B=b, LOG_B=b.bit_length() - 1, BLOCK_N=c["block_n"], GROUPS=c["groups"], HALF_G=c["half_g"])
            out.append(Case(f"rotate_int4 {t} n={n} k={k} b={b} add={add} act={act}", _rotate_int4_kernel,
                            dict(r4, nw_ptr="fp32" if wf else t), c["num_warps"], cx, False))  # fmt: skip
        # a norm in a dense GEMV: Qwen2.5-0.5B's qkv (first layer: no residual) and gate_up with SiLU, the head;
        # Gemma-3's norm weight in float32 and gelu-tanh
        ngv = dict(x_ptr=t, r_ptr=t, nw_ptr=t, w_ptr=t, o_ptr=t, ro_ptr=t)
        gemvs = [(1152, 896, False, False, None), (4864, 896, True, False, 0), (151936, 896, False, False, None)]
        if everything:
            gemvs += [(6144, 640, True, True, 1), (2048, 1536, True, False, None)]
        for n_out, dim, add, wf, act in gemvs:
            c = norm_gemv_config(n_out, dim, False, act is not None)
            cx = dict(ADD=add, WEIGHT_IN_FLOAT=wf, GATED=act is not None, ACT=act or 0, BLOCK_N=c["block_n"],
                      BLOCK_K=c["block_k"])  # fmt: skip
            out.append(Case(f"norm_gemv {t} out={n_out} dim={dim} add={add} act={act}", _norm_gemv_kernel,
                            dict(ngv, nw_ptr="fp32" if wf else t), c["num_warps"], cx, False))  # fmt: skip
        shape = dict(l_ptr=t, t_ptr="fp32", o_ptr="fp32", bm_ptr="i32", bo_ptr="i32", bt_ptr="i32", bv_ptr="fp32",
                     pr_ptr="i32", c_ptr="i32", pm_ptr="u8", f_ptr="fp32")  # fmt: skip
        for on in (True, False) if everything else (True,):
            cx = dict(HAS_MASK=on, HAS_BIAS=on, HAS_PEN=on, BLOCK=1024, BLOCK_B=16)
            out.append(Case(f"shape_logits {t} stages={on}", _shape_kernel, shape, 4, cx, False))
    # selection reads the shaped float32 logits, whatever the model's dtype
    sel = dict(x_ptr="fp32", t_ptr="fp32", mp_ptr="fp32", k_ptr="i32", p_ptr="fp32", key_ptr="i64", tok_ptr="i64",
               f_ptr="fp32")  # fmt: skip
    for write in (False, True):
        cx = dict(WRITE=write, LIBM=True, BLOCK=512)
        out.append(Case(f"select_tokens fp32 filtered={write}", _select_kernel, sel, 8, cx, False))
    return out


def main(argv: list[str] | None = None) -> int:
    """Compile every case; print one line each; exit status 1 if any failed."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="cuda:90")
    ap.add_argument("--all", action="store_true", help="fp32 variants and more shapes too")
    ns = ap.parse_args(argv)
    target = parse_target(ns.target)
    failed = 0
    for case in cases(ns.all):
        try:
            k = case.compile(target)
            print(f"ok    {case.name}  (shared memory {k.metadata.shared} B)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failed += 1
            # the compiler's reason sits at the end of the innermost error (a jit helper's), not the kernel's
            inner = e
            while inner.__cause__ is not None:
                inner = inner.__cause__
            print(f"FAIL  {case.name}: {type(e).__name__}: {str(e)[-1500:]}", flush=True)
            if inner is not e:
                print(f"      because {type(inner).__name__}: {str(inner)[-1500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
