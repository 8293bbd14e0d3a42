"""GGUF Q6_K weights run as they are: the file's 210-byte blocks of 256 values, 6-bit codes, an int8 scale per 16.

A block: ql (128 bytes, the codes' low 4 bits), qh (64 bytes, their high 2 bits), 16 int8 scales and an f16 d;
weight = (d * scale) * (code - 32), exact in float32 (11 + 8 + 6 significant bits). Every Q4_K_M file keeps its
output head (or tied embedding) and half its attn_v / ffn_down tensors in Q6_K. As int8 per output channel
(quant/gguf_map.py before this format) they took 8 bits a weight where the file has 6.5625, rounded a second time,
and the int8 GEMV ran compute-bound on AVX2 (two multiplies per code for its two-part activations). Here the
blocks are kept byte for byte (blocks uint8 [N, K / 256 * 210]).

The C++ kernels (kernels/cpu/q6k.cpp) run decode rows (1 to `GEMV_ROWS` of them) through an AVX2 integer GEMV with
llama.cpp's arithmetic (x as int8 per 256 values with its sums per 16, one multiply per code), each 32 values of x
with its own integer step (1..16 sixteenths of the block's); several rows of x share each unpacked block;
`q6k_gemv` is its twin, bit for bit) and prompts through a float32 GEMM over blocks of
decoded rows (`q6k_matmul` its twin). Without the extension the module multiplies with a dense float copy of the
weight, built at first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from superslm import cext
from superslm.errors import InvalidArgument
from superslm.formats.blocks import Q6_K, BlockType
from superslm.quant.base import LinearFormat, as_bias, register_format, row_order
from superslm.quant.split_rows import fma32 as _fma32

#: values and bytes of a Q6_K block
QK, BLOCK_BYTES = 256, 210
#: the most rows of x the integer GEMV takes (decode steps of many sequences); more rows (prompts) take the float32
#: GEMM. Measured on [1024, 3584] (2 threads, AVX2-only EPYC, loaded): the GEMV 4.1 ms at 16 rows and 19 ms at 64,
#: the GEMM 14 ms and 91 ms; at 512 rows the GEMM 188 ms
GEMV_ROWS = 64
#: rows q6k_params copies between two calls of its `release`
ROWS = 8192


def q6k_params(raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],
               row_perm: torch.Tensor | None = None, release: Callable[[], None] | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Q6_K bytes of a weight [out, in] -> its blocks uint8 [out, in / 256 * 210], rows in `row_perm` order if
    given. Written `ROWS` rows at a time into `out` (or a new array), `release` called after each block of rows (the
    loader drops the file's pages read so far): a 150k-row head is never held twice, its copy beside the file's."""
    n, k = (int(d) for d in shape)
    if block_type is not Q6_K:
        raise InvalidArgument(f"the q6k format runs Q6_K blocks, not {block_type.name}")
    if block_type.n_elements(raw) != n * k or k % QK:
        raise InvalidArgument(f"Q6_K: {raw.size} bytes do not hold a [{n}, {k}] weight")
    perm = row_order(row_perm, n)
    rows = raw.reshape(n, k // QK * BLOCK_BYTES)
    if out is None:
        out = np.empty(rows.shape, dtype=np.uint8)
    for r in range(0, n, ROWS):
        out[r : r + ROWS] = rows[r : r + ROWS] if perm is None else rows[perm[r : r + ROWS]]
        if release is not None:
            release()
    return out


def q6k_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, nb * 210] -> (codes int32 [N, nb, 256] in 0..63, scales int32 [N, nb, 16], d float32
    [N, nb]), value l of a block from ql[64 h + 32 (q4 & 1) + i] (low nibble for q4 < 2) and qh[32 h + i] bits
    2 q4, h = l / 128, q4 = l % 128 / 32, i = l % 32."""
    n = blocks.shape[0]
    b = blocks.view(n, -1, BLOCK_BYTES)  # [N, nb, 210]
    nb = b.shape[1]
    ql = b[..., :128].reshape(n, nb, 2, 1, 64)  # [N, nb, h, 1, 64]: bytes 0..31 for q4 = 0, 2; 32..63 for 1, 3
    low = torch.cat([ql & 15, ql >> 4], dim=3).view(n, nb, 2, 4, 32)  # [N, nb, h, q4, 32]: q4 = 2 * nibble + half
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    high = (b[..., 128:192].reshape(n, nb, 2, 1, 32) >> shifts) & 3  # [N, nb, h, q4, 32]
    codes = (low | (high << 4)).view(n, nb, QK).int()
    scales = b[..., 192:208].contiguous().view(torch.int8).int()  # [N, nb, 16]
    d = b[..., 208:210].contiguous().view(torch.float16).float().view(n, nb)
    return codes, scales, d


def q6k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q6k_dequantize: the weight float32 [N, K], (d * scale) * (code - 32)."""
    codes, scales, d = q6k_unpack(blocks)
    n, nb = d.shape
    ds = d[..., None] * scales.float()  # [N, nb, 16]: exact (11 + 8 bits)
    return (ds[..., None] * (codes - 32).float().view(n, nb, 16, 16)).view(n, nb * QK)


