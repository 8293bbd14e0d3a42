"""Decode layers on the CPU in one call (kernels/cpu/decode_layers.cpp) and their torch reference.

At batch 1 the packed int4/int8 kernels take ~3.4 ms of a SmolLM2 decode step; eager PyTorch spent
~8 ms more on ~1,000 small calls between them. The C++ plan runs a model's layers with the same linears
and the glue in loops, one row at a time: for every all-decode step, and for every step in
deterministic mode (its per-row arithmetic is batch-invariant; models/transformer.py decides).

The extension (superslm/cext.py) is compiled once per machine with the system's C++ compiler and the
ninja wheel, into torch's extension cache; where that fails, or with `SUPERSLM_CPU_KERNELS=0`, models
take their generic torch path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.modules import module as _module

from superslm import cext
from superslm.cache.kv import rotated, rotation_block, rotation_signs, values_dtype
from superslm.cext import extension
from superslm.kernels import cpu_hybrid
from superslm.kernels.attention import store_kv
from superslm.kernels.dispatch import backend
from superslm.kernels.rope import apply_rope

_ACT = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


# --- the plan: a model's layers as the extension wants them --------------------------------------


def _lin(m: torch.nn.Module) -> tuple[list[torch.Tensor | None], list[int]] | None:
    """(a, b, bias, signs, hadamard, extra) and (kind, group, out, in, k_pad) of a linear, as its format hands
    them over (`plan_args`); None when the plan cannot run it. Kind 4 (a ConcatLinear) has no tensors:
    build_plan adds its parts with `plan.add_part`."""
    plan_args = getattr(m, "plan_args", None)
    return None if plan_args is None else plan_args()


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def build_plan(net: Any) -> Any:
    """The extension's DecodePlan for a Transformer, or None when a layer uses something it lacks
    (a format it does not know; an activation it does not know; a norm weight in another dtype; no extension).
    Parts layers (gated attention, delta rules, experts) are described by kernels/cpu_hybrid.py."""
    ext = extension()
    if ext is None:
        return None
    a = net.arch
    act = _ACT.get(a.act)
    if act is None:
        return None
    plan = ext.DecodePlan(a.heads, a.kv_heads, a.head_dim, a.rotary_dim, float(a.norm_eps), bool(a.norm_float),
                          act, float(a.attn_scale))
    if a.head_dim % 32 == 0:
        # the rotation cache/kv.py writes 4-bit rows in: the plan rotates queries and outputs by it, never the rows
        plan.set_kv_rotation(rotation_signs(a.head_dim), rotation_block(a.head_dim))
    for i, layer in enumerate(net.layers):
        parts_layer = cpu_hybrid.is_parts(layer)
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        parts: list[tuple[int, list[torch.Tensor | None], list[int]]] = []
        for j, m in enumerate(cpu_hybrid.linears(layer) if parts_layer else _linears(layer)):
            if m is None:  # a mixture of experts' layer: no dense MLP
                tensors += [None] * 6
                ints += [-1, 0, 0, 0, 0]
                continue
            got = _lin(m)
            if got is None:
                return None
            tensors += got[0]
            ints += got[1]
            for part in getattr(m, "parts", []) if got[1][0] == 4 else []:
                sub = _lin(part)
                if sub is None or sub[1][0] == 4:
                    return None
                parts.append((j, *sub))
        names = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
        layer_norms = cpu_hybrid.norms(layer) if parts_layer else [getattr(layer, n, None) for n in names]
        if any(w is not None and not (w.dtype == net.dtype or (w.dtype == torch.float32 and a.norm_float))
               for w in layer_norms):
            return None  # the plan multiplies by a weight in the model dtype, or by a float32 one in float32
        tensors += layer_norms
        window = a.windows[i]
        ints += [-1 if window is None else int(window), net.rope_key(i)]
        plan.add_layer(tensors, ints)
        for j, t, n in parts:
            plan.add_part(i, j, t, n)
        if parts_layer and not cpu_hybrid.describe(plan, net, i):
            return None
    return plan


#: how many submodules any nn.Module has registered (setattr, add_module, a container's items: torch's global
#: module registration hook): a net's modules can only have been swapped since its plan was checked if this moved
_registrations = 0


def _count_registration(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    global _registrations
    _registrations += 1


_module.register_module_module_registration_hook(_count_registration)


def plan_for(net: Any) -> Any:
    """The net's plan, built once and rebuilt when its linear modules are swapped (quant.swap)."""
    cached = getattr(net, "_decode_plan", None)
    if cached is not None and cached[3] == _registrations:
        return cached[1]  # no module registered anywhere since the check: the key below cost ~1.4 ms a call (MoE)
    seen = _registrations
    # every submodule of every layer, read from _modules (nn.Module's __getattr__ made this 75 us a step)
    key = tuple(id(m) for layer in net.layers for m in layer._modules.values())
    if not getattr(net, "plain", True):  # a parts layer's linears sit one level down (cpu_hybrid.module_key)
        key += tuple(i for layer in net.layers for i in cpu_hybrid.module_key(layer))
    if cached is not None and cached[0] == key:
        net._decode_plan = (*cached[:3], seen)
        return cached[1]
    plan = build_plan(net)
    net._decode_plan = (key, plan, _layer_modules(net), seen)
    return plan


