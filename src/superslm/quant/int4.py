"""int4 linears on torch's packed CPU kernel: groupwise asymmetric ("int4") and GGUF blocks as they are ("gguf").

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)` computes x W^T with

    W[n, k] = (code[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group,

codes 0..15 and `scales_and_zeros` [K / group, N, 2] in x's dtype (bf16 here; the fp32 path is many
times slower). So "zero" is the value of code 8, i.e. minimum + 8 * scale for a group stored as
scale * code + minimum (GGUF's Q4_0/Q4_1/Q4_K sub-blocks, our asymmetric min/max groups). The kernel
needs N % 16 == 0, K % group == 0 and group in {32, 64, 128, 256}; we pad N to a multiple of 64
(where its packed layout is the plain one `pack_int4` writes) and K to a multiple of the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from superslm import cext
from superslm.errors import InternalError, InvalidArgument, UnsupportedModel
from superslm.formats.blocks import BlockType, Int4BlockType
from superslm.kernels import dispatch
from superslm.kernels.fused import Int4Weight
from superslm.kernels.hadamard import pick_block, rotate_weight
from superslm.quant.base import LinearFormat, as_bias, as_parts, register_format, row_order

GROUPS = (32, 64, 128, 256)
#: rows per block of the stored packed layout (torch's kernel's on AVX-512; the C++ VNNI kernels read it)
_BLOCK_N = 64
#: rows per block of torch's packed layout on this CPU (`cpu_block`), once probed
_cpu_block: int | None = None


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pack_int4(codes: torch.Tensor, block: int = _BLOCK_N) -> torch.Tensor:
    """codes uint8 [N, K] (0..15, N % block == 0) -> the kernel's packed uint8 [N, K / 2].

    Per block of `block` rows and per k, byte j holds row j (low nibble) and row j + block / 2 (high nibble):
    what `_convert_weight_to_int4pack_for_cpu` writes (blocks of 64 rows with AVX-512, 32 with AVX2:
    `cpu_block`), without its int32 copy of the codes. In numpy: torch's uint8 elementwise ops measured ~50x
    slower here.
    """
    n, k = codes.shape
    v = codes.contiguous().numpy().reshape(n // block, 2, block // 2, k)  # [blocks, half, j, k]
    b = v[:, 0] | (v[:, 1] << np.uint8(4))  # [blocks, 32, k]
    return torch.from_numpy(np.ascontiguousarray(b.transpose(0, 2, 1)).reshape(n, k // 2))


def unpack_int4(packed: torch.Tensor, block: int = _BLOCK_N) -> torch.Tensor:
    """The inverse of `pack_int4`: packed uint8 [N, K / 2] -> codes uint8 [N, K]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    b = packed.contiguous().numpy().reshape(n // block, k, block // 2).transpose(0, 2, 1)  # [blocks, block/2, k]
    return torch.from_numpy(np.stack((b & np.uint8(15), b >> np.uint8(4)), axis=1).reshape(n, k))


def store_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [N, K] (0..15) -> the stored, kernel-independent order [N, K / 2]: byte j of a row
    holds codes 2j (low nibble) and 2j + 1 (high)."""
    return codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))


def load_nibbles(packed: np.ndarray) -> np.ndarray:
    """The inverse of `store_nibbles`: uint8 [N, K / 2] -> codes uint8 [N, K]."""
    return np.stack((packed & np.uint8(15), packed >> np.uint8(4)), axis=-1).reshape(packed.shape[0], -1)


def cpu_block() -> int:
    """Rows per block of torch's packed int4 layout on this CPU: its kernel's BLOCK_N follows the CPU capability
    it dispatches to (64 with AVX-512, 32 with AVX2). Probed once per process against `pack_int4`, so a torch
    release that changes the layout fails loudly (InternalError) instead of computing garbage."""
    global _cpu_block
    if _cpu_block is None:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (128, 64), generator=g, dtype=torch.int32)
        ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        for block in (64, 32, 16):
            if torch.equal(ref, pack_int4(codes.to(torch.uint8), block)):
                _cpu_block = block
                break
        else:
            raise InternalError("torch's packed int4 CPU layout differs from superslm.quant.int4.pack_int4")
    return _cpu_block


def to_cpu_layout(stored: torch.Tensor) -> torch.Tensor:
    """Packed codes in the stored layout (blocks of 64 rows) -> torch's layout on this CPU (the same tensor where
    they agree)."""
    block = cpu_block()
    return stored if block == _BLOCK_N else pack_int4(unpack_int4(stored), block)


def to_stored_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_cpu_layout`."""
    block = cpu_block()
    return packed if block == _BLOCK_N else pack_int4(unpack_int4(packed.cpu(), block))


