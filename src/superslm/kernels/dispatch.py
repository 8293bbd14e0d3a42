"""One place that picks, per call, the Triton kernel or its torch reference of the same signature.

`SUPERSLM_KERNELS` chooses: "auto" (the default) runs Triton on a CUDA (or ROCm) tensor when
triton imports, the torch reference otherwise; "torch" always runs the references; "triton"
always runs the kernels, also on a CPU tensor when TRITON_INTERPRET=1 was set before the first
kernel import (how CI tests them). The references for the fused ops that have no torch module of
their own (`add_rms_norm_reference`, `int4_matmul_reference`, `int8_matmul_reference`,
`hadamard_rotate_reference`) live here; those of device-side sampling
in sampling/on_device.py (their inputs, `LogitBias` and `Penalties`, in kernels/sampling_args.py).
Deterministic steps (meta.deterministic) take the batch-invariant attention: its Triton kernel or its reference.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from superslm.errors import InvalidArgument, UnsupportedModel
from superslm.kernels import attention as _attention
from superslm.kernels import attention_invariant as _attention_invariant
from superslm.kernels import fused as _fused
from superslm.kernels import norm as _norm
from superslm.kernels import rope as _rope
from superslm.kernels.attention import AttnMetadata, QKVSpec
from superslm.kernels.row_blocks import by_row_blocks

ENV = "SUPERSLM_KERNELS"
CHOICES = ("auto", "triton", "torch")
#: most rows of a step whose dense linears after a norm run as `norm_linear`'s one-launch GEMV (0: never)
GEMV_ROWS_ENV = "SUPERSLM_NORM_GEMV_ROWS"
GEMV_ROWS_DEFAULT = 4
_triton_mod: ModuleType | None = None
_triton_error: str | None = None


def _load_triton() -> ModuleType | None:
    """superslm.kernels.triton, imported once; None (and the reason kept) when triton is missing."""
    global _triton_mod, _triton_error
    if _triton_mod is None and _triton_error is None:
        try:
            _triton_mod = importlib.import_module("superslm.kernels.triton")
        except ImportError as e:
            _triton_error = f"{type(e).__name__}: {e}"
    return _triton_mod


def mode() -> str:
    """The SUPERSLM_KERNELS setting ("auto" when unset)."""
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in CHOICES:
        raise InvalidArgument(f"{ENV} must be one of {CHOICES}, not {m!r}")
    return m


def backend(device: torch.device) -> str:
    """"triton" or "torch": the implementation the dispatched functions use for tensors on `device`."""
    m = mode()
    if m == "torch":
        return "torch"
    on_gpu = device.type == "cuda"  # ROCm tensors are "cuda" too
    if m == "auto":
        return "triton" if on_gpu and _load_triton() is not None else "torch"
    if _load_triton() is None:
        raise UnsupportedModel(f"{ENV}=triton, but triton cannot be imported ({_triton_error})")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnsupportedModel(f"{ENV}=triton on a {device.type} tensor needs TRITON_INTERPRET=1")
    return "triton"


def norm_gemv_rows() -> int:
    """SUPERSLM_NORM_GEMV_ROWS (default 4): the most rows for which the Triton path runs a norm and the dense
    linear after it as one GEMV launch (`norm_linear`); at more rows torch's matmul (cuBLAS) is the better."""
    raw = os.environ.get(GEMV_ROWS_ENV, "").strip()
    if not raw:
        return GEMV_ROWS_DEFAULT
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise InvalidArgument(f"{GEMV_ROWS_ENV} must be a whole number >= 0, not {raw!r}")
    return rows


def triton_kernels(device: torch.device) -> ModuleType | None:
    """superslm.kernels.triton where `backend(device)` is "triton", else None (the torch references)."""
    return _triton_mod if backend(device) == "triton" else None


def _kv_kernels(device: torch.device, *caches: torch.Tensor) -> ModuleType | None:
    """`triton_kernels(device)` for a call that reads or writes these KV caches: float pages, int8 rows or rotated
    4-bit rows (uint8; cache/kv.py), which the Triton kernels store and read themselves. A page format they do not
    know is refused by its dtype, never read as floats, and not handed to the references either (decode graphs
    replay static metadata the references would read wrong)."""
    t = triton_kernels(device)
    if t is not None:
        for c in caches:
            if c.dtype not in _KV_DTYPES:
                raise UnsupportedModel(f"{c.dtype} KV pages have no Triton kernels: use {ENV}=torch")
    return t