def _layer_modules(net: Any) -> list[torch.nn.Module]:
    """The layers and the modules in them, two levels down (where a parts layer's linears sit)."""
    out = []
    for layer in net.layers:
        out.append(layer)
        for m in layer._modules.values():
            if m is not None:
                out.append(m)
                out += [sub for sub in m._modules.values() if sub is not None]
    return out


# --- inputs -----------------------------------------------------------------------------------------


def decode_key_slots(block_tables: tuple[tuple[int, ...], ...], seq_lens: tuple[int, ...], page_size: int,
                     device: torch.device) -> torch.Tensor:
    """[B, L] KV slots of each row's keys in position order (L = the longest; the rest is padding)."""
    longest = max(seq_lens)
    pages = -(-longest // page_size)
    # numpy for these few small arrays: a step's torch ops here cost ~130 us of a decode step, numpy's ~20
    table = np.zeros((len(seq_lens), pages), dtype=np.int64)
    for i, (t, n) in enumerate(zip(block_tables, seq_lens)):
        used = -(-n // page_size)
        table[i, :used] = t[:used]
    slots = (table[:, :, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(len(seq_lens), -1)
    return torch.from_numpy(np.ascontiguousarray(slots[:, :longest])).to(device)


# --- the kernel and its reference ---------------------------------------------------------------------


def decode_layers_reference(
    net: Any,
    h: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_slots: torch.Tensor,
    row_seq: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: list[tuple[torch.Tensor, torch.Tensor]],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    end: int,
    deterministic: bool = False,
    lora: Any = None,
    states: Any = None,
    state_slots: Sequence[int] = (),
) -> torch.Tensor:
    """Layers start..end-1 for rows that each decode one token (torch ops, one row's attention at a time).

    h [B, dim]; slot_mapping [B]; key_slots [S, L] each sequence's key slots; row_seq [B] each row's
    sequence; seq_lens [B] keys visible to each row; tables[kind] = (cos, sin) [B, rotary_dim]; caches
    [layers, slots, kv_heads, width] in a page format of cache/kv.py (float rows of h's dtype, or int8 or 4-bit rows:
    quantized as written, dequantized as read, 4-bit rows also rotated back); lora: the step's adapters
    (adapters/lora.py LoraBatch) or None. Parts layers (cpu_hybrid.layer_reference): one decode row of each
    sequence, their KV pages at the layer's net.cache_index, a delta rule's recurrent states `states`
    (cache/state.py RecurrentStates) at rows `state_slots` [B].
    `deterministic` changes the plan's roundings only.
    """
    from superslm.kernels.fused import gated_act

    a = net.arch
    n = h.shape[0]
    qs, ks = a.heads * a.head_dim, a.kv_heads * a.head_dim
    for i in range(start, end):
        layer = net.layers[i]
        if cpu_hybrid.is_parts(layer):
            h = cpu_hybrid.layer_reference(net, i, h, slot_mapping, key_slots, row_seq, seq_lens, tables, k_cache,
                                           v_cache, states, state_slots)
            continue
        x = layer.norm(h, "attn_norm")
        qkv = layer.qkv(x)
        if lora is not None:
            qkv = lora.apply(i, "qkv", x, qkv)
        q = qkv[:, :qs].view(n, a.heads, a.head_dim)
        k = qkv[:, qs : qs + ks].view(n, a.kv_heads, a.head_dim)
        v = qkv[:, qs + ks :].view(n, a.kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = layer.norm(q, "q_norm"), layer.norm(k, "k_norm")
        cos, sin = tables[net.rope_key(i)]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv(k_cache[i], v_cache[i], k, v, slot_mapping)
        o = cpu_hybrid.attend_rows_reference(q, k_cache[i], v_cache[i], key_slots, row_seq, seq_lens, a.windows[i],
                                             a.attn_scale)
        o_in = o.reshape(n, qs)
        o = layer.o(o_in)
        if lora is not None:
            o = lora.apply(i, "o", o_in, o)
        if a.post_norms:
            o = layer.norm(o, "post_attn_norm")
        h = h + o
        x = layer.norm(h, "ffn_norm")
        gu = layer.gate_up(x)
        if lora is not None:
            gu = lora.apply(i, "gate_up", x, gu)
        act = gated_act(gu, a.act)
        y = layer.down(act)
        if lora is not None:
            y = lora.apply(i, "down", act, y)
        if a.post_norms:
            y = layer.norm(y, "post_ffn_norm")
        h = h + y
    return h


def decode_layers(
    net: Any,
    h: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_slots: torch.Tensor,
    row_seq: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: list[tuple[torch.Tensor, torch.Tensor]],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    end: int,
    deterministic: bool = False,
    lora: Any = None,
    states: Any = None,
    state_slots: Sequence[int] = (),
) -> torch.Tensor:
    """`decode_layers_reference` through the C++ plan where it can run (CPU, a supported model).

    Rows are independent: a row's arithmetic never depends on the others (per-row norms, rope and
    attention loops; the packed int kernels are row-invariant), so with `deterministic` (dense GEMMs
    padded to 16 rows, the VNNI kernels at every row count) every row gets the same bits in any batch,
    and prompt rows may be passed too (each with its own key count).
    """
    plan = plan_for(net) if h.device.type == "cpu" and plan_reads(h, k_cache, v_cache) else None
    if plan is None:
        return decode_layers_reference(net, h, slot_mapping, key_slots, row_seq, seq_lens, tables, k_cache, v_cache,
                                       start, end, deterministic, lora, states, state_slots)
    cos = [t[0].contiguous() for t in tables]
    sin = [t[1].contiguous() for t in tables]
    lora_rows, lora_weights = _plan_lora(lora, len(net.layers), h.shape[0])
    none = torch.empty(0)
    conv, ssm = (none, none) if states is None else (states.conv, states.ssm)
    return plan.run(h.contiguous(), slot_mapping, key_slots, row_seq, seq_lens, cos, sin, k_cache, v_cache, start,
                    end, deterministic, lora_rows, lora_weights, conv, ssm,
                    torch.tensor(list(state_slots), dtype=torch.long))


def _plan_lora(lora: Any, layers: int, rows: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The plan's adapter operands: each row's group (-1: none) and every group's (A, B) per layer and linear."""
    if lora is None or not lora.groups:
        return torch.empty(0, dtype=torch.long), []
    row_group = torch.full((rows,), -1, dtype=torch.long)
    weights: list[torch.Tensor | None] = []
    for g, (adapter, idx) in enumerate(lora.groups):
        row_group[idx] = g
        weights += adapter.plan_weights(layers)
    return row_group, weights


def row_key_slots(meta: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([S, L] key slots of each sequence, [N] each row's sequence, [N] visible key counts) of a step: a row
    sees its sequence's keys up to its own position (prompt chunks and decode rows alike)."""
    per_seq = decode_key_slots(meta.block_tables, meta.seq_lens, meta.page_size, device)  # [S, L]
    qs = meta.query_start
    seqs = len(meta.seq_lens)
    if tuple(qs) == tuple(range(seqs + 1)):  # one row a sequence (every decode step): row i is sequence i's
        rows = torch.arange(seqs, device=device)
    else:
        counts = np.diff(np.asarray(qs, dtype=np.int64))
        rows = torch.from_numpy(np.repeat(np.arange(seqs, dtype=np.int64), counts)).to(device)
    return per_seq, rows, (meta.positions[: rows.shape[0]] + 1).contiguous()


def _int8_fits(module: torch.nn.Module) -> bool:
    """Whether the C++ int8 GEMVs (VNNI or AVX2) take `module`: an int8 format (codes, a scale per channel) with K
    a multiple of 64, unpadded unless rotated (`_vnni_input` pads and rotates)."""
    if not getattr(module, "int8_codes", False):
        return False
    return module.k_pad % 64 == 0 and (module.rotation is not None or module.k_pad == module.in_features)


def _with_bias(module: torch.nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A kernel's bf16 output with the module's bias added in float, in x's dtype (as the module returns it)."""
    if module.bias is not None:
        y = y.float() + module.bias
    return y.to(x.dtype)


def _vnni_int8(module: torch.nn.Module) -> tuple[Any, torch.Tensor] | None:
    """(extension, the codes' row sums, cached on the module) where the VNNI int8 kernels run `module`: one
    that `_int8_fits`, the kernels built with VNNI."""
    ext = cext.vnni()
    if ext is None or not _int8_fits(module):
        return None
    return ext, _rowsum(ext, module)


def _rowsum(ext: Any, module: torch.nn.Module) -> torch.Tensor:
    """The int8 codes' row sums (int32 [N]), cached on the module until its codes change shape."""
    rowsum = getattr(module, "_rowsum", None)
    if rowsum is None or rowsum.shape[0] != module.codes.shape[0]:
        rowsum = module._rowsum = ext.int8_rowsum(module.codes)
    return rowsum


def _vnni_input(ext: Any, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x as the module's kernel takes it: as it is, or for a rotated module padded and rotated row by row in
    float, bf16 out (decode_layers.cpp hadamard_rows: a row's bits do not depend on the batch)."""
    rot = module.rotation
    if rot is None:
        return x
    return ext.hadamard_rows(x, rot.signs, rot.block, module.k_pad)


def vnni_linear(module: torch.nn.Module, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor | None:
    """module(x) through the VNNI int8 kernels (kernels/cpu/gemv.cpp, gemm.cpp), or None where they do not
    apply (another format, K not a multiple of 64, a CPU or build without AVX-512 VNNI), or where torch's
    kernel is as fast: several rows outside deterministic mode on CPUs with AVX512-BF16 (`gemm_rows`,
    kernels/cpu/gemv.cpp). A row gets the same bits alone or in a batch. Without VNNI, 1 to `avx2_gemm_rows`
    rows of the default mode take the AVX2 kernels (kernels/cpu/avx2.cpp, avx2_rows.cpp: the same bits)."""
    rows = x.shape[0]
    if rows == 0 or x.device.type != "cpu":
        return None
    got = _vnni_int8(module)
    if got is None:
        return None if deterministic else _avx2_int8(module, x)
    ext, rowsum = got
    if rows > 1 and not deterministic and rows < ext.gemm_rows(True):
        return None
    kernel = ext.int8_gemv if rows == 1 else ext.int8_gemm
    return _with_bias(module, kernel(_vnni_input(ext, module, x), module.codes, module.scale, rowsum), x)


def hooked(module: torch.nn.Module) -> bool:
    """Whether hooks watch the module or its input rotation: their kernels must not run it past them."""
    rot = getattr(module, "rotation", None)
    return bool(module._forward_pre_hooks or module._forward_hooks or (
        rot is not None and (rot._forward_pre_hooks or rot._forward_hooks)))


def one_row_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`rows_linear` for one row (x [1, K]), else None."""
    return rows_linear(module, x) if x.dim() == 2 and x.shape[0] == 1 else None


def rows_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """module(x) for decode rows of the default mode through the kernels that the C++ plan runs them on (int4, int5
    and int8 formats, as their `plan_args` hand them over; a ConcatLinear part by part), or None where they do not
    apply (another format or shape, hooks on the module or its rotation, neither VNNI nor AVX2, several rows
    where the plan takes torch's kernel): layers the plan does not run (delta rules, experts) read their weights
    at the plan's speed. One row: the GEMVs; without VNNI, 2 to `avx2_gemm_rows` rows: the AVX2 row kernels
    (kernels/cpu/avx2_rows.cpp), each row the AVX2 GEMV's bits; IQ4 up to its `iq4_gemv_rows`: its integer rows
    kernel (each row the one-row GEMV's bits). Not for deterministic mode, where every row count must share one
    kernel's bits."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if rows == 0 or x.device.type != "cpu" or backend(x.device) != "torch":
        return None  # the Triton kernels were asked for (SUPERSLM_KERNELS=triton: the interpreter's tests)
    if hooked(module):
        return None
    ext = cext.extension()
    plan_args = getattr(module, "plan_args", None)
    got = None if ext is None or plan_args is None else plan_args()
    if got is None:
        return None
    (weight, scales, *_), (kind, group, out, _, k_pad) = got
    if kind == 6:  # IQ4 (quant/iq4.py): its GEMV needs AVX2 only, and plan_args said it runs here
        if rows > ext.iq4_gemv_rows(x.shape[1], weight.shape[0]):
            return None
        return _with_bias(module, ext.iq4_gemv(x.to(torch.bfloat16), weight, scales, got[0][5]), x)
    if kind == 7:  # Q6_K (quant/q6k.py): its integer GEMV needs AVX2 only and takes up to 64 rows, each its own bits
        return _with_bias(module, ext.q6k_gemv(x.to(torch.bfloat16), weight), x) if rows <= 64 else None
    if kind == 8:  # Q8_0 (quant/q80.py): its integer GEMV needs AVX2 only and takes up to 64 rows, each its own bits
        return _with_bias(module, ext.q80_gemv(x.to(torch.bfloat16), weight, scales), x) if rows <= 64 else None
    if kind == 2:
        return vnni_linear(module, x) if rows == 1 or not ext.vnni_available() else None
    if kind == 5:  # Q5_0 (quant/int5.py): the VNNI kernels, else the AVX2 ones (the same bits); plan_args said which
        y = (ext.int5_gemv if rows == 1 else ext.int5_gemm)(x.to(torch.bfloat16), weight, scales, got[0][5])
        return _with_bias(module, y if y.shape[1] == out else y[:, :out], x)
    if kind == 4:  # a ConcatLinear: its parts side by side, each as the plan runs it
        ys = [rows_linear(part, x) for part in getattr(module, "parts", ())]
        return torch.cat(ys, dim=1) if ys and all(y is not None for y in ys) else None  # type: ignore[misc]
    if kind != 1:
        return None
    return _int4_rows(ext, module, x, got, any_rows=False)


def int4_prompt_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """module(x) for any number of rows of the default mode through the AVX2 int4 row kernel
    (kernels/cpu/avx2_rows.cpp), each row the one-row GEMV's bits (or torch's kernel on that row alone where the
    GEMV declines it), or None where it does not apply: another format, hooks, a CPU with VNNI or without AVX2,
    the Triton kernels or torch's kernels asked for. A prompt chunk's rows then get the bits decode gives them, but
    for rows the GEMV declines (activations with outliers): past `avx2_gemm_rows` rows those go together through one
    call of torch's kernel (int4_prompt_avx2), not one a row."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if rows == 0 or x.device.type != "cpu" or backend(x.device) != "torch" or hooked(module):
        return None
    ext = cext.extension()
    plan_args = getattr(module, "plan_args", None)
    got = None if ext is None or plan_args is None else plan_args()
    if got is None or got[1][0] != 1 or ext.vnni_available():
        return None
    return _int4_rows(ext, module, x, got, any_rows=True)


def _int4_rows(ext: Any, module: torch.nn.Module, x: torch.Tensor, got: Any, any_rows: bool) -> torch.Tensor | None:
    """`rows_linear`'s int4 part (`got`: the module's plan_args); `any_rows`: past `avx2_gemm_rows` rows too."""
    (weight, scales, *_), (_, group, out, _, k_pad) = got
    rows = x.shape[0]
    if group % 4 or weight.shape[0] % 64 or not scales.is_contiguous():
        return None
    vnni = ext.vnni_available()
    if not vnni and (not ext.avx2_available() or cext.torch_kernels_forced()):
        return None
    if rows > 1 and (vnni or (rows > ext.avx2_gemm_rows() and not any_rows)):
        return None
    h = _vnni_input(ext, module, x).to(torch.bfloat16)  # rotated and padded where the module rotates
    if k_pad != h.shape[1]:
        h = torch.nn.functional.pad(h, (0, k_pad - h.shape[1]))
    # block 0: torch's packed layout on this CPU, which the int4 format keeps where the VNNI kernels do not run
    if vnni:
        y = ext.int4_gemv(h, weight, scales, group)
    elif rows > ext.avx2_gemm_rows():  # a prompt chunk: the rows the row kernel declines in one call of torch's
        y = ext.int4_prompt_avx2(h, weight, scales, group)
    else:  # the row kernel gives each row the GEMV's bits, or torch's kernel on that row alone where it declines
        y = (ext.int4_gemv_avx2 if rows == 1 else ext.int4_gemm_avx2)(h, weight, scales, group, 0)
    if y is None:  # a row the GEMV cannot split (NaN, inf, an outlier), or a layout it does not read
        return None
    return _with_bias(module, y if y.shape[1] == out else y[:, :out], x)


def int8_prompt_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """module(x) for prompt rows (past `avx2_gemm_rows`) of the default mode through the AVX2 two-part int8 kernel
    (kernels/cpu/pair_rows.cpp int8_prompt_avx2: x split per group of 32 into two int8 parts, exact int32 sums; the
    rows it cannot split through torch's kernel), or None where it does not apply: another format, hooks, a CPU with
    VNNI or without AVX2, torch's kernels asked for."""
    if x.dim() != 2 or x.device.type != "cpu" or backend(x.device) != "torch" or hooked(module):
        return None
    ext = cext.extension()
    if ext is None or ext.vnni_available() or not ext.avx2_available() or cext.torch_kernels_forced():
        return None
    if x.shape[0] <= ext.avx2_gemm_rows() or not _int8_fits(module):
        return None
    y = ext.int8_prompt_avx2(_vnni_input(ext, module, x).to(torch.bfloat16), module.codes, module.scale)
    return None if y is None else _with_bias(module, y, x)


def _avx2_int8(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """module(x) for 1 to `avx2_gemm_rows` rows through the AVX2 int8 kernels (kernels/cpu/avx2.cpp GEMV, the
    VNNI GEMV's bits; avx2_rows.cpp for several rows, each row the GEMV's bits or, where the GEMV declines it,
    torch's kernel on that row alone), or None where they do not apply. Not in deterministic mode (left on
    torch's kernel at every row count)."""
    ext = cext.extension()
    if ext is None or not ext.avx2_available() or cext.torch_kernels_forced():
        return None
    if x.shape[0] > ext.avx2_gemm_rows() or not _int8_fits(module):
        return None
    kernel = ext.int8_gemv_avx2 if x.shape[0] == 1 else ext.int8_gemm_avx2
    y = kernel(_vnni_input(ext, module, x), module.codes, module.scale)
    if y is None:  # x cannot be split (a NaN, an inf, an outlier): torch's kernel
        return None
    return _with_bias(module, y, x)


#: a union of candidates larger than this costs more to rescore than it saved: the caller takes the full head
GREEDY_MAX_CANDIDATES = 4096
#: rows from which the one-part approximation pays (below, the head is read at memory speed either way: on the
#: AVX2 kernels too, Gemma-3's head [262144, 640] at one row took as long either way, 4 rows 1.04-1.11x, 16 rows
#: 1.31-1.38x faster; 2-core EPYC, benchmarks in docs/benchmarks.md)
GREEDY_MIN_ROWS = 4
#: the widest head input kernels/cpu/greedy.cpp takes (its per-row channel tables)
GREEDY_MAX_K = 1024


def _greedy_kernels(module: torch.nn.Module, rows: int, deterministic: bool
                    ) -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]] | None:
    """(extension, the codes' row sums, the exact kernel: (x, codes, scale, rowsum) -> bf16 logits) for the
    certified greedy head, or None: from `GREEDY_MIN_ROWS` rows, the VNNI kernels; else the AVX2 ones in the
    default mode up to `avx2_gemm_rows` rows, where `logits` runs the head on them (each output the GEMV's bits;
    deterministic mode and more rows take torch's kernel, whose roundings the certificate does not speak for)."""
    if rows < GREEDY_MIN_ROWS:
        return None
    got = _vnni_int8(module)
    if got is not None:
        ext, rowsum = got
        return ext, rowsum, ext.int8_gemm
    ext = cext.extension()
    if deterministic or ext is None or cext.torch_kernels_forced() or not ext.avx2_available():
        return None
    if rows > ext.avx2_gemm_rows() or not _int8_fits(module):
        return None
    return ext, _rowsum(ext, module), lambda x, codes, scale, _sums: ext.int8_gemm_avx2(x, codes, scale)


def greedy_head(module: torch.nn.Module, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor | None:
    """int64 [M]: argmax over the vocabulary of the head's logits as `vnni_linear` gives them (first index on
    ties), or None where that path does not apply or the bound was too loose (the caller computes the full
    logits).

    A one-part int8 pass bounds every logit (kernels/cpu/greedy.cpp, AVX-512 VNNI or AVX2); only the candidates
    that can be a row's argmax get their exact logits, from the same kernels as the full head: the same tokens
    for half the products. A head whose candidates keep overflowing (a model whose activations quantize coarsely)
    stops trying once more than half of its calls (8 at least) fell back."""
    if x.shape[0] == 0 or x.device.type != "cpu" or getattr(module, "bias", None) is not None:
        return None
    got = _greedy_kernels(module, x.shape[0], deterministic)
    if got is None or module.k_pad > GREEDY_MAX_K:
        return None
    ext, rowsum, exact = got
    stats = module.__dict__.setdefault("_greedy_stats", [0, 0])  # [calls, fallbacks]
    if stats[0] >= 8 and stats[1] * 2 > stats[0]:
        return None
    w2 = getattr(module, "_greedy_w2", None)
    if w2 is None or w2.shape[0] != module.codes.shape[0]:
        w2 = module._greedy_w2 = ext.int8_rownorm(module.codes, module.scale)  # ||codes_n||_2 * scale_n, rounded up
    stats[0] += 1
    x = _vnni_input(ext, module, x)
    union, ok = ext.int8_greedy_candidates(x, module.codes, module.scale, rowsum, w2, GREEDY_MAX_CANDIDATES)
    if not ok or union.numel() == 0:  # none: every bound NaN (a NaN scale), the full head says what it says
        stats[1] += 1
        return None
    y = exact(x, module.codes.index_select(0, union).contiguous(), module.scale.index_select(0, union),
              rowsum.index_select(0, union))
    return union[y.float().argmax(dim=1)]


def _rows_read(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the plan reads quantized rows of this dtype: int8 rows, or rotated 4-bit rows (uint8) with
    head_dim a multiple of 32 (the rotation it was given; the unrotated comparison rows of cache/kv.py are not)."""
    if dtype == torch.int8:
        return True
    return dtype == torch.uint8 and head_dim % 32 == 0 and rotated(torch.empty(0, dtype=torch.uint8))


def plan_reads(h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> bool:
    """Whether the C++ plan reads these KV caches: float pages of h's dtype for both keys and values, or keys and
    values each in int8 rows (codes and a float32 scale per token and head, cache/kv.py) or rotated 4-bit rows
    (uint8: codes two a byte and a scale, attended in their rotated basis), mixed as "k8v4" and "k4v8" mix them.
    Anything else takes the torch path. Without `v_cache`, the values' dtype KVCache noted on k_cache."""
    v_dtype = values_dtype(k_cache) if v_cache is None else v_cache.dtype
    dtypes = (k_cache.dtype, v_dtype)
    if all(d == h.dtype for d in dtypes):
        return True
    if k_cache.dim() < 1:
        return False
    # the head_dim from the keys' width: D + 4 for int8 rows, D / 2 + 4 for 4-bit rows
    width = k_cache.shape[-1] - 4
    head_dim = width if k_cache.dtype == torch.int8 else 2 * width
    return all(_rows_read(d, head_dim) for d in dtypes)


def usable(net: Any, h: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ plan runs this model's steps here: CPU, bf16 or fp32 with the caches in that dtype or in
    int8 or rotated 4-bit rows (`plan_reads`), the extension built, and no request for the torch kernels
    (SUPERSLM_KERNELS=torch)."""
    if h.device.type != "cpu" or h.dtype not in (torch.float32, torch.bfloat16) or not plan_reads(h, k_cache):
        return False
    if cext.torch_kernels_forced():
        return False
    return plan_for(net) is not None and not watched(net)


def watched(net: Any) -> bool:
    """Whether a forward hook watches one of the layers or the modules in them (two levels down, where a parts
    layer's linears sit), or every module (torch's global hooks): the plan runs whole layers in one call, past
    them, so such a step keeps the modules (the modules listed once with the plan, ~150 dict checks a step)."""
    cached = getattr(net, "_decode_plan", None)
    return any_hooked(cached[2] if cached is not None else _layer_modules(net))


def any_hooked(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether a forward hook watches one of `modules` (or every module: torch's global hooks)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    return any([m._forward_hooks or m._forward_pre_hooks for m in modules])
