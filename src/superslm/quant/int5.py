"""GGUF Q5_0 weights run as they are: 5-bit codes, one f16 scale d per 32 values, value = d (code - 16).

Gemma-3-270M's Q4_K_M file keeps most of its body in Q5_0; as int8 those weights took 1 byte each
where the file has 0.69, and the re-quantization added 0.8% error. Here the codes are the file's:
the low nibbles in torch's packed int4 layout (`pack_int4`), the fifth bits as 64-bit masks in the
VNNI kernels' lane order (kernels/cpu/vnni.h `add_bits`), and torch's [groups, N, 2] bf16 scales with
(d, -8 d): (code - 8) d - 8 d = (code - 16) d. 0.75 bytes a weight; the only rounding is d to bf16, as
for the other GGUF-native blocks. torch has no 5-bit kernel: the C++ kernels run it (superslm/cext.py), with
AVX-512 VNNI (gemv.cpp, gemm.cpp) or with AVX2 and FMA (avx2.cpp, avx2_rows.cpp: the same bits), each row's
bits the same alone or in a batch; prompt chunks on AVX2 CPUs decode blocks of rows for a float32 GEMM
(kernels/cpu_prompt.py, `int5_dequant_rows`). Without the kernels, a dense copy (built at first use).
`int5_rows_reference` and `int5_dequant_rows_reference` are the kernels' torch twins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import Q5_0, BlockType, _f16, _q5_codes
from superslm.quant.base import LinearFormat, as_bias, register_format, row_order
from superslm.quant.int4 import _BLOCK_N, load_nibbles, pack_int4, round_up, store_nibbles, unpack_int4
from superslm.quant.split_rows import _fma, split_groups

#: the row (within a block of 64) of lane i of the kernels' accumulator a (kernels/cpu/vnni.h lane_row)
_BASE = np.array([0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23])
LANE_ROWS = np.stack([_BASE + (8 if a & 1 else 0) + (32 if a & 2 else 0) for a in range(4)])  # [4, 16]


def pack_bits(high: np.ndarray) -> np.ndarray:
    """Fifth bits uint8 [N, K] (0/1, N % 64 == 0, K % 4 == 0) -> int64 masks [N / 64, K / 4, 4]: bit
    4 * lane + kk of mask a is row LANE_ROWS[a, lane] of the block at k = 4 * quad + kk."""
    n, k = high.shape
    h = high.reshape(n // _BLOCK_N, _BLOCK_N, k // 4, 4)[:, LANE_ROWS]  # [blocks, 4 (a), 16 (lane), quads, 4 (kk)]
    h = np.ascontiguousarray(h.transpose(0, 3, 1, 2, 4)).reshape(n // _BLOCK_N, k // 4, 4, 64)
    return np.packbits(h, axis=-1, bitorder="little").view(np.int64)[..., 0]  # [blocks, quads, 4]


def unpack_bits(masks: np.ndarray, n: int, k: int) -> np.ndarray:
    """The inverse of `pack_bits`: int64 [N / 64, K / 4, 4] -> uint8 [N, K] of 0/1."""
    bits = np.unpackbits(masks.view(np.uint8).reshape(n // _BLOCK_N, k // 4, 4, 8), axis=-1, bitorder="little")
    h = bits.reshape(n // _BLOCK_N, k // 4, 4, 16, 4).transpose(0, 2, 3, 1, 4)  # [blocks, a, lane, quads, kk]
    out = np.empty((n // _BLOCK_N, _BLOCK_N, k // 4, 4), dtype=np.uint8)
    out[:, LANE_ROWS] = h
    return out.reshape(n, k)


def q5_0_params(raw: np.ndarray, shape: Sequence[int], row_perm: torch.Tensor | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 bytes of a weight [out, in] -> (codes uint8 [out, in] of 0..31, d float32 [out, in / 32])."""
    n, k = (int(d) for d in shape)
    if Q5_0.n_elements(raw) != n * k or k % 32:
        raise InvalidArgument(f"Q5_0: {raw.size} bytes do not hold a [{n}, {k}] weight")
    blocks = np.ascontiguousarray(raw).reshape(-1, Q5_0.type_size)
    codes = _q5_codes(blocks, 2).reshape(n, k)
    d = _f16(blocks, 0).reshape(n, k // 32)
    perm = row_order(row_perm, n)
    if perm is not None:
        codes, d = codes[perm], d[perm]
    return codes, d


def int5_kernels() -> Any:
    """The extension where its 5-bit kernels run: built with AVX-512 VNNI, or with AVX2 and FMA; else None."""
    ext = cext.extension()
    if ext is None or not (ext.vnni_available() or ext.avx2_available()):
        return None
    return ext


def _codes(qweight: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The kernels' operands (nibbles in blocks of 64 rows, fifth-bit masks) -> codes int64 [N, K] of 0..31."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    c = unpack_int4(qweight.cpu()).numpy() | (unpack_bits(bits.cpu().numpy(), n, k) << np.uint8(4))
    return torch.from_numpy(c.astype(np.int64))


def int5_rows_reference(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's 5-bit kernels (int5_gemv, int5_gemm and their AVX2 forms): x [M, K] ->
    [M, N] bf16. Each row rounded to bf16 and split per group of 32 into two int8 parts (kernels/cpu/vnni.h
    split_groups), the exact integer sums H and L of the codes times each part, then per group y += s (sl (254 H + L)
    - 8 sum x) + z sum x with the kernels' FMAs. A row that does not split (a NaN, an inf, an outlier) gets the
    float32 product of the decoded weights (the kernels' int5_reference sums those in another order)."""
    xf = x.to(torch.bfloat16).float().cpu()
    m, k = xf.shape
    n, g = qweight.shape[0], k // 32
    codes = _codes(qweight, bits).view(n, g, 32)
    hi, lo, gsum, gsl, ok = split_groups(xf)
    h = torch.einsum("mgk,ngk->mng", hi.view(m, g, 32), codes)  # [M, N, G], exact in int64
    low = torch.einsum("mgk,ngk->mng", lo.view(m, g, 32), codes)
    comb = (254 * h + low).float()  # one rounding to float32, as the kernels' conversion
    s, z = sz[..., 0].float().t(), sz[..., 1].float().t()  # [N, G]
    y = torch.zeros(m, n)
    for j in range(g):
        d = _fma(comb[..., j], gsl[:, j : j + 1].expand(m, n), -(8 * gsum[:, j : j + 1]).expand(m, n))
        y = _fma(s[:, j].expand(m, n), d, y)
        y = _fma(z[:, j].expand(m, n), gsum[:, j : j + 1].expand(m, n), y)
    if not ok.all():
        w = ((codes - 8).float() * s[..., None] + z[..., None]).view(n, k)  # exact: (c - 16) d
        y[~ok] = (xf[~ok].double() @ w.double().t()).float()
    return y.to(torch.bfloat16)


def int5_dequant_rows_reference(qweight: torch.Tensor, sz: torch.Tensor, bits: torch.Tensor, n0: int,
                                n1: int) -> torch.Tensor:
    """The torch twin of the extension's int5_dequant_rows: rows n0..n1 (multiples of 64) of the weight as float32
    [K, n1 - n0] (transposed), (c - 8) s + z = (c - 16) d exactly."""
    codes = _codes(qweight, bits)[n0:n1]  # [rows, K]
    s = sz[:, n0:n1, 0].float().t().repeat_interleave(32, dim=1)  # [rows, K]
    z = sz[:, n0:n1, 1].float().t().repeat_interleave(32, dim=1)
    return ((codes.float() - 8) * s + z).t().contiguous()


@register_format
class GGUFInt5Linear(LinearFormat):
    """GGUF Q5_0 blocks as they are (group 32, 5-bit codes), on the C++ VNNI or AVX2 kernels."""

    name: ClassVar[str] = "gguf5"

    def __init__(self, codes: np.ndarray, d: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, note: str = "") -> None:
        """codes uint8 [N, K] (0..31), d [N, K / 32] (rounded to bf16 here)."""
        n, k = codes.shape
        if k % 32 or d.shape != (n, k // 32) or n != out_features:
            raise InvalidArgument(f"gguf5: codes {codes.shape} and scales {tuple(d.shape)} do not match")
        super().__init__(in_features, out_features, k, bias, None, note)
        n_pad = round_up(n, _BLOCK_N)
        if n_pad != n:  # padded rows: code 16, d 0 -> weight 0; sliced off the output
            codes = np.concatenate([codes, np.full((n_pad - n, k), 16, dtype=np.uint8)])
            d = torch.cat([d, d.new_zeros(n_pad - n, d.shape[1])])
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        self.register_buffer("qweight", pack_int4(torch.from_numpy(codes & np.uint8(15))))
        self.register_buffer("bits", torch.from_numpy(np.ascontiguousarray(pack_bits(codes >> np.uint8(4)))))
        db = d.to(torch.bfloat16)
        sz = torch.stack([db, db * -8], dim=-1)  # [N_pad, groups, 2]; -8 d is exact in bf16
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous())  # [groups, N_pad, 2]

    def kernel_row_invariant(self) -> bool:
        # the VNNI and AVX2 kernels give a row its bits whatever the batch; the dense fallback matmul does not
        return int5_kernels() is not None and self.qweight.device.type == "cpu"

    @classmethod
    def from_gguf_parts(cls, parts: Sequence[tuple[np.ndarray, type[BlockType], Sequence[int], Any]],
                        bias: torch.Tensor | None = None) -> GGUFInt5Linear:
        """Q5_0 tensors (raw, block_type, shape, row_perm) fused along out (qkv, gate_up)."""
        got = []
        for raw, block_type, shape, perm in parts:
            if block_type is not Q5_0:
                raise InvalidArgument(f"gguf5 runs Q5_0 blocks, not {block_type.name}")
            got.append(q5_0_params(raw, shape, perm))
        codes = np.concatenate([g[0] for g in got])
        d = torch.from_numpy(np.concatenate([g[1] for g in got]))
        n, k = codes.shape
        return cls(codes, d, k, n, as_bias(bias, n), "from Q5_0, codes exact")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],  # type: ignore[override]
                  row_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> GGUFInt5Linear:
        return cls.from_gguf_parts([(raw, block_type, shape, row_perm)], bias)

    @classmethod
    def from_dense(cls, *args: Any, **kwargs: Any) -> LinearFormat:
        raise InvalidArgument("the gguf5 format is built from GGUF Q5_0 blocks (from_gguf)")

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        if int5_kernels() is None:
            return None  # the 5-bit codes run only on the C++ kernels; the module has its own fallback
        return [self.qweight, self.scales_zeros, self.bias, None, None, self.bits], [5, 32, *self._plan_ints()]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        ext = int5_kernels()  # VNNI, else AVX2 (int5_gemv and int5_gemm pick them: the same bits)
        if ext is None or x.device.type != "cpu":
            # no kernels here (a folder converted on another machine, another device)
            y = self._dense_matmul(x)
        elif x.shape[0] == 1:
            y = ext.int5_gemv(x, self.qweight, self.scales_zeros, self.bits)
        else:
            y = ext.int5_gemm(x, self.qweight, self.scales_zeros, self.bits)
        return y if y.shape[1] == self._out else y[:, : self._out]

    def _codes(self) -> np.ndarray:
        """codes uint8 [N_pad, K] of 0..31."""
        return _codes(self.qweight, self.bits).numpy().astype(np.uint8)

    def dequantize_stored(self) -> torch.Tensor:
        n = self._out
        c = torch.from_numpy(self._codes()[:n].astype(np.float32)).view(n, -1, 32)  # [N, groups, 32]
        d = self.scales_zeros[:, :n, 0].transpose(0, 1).float().cpu()  # [N, groups]
        return ((c - 16) * d[..., None]).view(n, self.k_pad)

    def _describe_format(self) -> str:
        return "gguf Q5_0 (5-bit g32)"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        n = self._out
        c = self._codes()[:n]
        # stored kernel-independent: the low nibbles as int4 stores them, fifth bits packed 8 a byte
        packed = torch.from_numpy(store_nibbles(c & np.uint8(15)))
        high = torch.from_numpy(np.packbits(c >> np.uint8(4), axis=-1, bitorder="little"))
        return {"qweight": packed, "high": high, "scales": self.scales_zeros[:, :n, 0].transpose(0, 1).contiguous()}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        low = load_nibbles(tensors["qweight"].contiguous().numpy())
        k = low.shape[1]
        high = np.unpackbits(tensors["high"].contiguous().numpy(), axis=-1, count=k, bitorder="little")
        if common.get("rotation") is not None:
            raise InvalidArgument("gguf5 weights are never rotated")
        return cls(low | (high << np.uint8(4)), tensors["scales"], common["in_features"], common["out_features"],
                   common.get("bias"), common.get("note", ""))