#: range shrink factors tried per group by `fit_groups` (llama.cpp's make_qkx2_quants does the same)
_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
_REFITS = 2
#: rows quantized at a time, so the search's temporaries stay small for a 49152-row head
_ROWS = 4096


def fit_groups(g: torch.Tensor, search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) float32 [..., groups] for groups g [..., groups, size] quantized as
    scale * code + minimum, codes 0..15. Min/max, or with `search` the lowest squared error over
    shrunk ranges, each refined by least-squares refits of (scale, minimum) to its codes."""
    lo, hi = g.amin(-1), g.amax(-1)
    tiny = torch.finfo(torch.bfloat16).tiny
    if not search:
        return ((hi - lo) / 15).clamp_min(tiny), lo
    mid, half = (hi + lo) / 2, (hi - lo) / 2
    best_s, best_m, best_err = None, None, None
    for shrink in _SHRINK:
        s, m = (2 * half * shrink / 15).clamp_min(tiny), mid - half * shrink
        for it in range(_REFITS + 1):
            c = torch.round((g - m[..., None]) / s[..., None]).clamp_(0, 15)
            if it == _REFITS:
                break
            # least squares g ~ s * c + m per group; keep the old fit where it degenerates
            cm, gm = c.mean(-1), g.mean(-1)
            dc = c - cm[..., None]
            var, cov = (dc * dc).sum(-1), (dc * (g - gm[..., None])).sum(-1)
            s_new = cov / var.clamp_min(1e-12)
            ok = (var > 0) & (s_new > tiny)
            s = torch.where(ok, s_new, s)
            m = torch.where(ok, gm - s * cm, m)
        err = ((c * s[..., None] + m[..., None] - g) ** 2).sum(-1)
        if best_err is None:
            best_s, best_m, best_err = s, m, err
        else:
            better = err < best_err
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
            best_err = torch.minimum(err, best_err)
    assert best_s is not None and best_m is not None
    return best_s, best_m


def kernel_group_params(g: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) float32 [..., groups] of groups g [..., groups, size] in the kernel's terms (value =
    (code - 8) * scale + zero), each already rounded to the bf16 the kernel stores."""
    s, m = fit_groups(g, search)
    sb = s.to(torch.bfloat16).float()
    return sb, (m + 8 * sb).to(torch.bfloat16).float()


