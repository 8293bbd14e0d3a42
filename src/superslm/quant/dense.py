"""bf16 and int8 (per output channel) linears.

int8 runs `torch.ops.aten._weight_int8pack_mm(x, codes, scales)` = x (codes * scales[:, None])^T with
codes int8 [N, K] and scales [N] in x's dtype (bf16: its fp32 path is many times slower). The kernel
reads garbage or crashes unless K % 16 == 0, so K is zero-padded to a multiple of 32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from superslm.kernels import dispatch
from superslm.kernels.hadamard import pick_block, rotate_weight
from superslm.quant.base import LinearFormat, as_bias, as_parts, register_format
from superslm.quant.int4 import round_up

#: int8 kernel: K is padded to a multiple of this
_INT8_K = 32


def _prepare(
    weight: torch.Tensor | Sequence[torch.Tensor], k_multiple: int, rotate: int | None, block: int | None
) -> tuple[torch.Tensor, int, tuple[int, int] | None]:
    """(float32 weight [out, k_pad], in_features, rotation) with the input padded and rotated."""
    w = as_parts(weight)
    k = w.shape[1]
    k_pad = round_up(k, k_multiple)
    if k_pad != k:
        w = F.pad(w, (0, k_pad - k))
    rot = None
    if rotate is not None:
        rot = (int(rotate), pick_block(k_pad) if block is None else block)
        w = rotate_weight(w, *rot)
    return w, k, rot


@register_format
class Bf16Linear(LinearFormat):
    """The weight in bf16, F.linear on bf16 activations (what the int formats are measured against)."""

    name: ClassVar[str] = "bf16"

    def __init__(
        self,
        weight: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        rotation: tuple[int, int] | None = None,
        note: str = "",
        **_: Any,
    ) -> None:
        """weight [out, k_pad] (stored basis: rotated when `rotation` is given)."""
        super().__init__(in_features, weight.shape[0], weight.shape[1], bias, rotation, note)
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]]:
        return [self.weight, None, self.bias, *self._plan_rotation(), None], [3, 0, *self._plan_ints()]

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor | Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        rotate: int | None = None,
        block: int | None = None,
        note: str = "",
    ) -> Bf16Linear:
        """The weight [out, in] (or parts fused along out) rounded to bf16; `rotate`: a rotation seed."""
        w, k, rot = _prepare(weight, 1, rotate, block)
        return cls(w, k, as_bias(bias, w.shape[0]), rot, note)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dequantize_stored(self) -> torch.Tensor:
        return self.weight.float()

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"weight": self.weight}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        common.pop("out_features")
        common.pop("k_pad")
        return cls(tensors["weight"], **common)


#: rows quantized at a time
_ROWS = 4096


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row of w float32 [N, K] -> (codes int8 [N, K], scale bf16 [N]);
    codes are rounded against the bf16 scale the kernel will use."""
    tiny = torch.finfo(torch.bfloat16).tiny
    codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.bfloat16, device=w.device)
    # a block of rows at a time: a 49152-row head would otherwise need ~4 float32 copies at once
    for r in range(0, w.shape[0], _ROWS):
        part = w[r : r + _ROWS]
        s = (part.abs().amax(dim=1) / 127).clamp_min(tiny).to(torch.bfloat16)
        codes[r : r + _ROWS] = torch.round(part / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[r : r + _ROWS] = s
    return codes, scale


@register_format
class Int8Linear(LinearFormat):
    """Symmetric int8 with one scale per output channel, on `_weight_int8pack_mm` with bf16 activations."""

    name: ClassVar[str] = "int8"

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        in_features: int,
        out_features: int | None = None,
        bias: torch.Tensor | None = None,
        rotation: tuple[int, int] | None = None,
        note: str = "",
        **_: Any,
    ) -> None:
        """codes int8 [out, k_pad] (k_pad % 32 == 0), scale [out]."""
        n, k_pad = codes.shape
        super().__init__(in_features, n, k_pad, bias, rotation, note)
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16).contiguous())

    #: codes and a per-channel scale as the C++ int8 GEMVs read them (kernels.cpu_decode.vnni_linear)
    int8_codes: ClassVar[bool] = True

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]]:
        return [self.codes, self.scale, self.bias, *self._plan_rotation(), None], [2, 0, *self._plan_ints()]

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor | Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        rotate: int | None = None,
        block: int | None = None,
        note: str = "",
    ) -> Int8Linear:
        """Quantize a float weight [out, in] (or parts fused along out); `rotate`: a rotation seed."""
        w, k, rot = _prepare(weight, _INT8_K, rotate, block)
        codes, scale = quantize_int8(w)
        return cls(codes, scale, k, bias=as_bias(bias, w.shape[0]), rotation=rot, note=note)

    def kernel_row_invariant(self) -> bool:
        return self.codes.device.type == "cpu" and dispatch.backend(self.codes.device) == "torch"

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and dispatch.backend(x.device) == "torch":
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        return dispatch.int8_matmul(x, self.codes, self.scale)  # GPUs (and the kernel tests on the CPU)

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        return dispatch.backend(x.device) == "triton"

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        return dispatch.int8_matmul(h, self.codes, self.scale, tile_rows)

    def dequantize_stored(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"codes": self.codes, "scale": self.scale}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        common.pop("k_pad")
        return cls(tensors["codes"], tensors["scale"], **common)
