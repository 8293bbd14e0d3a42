"""A mixture-of-experts block's decode rows in one C++ call (kernels/cpu/moe_step.cpp) and its torch twin.

models/layers.py MoE ran a decode step as ~100 small torch ops and Python calls a layer (softmax, top k,
argsort, bincount, index_add_, the experts' DenseMLPs, the shared expert and its gate): on the MoE 1.8B config
~0.6 ms a layer around ~0.1 ms of weight reads. `moe_decode` runs the block in one call on the CPU: the
routing, each chosen expert's linears on the decode plan's kernels (plan_linear.h: int4, int8, dense, rotated
inputs, concatenated parts) with its rows gathered so its weights are read once, and the weighted sum.

A row that is an expert's only row gets `moe_decode_reference`'s bits: the same GEMVs (cpu_decode.rows_linear
runs the plan's), the same ATen ops for the routing and the activation, the sums rounded where torch rounds them;
a rotated linear no GEMV takes is left to the twin (the module rotates in bf16, the plan in float). An expert
with several rows runs them as the plan does (its GEMM from `gemm_rows`, without VNNI the AVX2 row kernels, each
row the GEMV's bits, which rows_linear runs in the twin too; else torch's kernel, an input rotation in float): the
twin's module call is within a rounding of it, and has its bits for unrotated linears on torch's kernel. A row the
GEMV declines (a NaN, an outlier it cannot split) goes to torch's kernel in both, here after the plan's float
rotation: within a rounding too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from superslm import cext
from superslm.kernels import cpu_decode
from superslm.kernels.dispatch import backend, gated_act

#: the activations the C++ step computes (ATen's kernels, as kernels/fused.py activation calls them)
_ACT = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


@dataclass(eq=False)
class MoEParts:
    """A mixture-of-experts block as `moe_decode` and its twin take it: the router [experts, dim], each expert's
    (gate_up [2 I, dim], down [dim, I]), the top k and whether it is renormalized, the activation, and an optional
    shared expert (gate_up, down) scaled by sigmoid(shared_gate(x)) ([1, dim]). `watch`: every module whose
    hooks a call must honour (a hook anywhere takes the twin). The C++ step built from these modules is kept
    here (one object per block, rebuilt by its owner when a module is swapped)."""

    router: nn.Module
    experts: Sequence[tuple[nn.Module, nn.Module]]
    top_k: int
    norm_top_k: bool
    act: str
    shared: tuple[nn.Module, nn.Module] | None = None
    shared_gate: nn.Module | None = None
    watch: tuple[nn.Module, ...] = ()
    #: the extension's MoEStep (None: not built yet; False: it cannot run these modules)
    step: Any = field(default=None, repr=False)


def route(logits: torch.Tensor, top_k: int, norm_top_k: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in `dtype`, chosen experts int64 [N, k]): the softmax in float32,
    the top k, renormalized to sum to 1 where `norm_top_k`."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_top_k:
        top = top / top.sum(-1, keepdim=True)
    return top.to(dtype), chosen


def _decode_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) as the default mode runs a linear of a decode step (models/layers.py `_linear`): its rows on the
    plan's kernels where they take the module (one row: the GEMVs; a few rows without VNNI: the AVX2 row
    kernels), else the module."""
    y = cpu_decode.rows_linear(module, x)
    return module(x) if y is None else y


