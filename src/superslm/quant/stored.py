"""Linear modules as a converted folder stores them, and back (used by convert.py and its loader).

`to_tensors()` of each format, except that int4 kinds keep the packed layout torch's CPU kernel reads,
so loading one is a memory map and not a repack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.errors import FormatError, InvalidArgument
from superslm.quant.base import LinearFormat, format_class, load_linear
from superslm.quant.gguf_map import ConcatLinear
from superslm.quant.int4 import Int4Linear, round_up, to_cpu_layout, to_stored_layout

#: int4 weights are stored in torch's packed CPU layout on AVX-512 (quant.int4.pack_int4, blocks of 64 rows), read
#: without a repack there (other CPUs repack to their own blocks: quant.int4.to_cpu_layout)
INT4_PACKED = "cpu-int4pack-n64"


def linear_state(module: LinearFormat) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a format module as stored: `to_tensors()`, except int4 kinds keep their
    packed kernel layout (metadata "packed") so loading them is a memory map."""
    _, meta = module.to_tensors()
    if isinstance(module, ConcatLinear):
        tensors: dict[str, torch.Tensor] = {}
        metas = []
        for i, part in enumerate(module.parts):
            t, m = linear_state(part)  # type: ignore[arg-type]
            tensors.update({f"part{i}.{k}": v for k, v in t.items()})
            metas.append(m)
        return tensors, dict(meta, parts=metas)
    if isinstance(module, Int4Linear) and module.layout == "cpu":
        tensors = {"qweight": to_stored_layout(module.qweight), "scales_zeros": module.scales_zeros}
        if module.bias is not None:
            tensors["bias"] = module.bias
        return tensors, dict(meta, packed=INT4_PACKED)
    return module.to_tensors()


def _int4_packed(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> LinearFormat:
    # The module's own buffers, as stored: no unpack/repack. Relies on Int4Linear's buffer names
    # (qweight [N_pad, k_pad / 2] uint8, scales_zeros [groups, N_pad, 2] bf16) and its group attribute.
    cls = format_class(str(meta["format"]))
    if not issubclass(cls, Int4Linear):
        raise FormatError(f"packed int4 tensors for a {cls.name} linear")
    n, k, k_pad, group = int(meta["out_features"]), int(meta["in_features"]), int(meta["k_pad"]), int(meta["group"])
    n_pad = round_up(n, 64)
    qw, sz = tensors["qweight"], tensors["scales_zeros"]
    if qw.dtype != torch.uint8 or tuple(qw.shape) != (n_pad, k_pad // 2) or sz.dtype != torch.bfloat16 \
            or tuple(sz.shape) != (k_pad // group, n_pad, 2):
        raise FormatError(f"packed int4 linear: tensors {tuple(qw.shape)}, {tuple(sz.shape)} do not fit {n}x{k_pad}")
    rot = meta.get("rotation")
    module = cls.__new__(cls)
    LinearFormat.__init__(module, k, n, k_pad, tensors.get("bias"),
                          None if rot is None else (int(rot["seed"]), int(rot["block"])), str(meta.get("note", "")))
    module.group = group
    module.register_buffer("qweight", to_cpu_layout(qw))  # fails loudly if a torch release changed the layout
    module.register_buffer("scales_zeros", sz)
    return module


def linear_from_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> LinearFormat:
    """The inverse of `linear_state` (FormatError when the tensors and metadata disagree)."""
    try:
        if meta.get("format") == "concat":
            parts = []
            for i, m in enumerate(meta["parts"]):
                pre = f"part{i}."
                parts.append(linear_from_state({k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}, m))
            return ConcatLinear(parts, str(meta.get("note", "")))
        if meta.get("packed") == INT4_PACKED:
            return _int4_packed(tensors, meta)
    except (KeyError, TypeError, ValueError, InvalidArgument) as e:
        raise FormatError(f"{meta.get('format')} linear: inconsistent tensors or metadata ({e!r})") from e
    return load_linear(tensors, meta)