#: the caches' dtypes the Triton KV kernels take: float pages, int8 rows, 4-bit rows
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)


# --- references of the fused ops -------------------------------------------------------------


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual stream's update and the next norm's input."""
    h = residual + x
    return _norm.rms_norm(h, weight, eps, weight_in_float), h


#: x @ W^T for an int4 weight in the int4 format's stored state (kernels.fused.Int4Weight)
int4_matmul_reference = _fused.int4_matmul


def int8_matmul_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, tile_rows: int | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, computed in float32 from the dequantized weight.

    codes int8 [N, K], scale [N]: W = codes * scale[:, None], the int8 format's stored state. `tile_rows`: the
    kernel's rows per program (they change its rounding only); the reference has no tiles.
    """
    w = codes.float() * scale.float()[:, None]  # [N, K]
    return (x.float() @ w.T).to(x.dtype)


def dense_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile_rows: int = 16
) -> torch.Tensor:
    """F.linear(x, weight, bias) on `tile_rows` rows at a time (the last block zero-padded): x [..., K] -> [..., N].

    Deterministic mode's dense linear: BLAS picks its kernel by the shape, so every call has one shape."""
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # [M, K]
    y = by_row_blocks(lambda rows: F.linear(rows, weight, bias), x2, tile_rows)
    return y.reshape(*x.shape[:-1], weight.shape[0])


#: kernels.hadamard.Rotation's map step by step (kept under its older name)
hadamard_rotate_reference = _fused.hadamard_rotate


