"""Triton kernels, each with the signature and meaning of its torch reference (see kernels/dispatch.py).

Importing this package imports triton; on a CPU tensor the kernels only run under the Triton
interpreter (TRITON_INTERPRET=1 set before the import).
"""

from superslm.kernels.triton.attention_linear import attention_linear, attention_rotate
from superslm.kernels.triton.delta_rule import delta_decode_step, delta_prompt_rows
from superslm.kernels.triton.dense_gemm import dense_matmul
from superslm.kernels.triton.fused import gated_act, prepare_qkv
from superslm.kernels.triton.hadamard import hadamard_rotate
from superslm.kernels.triton.int4_gemv import int4_matmul
from superslm.kernels.triton.int8_gemv import int8_matmul
from superslm.kernels.triton.norm_gemv import norm_linear
from superslm.kernels.triton.norm_rotate import gated_act_rotate, norm_rotate
from superslm.kernels.triton.paged_args import PagedArgs, build_paged_args, paged_args
from superslm.kernels.triton.paged_attention import (
    paged_attention,
    paged_attention_args,
    paged_attention_invariant,
    prepare_attention,
)
from superslm.kernels.triton.rmsnorm import add_rms_norm, rms_norm
from superslm.kernels.triton.rope import apply_rope
from superslm.kernels.triton.rotate_gemv import gated_act_rotate_int4, norm_rotate_int4
from superslm.kernels.triton.sampling import select_tokens, shape_logits
from superslm.kernels.triton.store_kv import store_kv

__all__ = [
    "PagedArgs",
    "add_rms_norm",
    "attention_linear",
    "attention_rotate",
    "apply_rope",
    "delta_decode_step",
    "delta_prompt_rows",
    "dense_matmul",
    "gated_act",
    "gated_act_rotate",
    "gated_act_rotate_int4",
    "hadamard_rotate",
    "int4_matmul",
    "int8_matmul",
    "norm_linear",
    "norm_rotate",
    "norm_rotate_int4",
    "rms_norm",
    "build_paged_args",
    "paged_args",
    "paged_attention",
    "paged_attention_args",
    "paged_attention_invariant",
    "prepare_attention",
    "prepare_qkv",
    "select_tokens",
    "shape_logits",
    "store_kv",
]