def q6k_matmul(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q6k_gemm: x [M, K] rounded to bf16 times the exact weight in float32
    -> [M, N] bf16."""
    return (x.to(torch.bfloat16).float() @ q6k_dequantize(blocks).t()).to(torch.bfloat16)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows x [M, K] rounded to bf16, then as the GEMV's int8 per block of 256 with a step per 32: the block's
    coarsest step dx = max|x| / 127 (llama.cpp's Q8_K, symmetric), group g's m = ceil(max|x_g| / max|x| * 16) in
    1..16 and its step dx * (m / 16), q = x / step rounded half to even, |q| <= 127. Returns (q int32 [M, K];
    m int32 [M, K / 32]; bsm int32 [M, K / 16], the sums of q per 16 times their group's m; dxs float32
    [M, K / 256] = dx / 16): x ~ q * m * dxs within a step / 2 an element. An all-zero block (or one whose dx
    underflows) gets q = 0, m = 16."""
    rows = x.shape[0]
    xg = x.to(torch.bfloat16).float().view(rows, -1, 8, 32)  # [M, nb, groups, 32]
    gmax = xg.abs().amax(-1)  # [M, nb, 8]
    bmax = gmax.amax(-1)  # [M, nb]
    dx = bmax / 127
    live = dx > 0
    m = torch.ceil(gmax / torch.where(live, bmax, 1.0)[..., None] * 16).clamp(1, 16)  # [M, nb, 8]
    m = torch.where(live[..., None], m, 16.0)
    step = dx[..., None] * (m * 0.0625)  # [M, nb, 8]: rounded once, as the kernel rounds it
    q = torch.round(xg / torch.where(live[..., None], step, 1.0)[..., None]).clamp(-127, 127)  # ties to even
    q = torch.where(live[..., None, None], q, 0.0).int()  # [M, nb, 8, 32]
    mi = m.int()
    bsm = q.view(rows, -1, 8, 2, 16).sum(-1, dtype=torch.int32) * mi[..., None]  # [M, nb, 8, 2]
    return q.view(rows, -1), mi.view(rows, -1), bsm.view(rows, -1), dx * 0.0625


def q6k_gemv(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The torch twin of the extension's q6k_gemv, bit for bit: rows x [M, K] each as int8 per 256 with a step
    per 32 (`quantize_blocks`); per weight row and block, 8 int32 lanes (lane j < 4: over the 8 groups t of 32
    values, the products of values 4j..4j+3 times scale 2t times m_t; lane j >= 4: values 16 + 4(j - 4).. times
    scale 2t + 1 times m_t), minus 32 * (bsm 2j * scale 2j + bsm 2j+1 * scale 2j+1) in lane j, exact; then
    acc = fma(float(lane), d * dxs, acc) over the blocks in order, the 8 lanes added pairwise -> [M, N] bf16. A row
    with a NaN or an inf takes `q6k_matmul`, as the kernel does."""
    if x.dim() != 2 or x.shape[1] % QK or blocks.shape[1] != x.shape[1] // QK * BLOCK_BYTES:
        raise InvalidArgument(f"q6k_gemv: rows of K (a multiple of 256) against [N, K / 256 * 210], got "
                              f"{tuple(x.shape)} and {tuple(blocks.shape)}")
    xb = x.to(torch.bfloat16)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.bfloat16)
    finite = torch.isfinite(xb).all(-1)
    if not finite.all():
        bad = (~finite).nonzero()[:, 0]
        out[bad] = q6k_matmul(xb[bad], blocks)
    rows = finite.nonzero()[:, 0]
    if rows.numel() == 0:
        return out
    q, mult, bsm, dxs = quantize_blocks(xb[rows])
    codes, scales, d = q6k_unpack(blocks)
    n, nb = d.shape
    sc = scales.view(n, nb, 8, 2, 1).long()  # [N, nb, t, half, 1]: scale 2t + half
    for i, r in enumerate(rows.tolist()):
        prod = codes * q[i].view(1, nb, QK)  # [N, nb, 256]: |.| <= 63 * 127
        four = prod.view(n, nb, 8, 2, 4, 4).sum(-1)  # [N, nb, t, half, j]: values 32t + 16 half + 4j ..
        main = (four.long() * sc * mult[i].view(1, nb, 8, 1, 1)).sum(2).view(n, nb, 8)  # [N, nb, lane]
        off = (bsm[i].view(1, nb, 8, 2).long() * scales.view(n, nb, 8, 2)).sum(-1)  # [N, nb, lane]
        lanes = (main - 32 * off).double().float()  # exact integers, rounded once to float32 (as cvtepi32_ps)
        sd = d * dxs[i]  # [N, nb]: rounded once, as the kernel rounds it
        acc = torch.zeros(n, 8)
        for b in range(nb):
            acc = _fma32(lanes[:, b], sd[:, b : b + 1].expand(n, 8), acc)
        half = acc[:, :4] + acc[:, 4:]  # [N, 4]
        pair = half[:, :2] + half[:, 2:]  # [N, 2]
        out[r] = (pair[:, 0] + pair[:, 1]).to(torch.bfloat16)
    return out


def q6k_kernels() -> Any:
    """The extension where its Q6_K GEMV runs (AVX2 built here, not SUPERSLM_KERNELS=torch), else None."""
    ext = cext.extension()
    if ext is None or cext.torch_kernels_forced() or not ext.q6k_available():
        return None
    return ext


@register_format
class GGUFQ6KLinear(LinearFormat):
    """GGUF Q6_K blocks as they are (256 values: 6-bit codes, an int8 scale per 16, an f16 d)."""

    name: ClassVar[str] = "gq6k"

    def __init__(self, blocks: np.ndarray | torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, note: str = "") -> None:
        """blocks uint8 [N, K / 256 * 210], the file's bytes of each row."""
        b = torch.as_tensor(blocks).to(torch.uint8).contiguous()
        if b.dim() != 2 or b.shape[1] % BLOCK_BYTES or b.shape[0] != out_features:
            raise InvalidArgument(f"gq6k: blocks {tuple(b.shape)} are not [{out_features}, K / 256 * 210]")
        k = b.shape[1] // BLOCK_BYTES * QK
        if in_features > k or k == 0:
            raise InvalidArgument(f"gq6k: blocks of {k} values do not hold {in_features} inputs")
        super().__init__(in_features, out_features, k, bias, None, note)
        self.register_buffer("blocks", b)

    @classmethod
    def from_gguf_parts(cls, parts: Sequence[tuple[np.ndarray, type[BlockType], Sequence[int], Any]],
                        bias: torch.Tensor | None = None, release: Callable[[], None] | None = None) -> GGUFQ6KLinear:
        """Q6_K tensors (raw, block_type, shape, row_perm) fused along out (qkv, gate_up), each part's rows written
        in place (`q6k_params`; `release` as there)."""
        if not parts or len({int(p[2][1]) for p in parts}) != 1:
            raise InvalidArgument("gq6k: fused parts must share their input dimension")
        k, n = int(parts[0][2][1]), sum(int(p[2][0]) for p in parts)
        blocks = np.empty((n, k // QK * BLOCK_BYTES), dtype=np.uint8)
        r = 0
        for raw, block_type, shape, perm in parts:
            m = int(shape[0])
            q6k_params(raw, block_type, shape, perm, release, blocks[r : r + m])
            r += m
        return cls(torch.from_numpy(blocks), k, n, as_bias(bias, n), "from Q6_K, codes exact")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int],  # type: ignore[override]
                  row_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> GGUFQ6KLinear:
        return cls.from_gguf_parts([(raw, block_type, shape, row_perm)], bias)

    @classmethod
    def from_dense(cls, *args: Any, **kwargs: Any) -> LinearFormat:
        raise InvalidArgument("the gq6k format is built from GGUF Q6_K blocks (from_gguf)")

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        if q6k_kernels() is None:
            return None
        return [self.blocks, None, self.bias, None, None, None], [7, QK, *self._plan_ints()]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        ext = q6k_kernels()
        if ext is None or x.device.type != "cpu" or self.blocks.device.type != "cpu":
            # no kernels here (a folder converted on another machine, another device)
            return self._dense_matmul(x)
        if x.shape[0] <= GEMV_ROWS:
            return ext.q6k_gemv(x, self.blocks)
        return ext.q6k_gemm(x, self.blocks, False)

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        # deterministic mode: 16-row float32 products at every row count, as the C++ plan runs it (the GEMV's rows
        # do not depend on their batch either, but prompts could not take it at speed)
        return q6k_kernels() is not None and x.device.type == "cpu" and self.blocks.device.type == "cpu"

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        if tile_rows != 16:
            raise InvalidArgument(f"gq6k: deterministic tiles are 16 rows, not {tile_rows}")
        return q6k_kernels().q6k_gemm(h, self.blocks, True)

    def dequantize_stored(self) -> torch.Tensor:
        return q6k_dequantize(self.blocks.cpu())

    def _describe_format(self) -> str:
        return "gguf Q6_K (6-bit g16)"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"blocks": self.blocks}, {}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        if common.get("rotation") is not None:
            raise InvalidArgument("gq6k weights are never rotated")
        return cls(tensors["blocks"].contiguous(), common["in_features"], common["out_features"],
                   common.get("bias"), common.get("note", ""))