def moe_reference(x: torch.Tensor, parts: MoEParts, counts: torch.Tensor,
                  linear: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The block in torch ops, each linear through `linear(module, rows)`: x [N, dim] -> [N, dim]; `counts`
    [experts] int64 gets the rows each expert took added."""
    weights, chosen = route(linear(parts.router, x), parts.top_k, parts.norm_top_k, x.dtype)
    out = torch.zeros_like(x)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (row, slot) pairs grouped by expert, rows in order
    per_expert = torch.bincount(flat, minlength=len(parts.experts))
    counts += per_expert.cpu()
    start = 0
    for expert, count in enumerate(per_expert.tolist()):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // parts.top_k
        gate_up, down = parts.experts[expert]
        y = linear(down, gated_act(linear(gate_up, x[rows]), parts.act))
        out.index_add_(0, rows, y * weights.reshape(-1)[pairs, None])
    if parts.shared is not None and parts.shared_gate is not None:
        scale = torch.sigmoid(linear(parts.shared_gate, x))
        gate_up, down = parts.shared
        out = out + scale * linear(down, gated_act(linear(gate_up, x), parts.act))
    return out


def moe_decode_reference(x: torch.Tensor, parts: MoEParts, counts: torch.Tensor) -> torch.Tensor:
    """`moe_decode` in torch ops: the block as the default mode computes decode rows (models/layers.py MoE.forward
    with its linears through `_linear`), x [N, dim] -> [N, dim]; `counts` [experts] gets each expert's rows added."""
    return moe_reference(x, parts, counts, _decode_linear)


def moe_decode(x: torch.Tensor, parts: MoEParts, counts: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts block on decode rows x [N, dim] -> [N, dim], `counts` [experts] int64 (CPU) getting
    each expert's rows added: one C++ call where it runs (`run`), else `moe_decode_reference`."""
    y = run(x, parts, counts)
    return moe_decode_reference(x, parts, counts) if y is None else y


def run(x: torch.Tensor, parts: MoEParts, counts: torch.Tensor) -> torch.Tensor | None:
    """The C++ step's output for x (and `counts` updated), or None with nothing done where it does not run: not on
    the CPU, not contiguous float32 / bf16 rows, the Triton kernels asked for, no extension or
    SUPERSLM_KERNELS=torch, a hook on a watched module, or a linear, activation or shape the step does not take
    (`build_step`)."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2
            or not x.is_contiguous() or counts.device.type != "cpu" or counts.dtype != torch.long):
        return None
    if backend(x.device) != "torch" or cext.torch_kernels_forced() or cpu_decode.any_hooked(parts.watch):
        return None
    if parts.step is None:
        parts.step = build_step(parts) or False
    return parts.step.run(x, counts) if parts.step else None


def plan_args_of(module: nn.Module) -> tuple[list[torch.Tensor | None], list[int]] | None:
    """module.plan_args() (kernels/cpu/plan_linear.h Lin::make's operands), or None where the module has none or
    the plan cannot run it."""
    plan_args = getattr(module, "plan_args", None)
    return None if plan_args is None else plan_args()


def _lin(module: nn.Module) -> tuple[list[torch.Tensor | None], list[int], list[tuple[list, list]]] | None:
    """A linear's operands and its CONCAT parts' (kernels.cpu_decode build_plan's rule), or None where the plan
    cannot run it or would round it otherwise than the twin (`_same_rotation`)."""
    got = plan_args_of(module)
    if got is None or not _same_rotation(*got):
        return None
    tensors, ints = got
    parts = []
    if ints[0] == 4:
        for part in getattr(module, "parts", ()):
            sub = plan_args_of(part)
            if sub is None or sub[1][0] == 4 or not _same_rotation(*sub):
                return None
            parts.append(sub)
        if not parts:
            return None
    return tensors, ints, parts


def _same_rotation(tensors: list[torch.Tensor | None], ints: list[int]) -> bool:
    """Whether the step rotates a decode row's input as the twin does: no rotation, or a rotated int4 / int8 linear
    that takes the one-row GEMV (both rotate in float, cpu_decode._vnni_input). Where no GEMV takes it the twin
    calls the module, whose rotation is a bf16 matmul, and the plan's float rotation would round otherwise."""
    if tensors[3] is None:
        return True
    ext = cext.extension()
    if ext is None or not (ext.vnni_available() or ext.avx2_available()):
        return False
    kind, group, _, _, k_pad = ints
    weight, scales = tensors[0], tensors[1]
    if kind == 2:
        return k_pad % 64 == 0
    return (kind == 1 and weight is not None and scales is not None and group % 4 == 0 and weight.shape[0] % 64 == 0
            and scales.is_contiguous())


def build_step(parts: MoEParts) -> Any:
    """The extension's MoEStep for `parts`, or None where it cannot run them (no extension, an activation it does
    not compute, a linear the plan does not run, a shared expert without its gate or the reverse)."""
    ext = cext.extension()
    act = _ACT.get(parts.act)
    if ext is None or not hasattr(ext, "MoEStep") or act is None:
        return None
    if (parts.shared is None) != (parts.shared_gate is None):
        return None
    step = ext.MoEStep(parts.top_k, parts.norm_top_k, act)
    router = _lin(parts.router)
    if router is None or router[2]:
        return None
    step.set_router(router[0], router[1])
    mlps: list[tuple[int, Sequence[nn.Module]]] = [(i, pair) for i, pair in enumerate(parts.experts)]
    if parts.shared is not None:
        mlps.append((-1, (*parts.shared, parts.shared_gate)))  # type: ignore[arg-type]
    concat: list[tuple[int, int, list, list]] = []
    for index, mods in mlps:
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        for which, m in enumerate(mods):
            got = _lin(m)
            if got is None or (which == 2 and got[2]):
                return None
            tensors += got[0]
            ints += got[1]
            concat += [(index, which, t, n) for t, n in got[2]]
        (step.add_expert if index >= 0 else step.set_shared)(tensors, ints)
    for index, which, t, n in concat:
        step.add_part(index, which, t, n)
    return step
