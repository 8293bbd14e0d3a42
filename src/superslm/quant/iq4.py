"""GGUF IQ4_NL and IQ4_XS weights run as they are: 4-bit codes into a 16-value table, a float32 scale per 32.

Both are groups of 32 values: weight = scale * table[code], table = ggml's kvalues_iq4nl (-127 .. 113). IQ4_NL's
scale is the block's f16 d; IQ4_XS's is d * (ls - 32) with the 6-bit sub-scale ls, exact in float32 (not in
bf16: 11 + 6 significant bits), and so is every weight (+ 7 bits for the table value). As int8 per output channel
(quant/gguf_map.py before this format) they took 8 bits a weight where the file has 4.5 (IQ4_NL) or 4.25
(IQ4_XS), and decode, which reads every weight once a step, ran at half llama.cpp's speed on Qwen2.5-0.5B IQ4_XS.
Here: the file's code bytes (qweight uint8 [N, K / 2], per group 16 bytes, byte j = codes j and j + 16) and the
scales: IQ4_NL's float32 [N, K / 32] (5 bits a weight), IQ4_XS's packed as the file has them, each block's d as
float32 and each group's 6-bit ls - 32 as int8 (4.375 bits a weight against the file's 4.25).

The C++ kernels (kernels/cpu/iq4.cpp) run one row through an AVX2 GEMV with llama.cpp's arithmetic (x as int8 per
32 values, the table lookup a byte shuffle, integer products), 2 to 128 rows (and every row count in deterministic
mode) through an integer rows kernel that gives each row the GEMV's bits (`iq4_gemv` is the torch twin of both, bit
for bit), and longer prompt chunks, on CPUs without VNNI, through an AVX2 integer kernel on x split into two int8 parts
(`iq4_split_reference` its twin, bit for bit), elsewhere through a float32 GEMM over blocks of decoded rows
(`iq4_matmul` its twin); kernels/cpu/iq4.cpp iq4_linear makes that choice for the module and the C++ plan.
Without the extension the module multiplies with a dense float copy of the weight, built at first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import _IQ4_VALUES, IQ4_NL, IQ4_XS, BlockType, _f16
from superslm.quant.base import LinearFormat, as_bias, register_format, row_order
from superslm.quant.split_rows import fma32 as _fma32
from superslm.quant.split_rows import pair_rows_reference

#: the 16 table values as the kernels take them
TABLE = torch.from_numpy(_IQ4_VALUES.astype(np.int8))


def iq4_params(raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],
               row_perm: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL / IQ4_XS bytes of a weight [out, in] -> (codes uint8 [out, in / 2] in the file's byte order per
    group of 32, scales: IQ4_NL's float32 [out, in / 32], IQ4_XS's packed uint8 [out, in / 64 + in / 32]
    (`group_scales` reads either)), rows taken in `row_perm` order if given."""
    n, k = (int(d) for d in shape)
    if block_type not in (IQ4_NL, IQ4_XS):
        raise InvalidArgument(f"the iq4 format runs IQ4_NL and IQ4_XS blocks, not {block_type.name}")
    if block_type.n_elements(raw) != n * k or k % block_type.block_size:
        raise InvalidArgument(f"{block_type.name}: {raw.size} bytes do not hold a [{n}, {k}] weight")
    blocks = np.ascontiguousarray(raw).reshape(-1, block_type.type_size)
    if block_type is IQ4_NL:
        codes = blocks[:, 2:]  # [n * k / 32, 16]
        scales = _f16(blocks, 0)  # [n * k / 32, 1]
    else:
        m = blocks.shape[0]
        low = (blocks[:, 4:8].reshape(m, 4, 1) >> np.array([0, 4], dtype=np.uint8)).reshape(m, 8) & np.uint8(0x0F)
        high = (blocks[:, 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)  # [m, 8]
        ls = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        # packed (kernels/cpu/iq4_scales.h): per row the float32 d of its k / 256 blocks, then the int8 ls - 32 of its
        # groups; the kernels form each group's scale d * (ls - 32), exact in float32 (11 + 6 bits)
        d = _f16(blocks, 0).astype("<f4").reshape(n, k // 256)
        scales = np.concatenate([d.view(np.uint8), ls.astype(np.int8).reshape(n, k // 32).view(np.uint8)], axis=1)
        codes = blocks[:, 8:]  # [m, 128]: 8 groups of 16 bytes, each laid out as IQ4_NL's
    codes = np.ascontiguousarray(codes).reshape(n, k // 2)
    if block_type is IQ4_NL:
        scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(n, k // 32)
    perm = row_order(row_perm, n)
    if perm is not None:
        codes, scales = codes[perm], scales[perm]
    return codes, scales


def group_scales(scales: torch.Tensor, k: int) -> torch.Tensor:
    """Each group's scale float32 [N, K / 32] from either layout the format stores (kernels/cpu/iq4_scales.h): the
    floats themselves, or IQ4_XS's packed bytes uint8 [N, K / 64 + K / 32] (per row the K / 256 float32 d, then the
    int8 ls - 32 of each group: scale = d * (ls - 32), exact in float32)."""
    if scales.dtype != torch.uint8:
        return scales.float()
    g = k // 32
    d = scales[:, : g // 2].contiguous().view(torch.float32)  # [N, G / 8]
    ls = scales[:, g // 2 :].contiguous().view(torch.int8).float()  # [N, G]
    return d.repeat_interleave(8, dim=1) * ls


def table_values(qweight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The weight's table values int64 [N, K / 32, 32] in k order (per group codes j, then j + 16 of its bytes)."""
    q = qweight.view(qweight.shape[0], -1, 16)  # [N, groups, 16]
    return table.long()[torch.cat([q & 15, q >> 4], dim=-1).long()]


def iq4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's iq4_dequantize: the weight float32 [N, K] (scale * table[code])."""
    values = table_values(qweight, table).float()  # exact: |value| <= 127
    return (values * group_scales(scales, 2 * qweight.shape[1])[..., None]).view(qweight.shape[0], -1)


def iq4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's iq4_gemm: x [M, K] rounded to bf16 times the exact weight in float32
    -> [M, N] bf16."""
    return (x.to(torch.bfloat16).float() @ iq4_dequantize(qweight, scales, table).t()).to(torch.bfloat16)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row x [1, K] rounded to bf16, then as the GEMV's int8 per group of 32 (llama.cpp's Q8_0 with a float32
    scale): (q int32 [K / 32, 32], |q| <= 127; dx float32 [K / 32]), x ~ q * dx, within dx / 2 an element."""
    xg = x.to(torch.bfloat16).float().view(-1, 32)  # [groups, 32]
    dx = xg.abs().amax(-1) / 127  # [groups]
    live = dx > 0  # an all-zero group (or one whose dx underflows) gets q = 0
    q = torch.round(xg / torch.where(live, dx, 1.0)[:, None]).clamp(-127, 127)  # x / dx, ties to even
    return torch.where(live[:, None], q, 0.0).int(), dx


def iq4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's iq4_gemv, bit for bit: x [M, K] -> [M, N], each row alone (the kernel's rows
    never depend on the others: one row through its GEMV, several through its rows kernel, the same bits) as
    int8 per group of 32 (`quantize_groups`), per output row and group the exact integer products summed in 4
    lanes, two groups a step side by side in 8 lanes, each lane acc = fma(lane sum, scale * dx, acc) over the steps
    in order, the 8 lanes added pairwise as the kernel does, rounded to bf16. A row with a NaN or an inf (or a table
    with -128, which the kernel's sign trick cannot negate) takes `iq4_matmul` alone, as the kernel does."""
    if x.dim() != 2:
        raise InvalidArgument(f"iq4_gemv: rows [M, K], got {tuple(x.shape)}")
    if x.shape[0] != 1:
        rows = [iq4_gemv(x[r : r + 1], qweight, scales, table) for r in range(x.shape[0])]
        return torch.cat(rows) if rows else torch.empty(0, qweight.shape[0], dtype=torch.bfloat16)
    if not torch.isfinite(x.to(torch.bfloat16)).all() or (table == -128).any():
        return iq4_matmul(x, qweight, scales, table)
    q, dx = quantize_groups(x)
    n, g = qweight.shape[0], dx.numel()
    w = table_values(qweight, table).int()  # [N, groups, 32]: values j, then j + 16
    sd = group_scales(scales, 2 * qweight.shape[1]) * dx  # [N, groups], rounded once as the kernel rounds it
    prod, gp = w * q, g + g % 2  # an odd number of groups gets a zero one, as the kernel's last step
    prod = F.pad(prod, (0, 0, 0, gp - g))  # [N, gp, 32]
    sd = F.pad(sd, (0, gp - g))  # [N, gp]
    # lane l of a group: values 4l..4l+3 and 16+4l..16+4l+3 (exact: |sum| <= 8 * 127 * 127 < 2^24); two groups a
    # step, the even one in lanes 0-3, the odd one in 4-7
    lanes = prod.view(n, gp, 2, 4, 4).sum((2, 4)).view(n, gp // 2, 8).float()  # [N, steps, 8]
    sd = sd.view(n, gp // 2, 2).repeat_interleave(4, dim=-1)  # [N, steps, 8]
    acc = torch.zeros(n, 8)
    for i in range(gp // 2):
        acc = _fma32(lanes[:, i], sd[:, i], acc)
    half = acc[:, :4] + acc[:, 4:]  # [N, 4]
    pair = half[:, :2] + half[:, 2:]  # [N, 2]
    return (pair[:, 0] + pair[:, 1]).view(1, n).to(torch.bfloat16)


def iq4_split_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        table: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's iq4_gemm_avx2 (prompt chunks on CPUs without VNNI), bit for bit:
    `pair_rows_reference` on the table values; a row that does not split takes `iq4_matmul`, the twin of the
    iq4_gemm the kernel sends it to."""
    n, half = qweight.shape
    values = table_values(qweight.cpu(), table.cpu()).view(n, 2 * half)  # [N, K] in k order
    return pair_rows_reference(x, values, group_scales(scales.cpu(), 2 * half),
                               lambda rows: iq4_matmul(rows, qweight.cpu(), scales.cpu(), table.cpu()))


def iq4_kernels() -> Any:
    """The extension where its IQ4 GEMV runs (AVX2 built here, not SUPERSLM_KERNELS=torch), else None."""
    ext = cext.extension()
    if ext is None or cext.torch_kernels_forced() or not ext.iq4_available():
        return None
    return ext


@register_format
class GGUFIQ4Linear(LinearFormat):
    """GGUF IQ4_NL / IQ4_XS blocks as they are (groups of 32: a float32 scale times a table value)."""

    name: ClassVar[str] = "giq4"

    def __init__(self, codes: np.ndarray | torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, note: str = "", table: torch.Tensor | None = None) -> None:
        """codes uint8 [N, K / 2] (per group of 32: byte j = codes j and j + 16), scales float32 [N, K / 32] or
        IQ4_XS's packed uint8 [N, K / 64 + K / 32] (`group_scales`)."""
        q = torch.as_tensor(codes).to(torch.uint8).contiguous()
        n, half = q.shape
        k = 2 * half
        packed = scales.dtype == torch.uint8
        want = (n, k // 64 + k // 32) if packed else (n, k // 32)
        if k % 32 or (packed and k % 256) or tuple(scales.shape) != want or n != out_features or in_features > k:
            raise InvalidArgument(f"giq4: codes {tuple(q.shape)} and scales {tuple(scales.shape)} do not match")
        t = TABLE if table is None else table.to(torch.int8).contiguous()
        if t.shape != (16,):
            raise InvalidArgument("giq4: a table of 16 values")
        super().__init__(in_features, out_features, k, bias, None, note)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", (scales if packed else scales.float()).contiguous())
        self.register_buffer("table", t.clone())

    @classmethod
    def from_gguf_parts(cls, parts: Sequence[tuple[np.ndarray, type[BlockType], Sequence[int], Any]],
                        bias: torch.Tensor | None = None) -> GGUFIQ4Linear:
        """IQ4_NL / IQ4_XS tensors (raw, block_type, shape, row_perm) fused along out (qkv, gate_up)."""
        got = [iq4_params(*p) for p in parts]
        codes = torch.from_numpy(np.concatenate([g[0] for g in got]))
        if len({g[1].dtype for g in got}) > 1:  # IQ4_NL beside IQ4_XS: every part's scales as floats
            k = codes.shape[1] * 2
            got = [(c, group_scales(torch.from_numpy(sc), k).numpy()) for c, sc in got]
        scales = torch.from_numpy(np.concatenate([g[1] for g in got]))
        n, k = codes.shape[0], codes.shape[1] * 2
        names = "+".join(dict.fromkeys(p[1].name for p in parts))
        return cls(codes, scales, k, n, as_bias(bias, n), f"from {names}, codes exact")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],  # type: ignore[override]
                  row_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> GGUFIQ4Linear:
        return cls.from_gguf_parts([(raw, block_type, shape, row_perm)], bias)

    @classmethod
    def from_dense(cls, *args: Any, **kwargs: Any) -> LinearFormat:
        raise InvalidArgument("the giq4 format is built from GGUF IQ4_NL / IQ4_XS blocks (from_gguf)")

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to(bf16) on a model must not round the scales: the kernels read them in float32 (or packed bytes), exact
        kept = self.scales
        out = super()._apply(fn, recurse)
        if self.scales.dtype != kept.dtype:
            self._buffers["scales"] = kept.to(self.scales.device)
        return out

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        if iq4_kernels() is None:
            return None
        return [self.qweight, self.scales, self.bias, None, None, self.table], [6, 32, *self._plan_ints()]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        ext = iq4_kernels()
        if ext is None or x.device.type != "cpu" or self.qweight.device.type != "cpu":
            # no kernels here (a folder converted on another machine, another device)
            return self._dense_matmul(x)
        # the extension's one choice for this row count (kernels/cpu/iq4.cpp iq4_linear), as the C++ plan's
        return ext.iq4_linear(x, self.qweight, self.scales, self.table, False)

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        # deterministic mode: the integer kernel at every row count (a row's bits never depend on the other rows),
        # as the C++ plan runs it
        return iq4_kernels() is not None and x.device.type == "cpu" and self.qweight.device.type == "cpu"

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        return iq4_kernels().iq4_gemv(h, self.qweight, self.scales, self.table)

    def dequantize_stored(self) -> torch.Tensor:
        return iq4_dequantize(self.qweight.cpu(), self.scales.cpu(), self.table.cpu())

    def _describe_format(self) -> str:
        return "gguf IQ4 (table g32)"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"qweight": self.qweight, "scales": self.scales, "table": self.table}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        if common.get("rotation") is not None:
            raise InvalidArgument("giq4 weights are never rotated")
        return cls(tensors["qweight"].contiguous(), tensors["scales"], common["in_features"], common["out_features"],
                   common.get("bias"), common.get("note", ""), tensors["table"])
