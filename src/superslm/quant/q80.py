"""GGUF Q8_0 weights run as they are: per 32 values an f16 d and 32 int8 codes, weight = d * code.

Exact in float32 (11 + 8 significant bits). As int8 per output channel (quant/gguf_map.py before this format) they
were rounded a second time, and the int8 AVX2 GEMV split x in two int8 parts: two multiplies per weight on a GEMV
that is compute-bound on AVX2; Gemma-3-270M's tied Q8_0 head [262144, 640] was over half of each decode step.
Here: the file's codes (int8 [N, K]) and its d (float16 [N, K / 32]): the file's 34 bytes a block, 8.5 bits a
weight, split in two arrays so a group's 32 codes are one 32-byte load. d stays float16, not float32 as giq4's
scales: it is the file's f16 value (exact in float32 after the kernel's conversion, 8 at a time), and float32 would
add 1/16 to the bytes a decode step reads (the head is read at memory speed at one row).

The C++ kernels (kernels/cpu/q80.cpp) run decode rows (1 to `GEMV_ROWS`) through an AVX2 integer GEMV with
llama.cpp's arithmetic (ggml_vec_dot_q8_0_q8_0: x as int8 per 32 with a float32 step, `quantize_groups` as giq4,
one multiply per code; `q80_gemv` is its twin, bit for bit) and prompts through a float32 GEMM over blocks of
decoded rows (`q80_matmul` its twin). Without the extension the module multiplies with a dense float copy of the
weight, built at first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import Q8_0, BlockType
from superslm.quant.base import LinearFormat, as_bias, register_format, row_order
from superslm.quant.iq4 import quantize_groups
from superslm.quant.split_rows import fma32 as _fma32

#: bytes of a Q8_0 block (an f16 d, 32 int8 codes)
BLOCK_BYTES = 34
#: rows of a weight copied from the file between two `release` calls (q80_params)
ROWS = 8192
#: the most rows of x the integer GEMV takes (decode steps of many sequences); more rows (prompts) take the float32
#: GEMM (measured: docs/quantization.md)
GEMV_ROWS = 64


def q80_params(raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],
               row_perm: torch.Tensor | None = None, release: Callable[[], None] | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes of a weight [out, in] -> (codes int8 [out, in], d float16 [out, in / 32]), rows in `row_perm`
    order if given. Written `ROWS` rows at a time into `out` (or new tensors), `release` called after each block of
    rows (the loader drops the file's pages read so far): a 262k-row head is never held twice beside the file."""
    n, k = (int(d) for d in shape)
    if block_type is not Q8_0:
        raise InvalidArgument(f"the q80 format runs Q8_0 blocks, not {block_type.name}")
    if block_type.n_elements(raw) != n * k or k % 32:
        raise InvalidArgument(f"Q8_0: {raw.size} bytes do not hold a [{n}, {k}] weight")
    perm = row_order(row_perm, n)
    codes, d = out if out is not None else (torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 32,
                                                                                                dtype=torch.float16))
    rows = raw.reshape(n, k // 32, BLOCK_BYTES)  # [out, groups, 34]
    for r in range(0, n, ROWS):
        blocks = rows[r : r + ROWS] if perm is None else rows[perm[r : r + ROWS]]
        m = blocks.shape[0]
        codes[r : r + m] = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(m, k))
        d[r : r + m] = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(m, k // 32))
        if release is not None:
            release()
    return codes, d


def q80_dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q80_dequantize: the weight float32 [N, K] (d * code, exact)."""
    n, k = codes.shape
    return (codes.float().view(n, k // 32, 32) * d.float()[..., None]).view(n, k)


def q80_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q80_gemm: x [M, K] rounded to bf16 times the exact weight in float32
    -> [M, N] bf16."""
    return (x.to(torch.bfloat16).float() @ q80_dequantize(codes, d).t()).to(torch.bfloat16)


def q80_gemv(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q80_gemv, bit for bit: rows x [M, K] each as int8 per group of 32
    (`quantize_groups`); per weight row and group the exact integer products summed in 8 lanes (lane l: values
    4l..4l+3), acc = fma(lane, d * dx, acc) over the groups in order, the 8 lanes added pairwise as the kernel does,
    rounded to bf16 -> [M, N]. A row with a NaN or an inf takes `q80_matmul`, as the kernel does."""
    if x.dim() != 2 or x.shape[1] % 32 or tuple(codes.shape) != (codes.shape[0], x.shape[1]):
        raise InvalidArgument(f"q80_gemv: rows of K (a multiple of 32) against [N, K], got {tuple(x.shape)} and "
                              f"{tuple(codes.shape)}")
    xb = x.to(torch.bfloat16)
    n, g = codes.shape[0], x.shape[1] // 32
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    w = codes.int().view(n, g, 32)  # [N, groups, 32]
    df = d.float()  # [N, groups]: exact
    for r in range(x.shape[0]):
        if not torch.isfinite(xb[r]).all():
            out[r] = q80_matmul(xb[r : r + 1], codes, d)[0]
            continue
        q, dx = quantize_groups(xb[r : r + 1])  # [groups, 32], [groups]
        lanes = (w * q).view(n, g, 8, 4).sum(-1).float()  # [N, groups, 8]: exact (|sum| <= 4 * 128 * 127)
        sd = df * dx  # [N, groups]: rounded once, as the kernel rounds it
        acc = torch.zeros(n, 8)
        for i in range(g):
            acc = _fma32(lanes[:, i], sd[:, i : i + 1].expand(n, 8), acc)
        half = acc[:, :4] + acc[:, 4:]  # [N, 4]
        pair = half[:, :2] + half[:, 2:]  # [N, 2]
        out[r] = (pair[:, 0] + pair[:, 1]).to(torch.bfloat16)
    return out


def q80_kernels() -> Any:
    """The extension where its Q8_0 GEMV runs (AVX2 built here, not SUPERSLM_KERNELS=torch), else None."""
    ext = cext.extension()
    if ext is None or cext.torch_kernels_forced() or not ext.q80_available():
        return None
    return ext


@register_format
class GGUFQ80Linear(LinearFormat):
    """GGUF Q8_0 blocks as they are (32 values: int8 codes and an f16 d)."""

    name: ClassVar[str] = "gq80"

    def __init__(self, codes: np.ndarray | torch.Tensor, d: np.ndarray | torch.Tensor, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None, note: str = "") -> None:
        """codes int8 [N, K], d float16 [N, K / 32] (the file's d of each block)."""
        c = torch.as_tensor(codes).contiguous()
        s = torch.as_tensor(d).contiguous()
        if c.dim() != 2 or c.dtype != torch.int8 or s.dtype != torch.float16:
            raise InvalidArgument(f"gq80: codes int8 [N, K] and d float16 [N, K / 32], got {c.dtype} and {s.dtype}")
        n, k = c.shape
        if k % 32 or k == 0 or tuple(s.shape) != (n, k // 32) or n != out_features or in_features > k:
            raise InvalidArgument(f"gq80: codes {tuple(c.shape)} and d {tuple(s.shape)} do not match "
                                  f"[{out_features}, {in_features}]")
        super().__init__(in_features, out_features, k, bias, None, note)
        self.register_buffer("codes", c)
        self.register_buffer("d", s)

    @classmethod
    def from_gguf_parts(cls, parts: Sequence[tuple[np.ndarray, type[BlockType], Sequence[int], Any]],
                        bias: torch.Tensor | None = None, release: Callable[[], None] | None = None) -> GGUFQ80Linear:
        """Q8_0 tensors (raw, block_type, shape, row_perm) fused along out (qkv, gate_up), each part's rows written
        in place (`q80_params`; `release` as there)."""
        if not parts or len({int(p[2][1]) for p in parts}) != 1:
            raise InvalidArgument("gq80: fused parts must share their input dimension")
        k, n = int(parts[0][2][1]), sum(int(p[2][0]) for p in parts)
        codes, d = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 32, dtype=torch.float16)
        r = 0
        for raw, block_type, shape, perm in parts:
            m = int(shape[0])
            q80_params(raw, block_type, shape, perm, release, (codes[r : r + m], d[r : r + m]))
            r += m
        return cls(codes, d, k, n, as_bias(bias, n), "from Q8_0, codes exact")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],  # type: ignore[override]
                  row_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> GGUFQ80Linear:
        return cls.from_gguf_parts([(raw, block_type, shape, row_perm)], bias)

    @classmethod
    def from_dense(cls, *args: Any, **kwargs: Any) -> LinearFormat:
        raise InvalidArgument("the gq80 format is built from GGUF Q8_0 blocks (from_gguf)")

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to(bf16) on a model must not round d: the kernels read the file's f16 values
        kept = self.d
        out = super()._apply(fn, recurse)
        if self.d.dtype != torch.float16:
            self._buffers["d"] = kept.to(self.d.device)
        return out

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        if q80_kernels() is None:
            return None
        return [self.codes, self.d, self.bias, None, None, None], [8, 32, *self._plan_ints()]

    def _on_cpu(self, x: torch.Tensor) -> Any:
        ext = q80_kernels()
        return ext if ext is not None and x.device.type == "cpu" and self.codes.device.type == "cpu" else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        ext = self._on_cpu(x)
        if ext is None:
            # no kernels here (a folder converted on another machine, another device)
            return self._dense_matmul(x)
        if x.shape[0] <= GEMV_ROWS:
            return ext.q80_gemv(x, self.codes, self.d)
        return ext.q80_gemm(x, self.codes, self.d, False)

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        # deterministic mode: 16-row float32 products at every row count, as the C++ plan runs it (the GEMV's rows
        # do not depend on their batch either, but prompts could not take it at speed)
        return self._on_cpu(x) is not None

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        if tile_rows != 16:
            raise InvalidArgument(f"gq80: deterministic tiles are 16 rows, not {tile_rows}")
        return q80_kernels().q80_gemm(h, self.codes, self.d, True)

    def dequantize_stored(self) -> torch.Tensor:
        return q80_dequantize(self.codes.cpu(), self.d.cpu())

    def _describe_format(self) -> str:
        return "gguf Q8_0 (int8 g32)"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"codes": self.codes, "d": self.d}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        if common.get("rotation") is not None:
            raise InvalidArgument("gq80 weights are never rotated")
        return cls(tensors["codes"].contiguous(), tensors["d"].contiguous(), common["in_features"],
                   common["out_features"], common.get("bias"), common.get("note", ""))