def quantize_groups(
    w: torch.Tensor, group: int, search: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of w float32 [N, K] per `group` inputs -> (codes uint8 [N, K], scale bf16
    [N, K / group], zero bf16 [N, K / group]) in the kernel's terms (value = (code - 8) * scale + zero).
    Codes are chosen against the bf16-rounded scale and zero: the values the kernel will use."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // group, dtype=torch.bfloat16)
    zero = torch.empty_like(scale)
    for r in range(0, n, _ROWS):
        g = w[r : r + _ROWS].reshape(-1, k // group, group)  # [rows, groups, group]
        sb, zb = kernel_group_params(g, search)
        c = torch.round((g - zb[..., None]) / sb[..., None] + 8).clamp_(0, 15)
        codes[r : r + _ROWS] = c.to(torch.uint8).view(-1, k)
        scale[r : r + _ROWS], zero[r : r + _ROWS] = sb, zb
    return codes, scale, zero


@register_format
class Int4Linear(LinearFormat):
    """Groupwise asymmetric int4 (group 32, 64, 128 or 256) on the packed CPU kernel, bf16 activations."""

    name: ClassVar[str] = "int4"
    #: "cpu": torch's packed CPU layout (qweight, scales_zeros); "nibbles": on other devices, the stored
    #: order (qweight [N, k_pad / 2], scale and zero [N, groups]) that the dispatcher's int4_matmul reads
    layout: str = "cpu"

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        rotation: tuple[int, int] | None = None,
        note: str = "",
    ) -> None:
        """codes uint8 [N, k_pad], scale and zero bf16 [N, k_pad / group] (any N: rows are padded here)."""
        if group not in GROUPS:
            raise InvalidArgument(f"int4 group must be one of {GROUPS}, not {group}")
        codes, scale, zero = codes.cpu(), scale.cpu(), zero.cpu()  # packed with numpy
        n, k_pad = codes.shape
        if k_pad % group or scale.shape != (n, k_pad // group) or zero.shape != scale.shape or n != out_features:
            raise InvalidArgument(f"int4: codes {tuple(codes.shape)} and scales {tuple(scale.shape)} do not match")
        super().__init__(in_features, out_features, k_pad, bias, rotation, note)
        block = cpu_block()
        self.group = group
        n_pad = round_up(n, _BLOCK_N)
        if n_pad != n:
            # padded rows: code 8, scale 0, zero 0 -> weight 0; sliced off the output
            pad = np.full((n_pad - n, k_pad), 8, dtype=np.uint8)
            codes = torch.from_numpy(np.concatenate([codes.to(torch.uint8).numpy(), pad]))
            scale = torch.cat([scale, scale.new_zeros(n_pad - n, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(n_pad - n, zero.shape[1])])
        self.register_buffer("qweight", pack_int4(codes.to(torch.uint8).contiguous(), block))
        sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)  # [N_pad, groups, 2]
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous())  # [groups, N_pad, 2]

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor | Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        group: int = 128,
        rotate: int | None = None,
        block: int | None = None,
        note: str = "",
        search: bool = False,
        hessian: torch.Tensor | None = None,
    ) -> Int4Linear:
        """Quantize a float weight [out, in] (or parts to fuse, stacked along out).

        `rotate`: a seed to rotate the input dimension first (block Hadamard over the padded input,
        `block` = the largest power of two <= 128 dividing it by default); `in` is zero-padded to a
        multiple of `group`. `search`: fit each group's range for the lowest squared error
        (`fit_groups`) instead of plain min/max; off by default: measured on SmolLM2 with real
        activations it clips the large weights that matter (docs/quantization.md). `hessian`: the
        inputs' mean x x^T [in, in] from calibration text: codes by GPTQ (`quant.gptq`), not rounding.
        """
        if group not in GROUPS:
            raise InvalidArgument(f"int4 group must be one of {GROUPS}, not {group}")
        w = as_parts(weight)
        n, k = w.shape
        k_pad = round_up(k, group)
        w = torch.nn.functional.pad(w, (0, k_pad - k))
        rot = None
        if rotate is not None:
            rot = (int(rotate), pick_block(k_pad) if block is None else block)
            w = rotate_weight(w, *rot)
        if hessian is None:
            codes, scale, zero = quantize_groups(w, group, search)
        else:
            from superslm.quant.gptq import gptq_int4, rotated_hessian

            h = torch.nn.functional.pad(hessian.float(), (0, k_pad - k, 0, k_pad - k))
            codes, scale, zero = gptq_int4(w, rotated_hessian(h, *rot) if rot else h, group)
        return cls(codes, scale, zero, group, k, n, as_bias(bias, n), rot, note)

    def kernel_row_invariant(self) -> bool:
        return self.layout == "cpu" and dispatch.backend(self.qweight.device) == "torch"

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        if cpu_block() != 64 and cext.vnni() is not None:
            return None  # the VNNI kernels read blocks of 64 rows, torch's layout here has others: no plan
        return [self.qweight, self.scales_zeros, self.bias, *self._plan_rotation(), None], [1, self.group,
                                                                                           *self._plan_ints()]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "cpu" and dispatch.backend(x.device) == "torch":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, self.scales_zeros)
            return y if y.shape[1] == self._out else y[:, : self._out]
        if self.layout == "nibbles":
            return dispatch.int4_matmul(x, self.qweight, self.scale, self.zero, self.group)
        # the kernels on a CPU tensor (TRITON_INTERPRET=1 tests): the stored order, rebuilt per call
        state, _ = self._state()
        return dispatch.int4_matmul(x, state["qweight"], state["scales"], state["zeros"], self.group)

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        return dispatch.backend(x.device) == "triton"

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        w = self.int4_weight()
        assert w is not None  # the Triton path: nibbles, or the stored order rebuilt (interpreter)
        return dispatch.int4_matmul(h, w.qweight, w.scale, w.zero, w.group, tile_rows)

    def int4_weight(self) -> Int4Weight | None:
        if self.layout == "nibbles":
            return Int4Weight(self.qweight, self.scale, self.zero, self.group)
        if dispatch.backend(self.qweight.device) == "torch":
            return None  # torch's packed CPU kernel: no fused GEMV
        state, _ = self._state()  # the kernels on a CPU tensor (TRITON_INTERPRET=1 tests), rebuilt per call
        return Int4Weight(state["qweight"], state["scales"], state["zeros"], self.group)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to(device): the packed CPU layout runs only on the CPU; elsewhere the kernels read nibbles. The
        # probe lives where qweight does, so a dtype-only change (.float(), .to(dtype)) keeps the layout.
        want = "cpu" if fn(self.qweight.new_empty(0)).device.type == "cpu" else "nibbles"
        if want != self.layout:
            self._relayout(want)
        return super()._apply(fn, recurse)

    def _relayout(self, want: str) -> None:
        """Rebuild the buffers in layout `want` ("cpu" or "nibbles") from this module's codes and scales
        (on the meta device, which holds no values: empty buffers of the new layout's shapes)."""
        if self.qweight.device.type == "meta":
            n, groups, n_pad = self._out, self.k_pad // self.group, round_up(self._out, _BLOCK_N)
            shapes = {"qweight": ((n, self.k_pad // 2), torch.uint8), "scale": ((n, groups), torch.bfloat16),
                      "zero": ((n, groups), torch.bfloat16)} if want == "nibbles" else \
                     {"qweight": ((n_pad, self.k_pad // 2), torch.uint8),
                      "scales_zeros": ((groups, n_pad, 2), torch.bfloat16)}  # fmt: skip
            bufs = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
        elif want == "nibbles":
            state, _ = self._state()  # the stored order is the nibble layout
            bufs = {"qweight": state["qweight"], "scale": state["scales"].cpu(), "zero": state["zeros"].cpu()}
        else:
            codes, scale, zero = (t.cpu() for t in self._params())
            fresh = Int4Linear(codes, scale, zero, self.group, self.in_features, self._out)
            bufs = {"qweight": fresh.qweight, "scales_zeros": fresh.scales_zeros}
        for name in ("qweight", "scales_zeros", "scale", "zero"):
            self._buffers.pop(name, None)
        for name, t in bufs.items():
            self.register_buffer(name, t)
        self.layout = want

    def _params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [N, k_pad], scale bf16 [N, groups], zero bf16 [N, groups]), padding rows dropped."""
        n = self._out
        if self.layout == "nibbles":
            codes = torch.from_numpy(load_nibbles(self.qweight.cpu().numpy()))
            return codes, self.scale, self.zero
        sz = self.scales_zeros[:, :n].transpose(0, 1)  # [N, groups, 2]
        return unpack_int4(self.qweight.cpu(), cpu_block())[:n], sz[..., 0].contiguous(), sz[..., 1].contiguous()

    def dequantize_stored(self) -> torch.Tensor:
        codes, scale, zero = self._params()
        n = self._out
        c = codes.to(scale.device).float().view(n, -1, self.group)  # [N, groups, group]
        w = (c - 8) * scale.float()[..., None] + zero.float()[..., None]
        return w.view(n, self.k_pad)

    def _describe_format(self) -> str:
        return f"int4 g{self.group}"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        codes, scale, zero = self._params()
        packed = torch.from_numpy(store_nibbles(codes.cpu().numpy()))
        return {"qweight": packed, "scales": scale, "zeros": zero}, {"group": self.group}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        common.pop("k_pad")
        codes = torch.from_numpy(load_nibbles(tensors["qweight"].contiguous().numpy()))  # [N, k_pad]
        return cls(codes, tensors["scales"], tensors["zeros"], int(meta["group"]), **common)


def gguf_int4_params(
    raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int], row_perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0/Q4_1/Q4_K bytes of a weight [out, in] -> (codes uint8 [out, in], scale, zero bf16
    [out, in / 32]) for the kernel: each 32-value sub-block is one group, codes untouched.

    `row_perm` (int [out]): stored row i is the file's row row_perm[i] (llama's q/k unpermute).
    """
    if not (isinstance(block_type, type) and issubclass(block_type, Int4BlockType)):
        name = getattr(block_type, "name", block_type)
        raise UnsupportedModel(f"GGUF {name} blocks are not scale/min int4 groups; use linear_from_gguf")
    n, k = (int(d) for d in shape)
    if block_type.n_elements(raw) != n * k or k % 32:
        raise InvalidArgument(f"{block_type.name}: {raw.size} bytes do not hold a [{n}, {k}] weight")
    codes_np, scale_np, min_np = block_type.unpack_int4(raw)
    codes_np, scale_np, min_np = codes_np.reshape(n, k), scale_np.reshape(n, k // 32), min_np.reshape(n, k // 32)
    perm = row_order(row_perm, n)
    if perm is not None:
        codes_np, scale_np, min_np = codes_np[perm], scale_np[perm], min_np[perm]
    codes, scale, minimum = torch.from_numpy(codes_np), torch.from_numpy(scale_np), torch.from_numpy(min_np)
    # the kernel's zero is the value of code 8; one float32 rounding, then one bf16 rounding
    zero = (minimum + 8 * scale).to(torch.bfloat16)
    return codes.contiguous(), scale.to(torch.bfloat16), zero


@register_format
class GGUFInt4Linear(Int4Linear):
    """GGUF Q4_0 / Q4_1 / Q4_K weights run as they are: int4 g32 with the blocks' own codes.

    No re-quantization: codes are the file's; each group's scale and min become the kernel's bf16
    scale and zero (the only rounding, at bf16's 2^-8 like any bf16 weight).
    """

    name: ClassVar[str] = "gguf"

    @classmethod
    def from_gguf(  # type: ignore[override]
        cls,
        raw: np.ndarray,
        block_type: type[BlockType],
        shape: Sequence[int],
        row_perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> GGUFInt4Linear:
        """One GGUF int4 tensor [out, in] as a module (see `gguf_int4_params`)."""
        return cls.from_gguf_parts([(raw, block_type, shape, row_perm)], bias)

    @classmethod
    def from_gguf_parts(
        cls,
        parts: Sequence[tuple[np.ndarray, type[BlockType], Sequence[int], torch.Tensor | None]],
        bias: torch.Tensor | None = None,
    ) -> GGUFInt4Linear:
        """Several GGUF int4 tensors (raw, block_type, shape, row_perm) fused along out (qkv, gate_up)."""
        got = [gguf_int4_params(*p) for p in parts]
        codes = torch.from_numpy(np.concatenate([g[0].numpy() for g in got]))
        scale = torch.cat([g[1] for g in got])
        zero = torch.cat([g[2] for g in got])
        n, k = codes.shape
        names = "+".join(dict.fromkeys(p[1].name for p in parts))
        return cls(codes, scale, zero, 32, k, n, as_bias(bias, n), None, f"from {names}, codes exact")

    @classmethod
    def from_dense(cls, *args: Any, **kwargs: Any) -> Int4Linear:
        raise InvalidArgument("the gguf format is built from GGUF blocks (from_gguf); use int4 for dense weights")

    def _describe_format(self) -> str:
        return "gguf int4 g32"