# --- dispatched entry points ------------------------------------------------------------------


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kernels.attention.store_kv on the chosen backend."""
    t = _kv_kernels(k.device, k_cache, v_cache)
    (t.store_kv if t else _attention.store_kv)(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """kernels.attention.paged_attention on the chosen backend (`paged_attention_invariant` in deterministic
    mode)."""
    if meta.deterministic:
        return paged_attention_invariant(q, k_cache, v_cache, meta, window, scale)
    t = _kv_kernels(q.device, k_cache, v_cache)
    return (t.paged_attention if t else _attention.paged_attention)(q, k_cache, v_cache, meta, window, scale)


def paged_attention_invariant(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """kernels.attention_invariant.paged_attention_invariant (batch-invariant attention) on the chosen backend."""
    t = _kv_kernels(q.device, k_cache, v_cache)
    fn = t.paged_attention_invariant if t else _attention_invariant.paged_attention_invariant
    return fn(q, k_cache, v_cache, meta, window, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False) -> torch.Tensor:
    """kernels.norm.rms_norm on the chosen backend."""
    t = triton_kernels(x.device)
    return (t.rms_norm if t else _norm.rms_norm)(x, weight, eps, weight_in_float)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` on the chosen backend: (normed, new residual) in one pass."""
    t = triton_kernels(x.device)
    return (t.add_rms_norm if t else add_rms_norm_reference)(x, residual, weight, eps, weight_in_float)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.rope.apply_rope on the chosen backend."""
    t = triton_kernels(x.device)
    return (t.apply_rope if t else _rope.apply_rope)(x, cos, sin)


def prepare_qkv(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """kernels.fused.prepare_qkv on the chosen backend: bias, q/k norms, RoPE and the KV store in one pass."""
    t = _kv_kernels(qkv.device, k_cache, v_cache)
    fn = t.prepare_qkv if t else _fused.prepare_qkv
    return fn(qkv, spec, cos, sin, k_cache, v_cache, slot_mapping)


def prepare_attention(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """kernels.fused.prepare_attention on the chosen backend (deterministic mode: `prepare_qkv`, then
    `paged_attention_invariant`)."""
    if meta.deterministic:
        q = prepare_qkv(qkv, spec, cos, sin, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_invariant(q, k_cache, v_cache, meta, spec.window, spec.scale)
    t = _kv_kernels(qkv.device, k_cache, v_cache)
    fn = t.prepare_attention if t else _fused.prepare_attention
    return fn(qkv, spec, cos, sin, k_cache, v_cache, meta)


def attention_linear(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    w: torch.Tensor,
) -> torch.Tensor:
    """kernels.fused.attention_linear on the chosen backend (deterministic mode: `prepare_attention`'s, then
    torch's matmul)."""
    t = None if meta.deterministic else _kv_kernels(qkv.device, k_cache, v_cache)
    if t is None:
        o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
        return torch.nn.functional.linear(o.reshape(o.shape[0], -1), w)
    return t.attention_linear(qkv, spec, cos, sin, k_cache, v_cache, meta, w)


def attention_rotate(
    qkv: torch.Tensor,
    spec: QKVSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """kernels.fused.attention_rotate on the chosen backend (deterministic mode: `prepare_attention`'s, then the
    rotation)."""
    t = None if meta.deterministic else _kv_kernels(qkv.device, k_cache, v_cache)
    if t is None:
        o = prepare_attention(qkv, spec, cos, sin, k_cache, v_cache, meta)
        return _fused.linear_input(o.reshape(o.shape[0], -1), signs, block, dtype, hadamard_rotate)
    return t.attention_rotate(qkv, spec, cos, sin, k_cache, v_cache, meta, signs, block, dtype)


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """kernels.fused.gated_act on the chosen backend."""
    t = triton_kernels(gate_up.device)
    return (t.gated_act if t else _fused.gated_act)(gate_up, act)


def norm_rotate(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.fused.norm_rotate on the chosen backend: (add +) norm, cast and input rotation in one pass."""
    t = triton_kernels(x.device)
    fn = t.norm_rotate if t else _fused.norm_rotate
    return fn(x, residual, weight, eps, weight_in_float, signs, block, dtype)


def gated_act_rotate(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """kernels.fused.gated_act_rotate on the chosen backend."""
    t = triton_kernels(gate_up.device)
    return (t.gated_act_rotate if t else _fused.gated_act_rotate)(gate_up, act, signs, block, dtype)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    w: torch.Tensor,
    act: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.fused.norm_linear on the chosen backend: (add +) norm, a dense linear (and the activation) at once."""
    t = triton_kernels(x.device)
    return (t.norm_linear if t else _fused.norm_linear)(x, residual, weight, eps, weight_in_float, w, act)


def norm_rotate_int4(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_in_float: bool,
    signs: torch.Tensor,
    block: int,
    dtype: torch.dtype,
    w4: _fused.Int4Weight,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.fused.norm_rotate_int4 on the chosen backend: norm_rotate and the int4 GEMV in one launch."""
    t = triton_kernels(x.device)
    fn = t.norm_rotate_int4 if t else _fused.norm_rotate_int4
    return fn(x, residual, weight, eps, weight_in_float, signs, block, dtype, w4)


def gated_act_rotate_int4(
    gate_up: torch.Tensor, act: str, signs: torch.Tensor, block: int, dtype: torch.dtype, w4: _fused.Int4Weight
) -> torch.Tensor:
    """kernels.fused.gated_act_rotate_int4 on the chosen backend."""
    t = triton_kernels(gate_up.device)
    return (t.gated_act_rotate_int4 if t else _fused.gated_act_rotate_int4)(gate_up, act, signs, block, dtype, w4)


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """`int4_matmul_reference` on the chosen backend."""
    t = triton_kernels(x.device)
    return (t.int4_matmul if t else int4_matmul_reference)(x, qweight, scale, zero, group, tile_rows)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, tile_rows: int | None = None
                ) -> torch.Tensor:  # fmt: skip
    """`int8_matmul_reference` on the chosen backend."""
    t = triton_kernels(x.device)
    return (t.int8_matmul if t else int8_matmul_reference)(x, codes, scale, tile_rows)


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile_rows: int = 16
                 ) -> torch.Tensor:  # fmt: skip
    """`dense_matmul_reference` on the chosen backend (Triton: one launch of fixed tiles)."""
    t = triton_kernels(x.device)
    return (t.dense_matmul if t else dense_matmul_reference)(x, weight, bias, tile_rows)


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """`hadamard_rotate_reference` on the chosen backend."""
    t = triton_kernels(x.device)
    return (t.hadamard_rotate if t else hadamard_rotate_reference)(x, signs, block)
