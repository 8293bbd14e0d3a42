"""Prompt chunks' int linears on CPUs without VNNI: int4 through the AVX2 int4 row kernel (`INT4_ROWS`, each row
the one-row GEMV's bits), Q5_0's int5 through the same tiles (`INT5_ROWS`), int8
through the two-part integer kernel (`INT8_ROWS`); where those do not apply, the weight decoded to float32 a block
of rows at a time and a float32 GEMM (BLAS) on each block.

torch's packed int4 kernel (`_weight_int4pack_mm_for_cpu`) and its int8 one run ~81 GFLOP/s on an AVX2-only
EPYC at any row count; MKL's sgemm runs ~160 at 512 rows, ~100 at 64 (2 threads, 2026-12-07). Decoding a block
of rows costs a pass over its weights, so the path pays from `PROMPT_ROWS` rows: prompt chunks, not decode
steps. The default mode only: a row's bits here depend on BLAS's choices for the row count, so deterministic
mode keeps the row-invariant kernels. On CPUs with VNNI the int8 kernels of gemm.cpp are the plan's choice
and this path stands aside (not measured there).
"""

from __future__ import annotations

from typing import Any

import torch

from superslm import cext
from superslm.kernels import cpu_decode
from superslm.kernels.dispatch import backend

#: rows from which decoding the weight for a float32 GEMM beats torch's packed kernels (measured 2026-12-07 on
#: an AVX2-only EPYC, shapes of Qwen3.5-0.8B; see benchmarks/linear_formats.py --sections prompt)
PROMPT_ROWS = 64
#: int4 prompt rows through the AVX2 int4 row kernel (kernels/cpu/avx2_rows.cpp: weights unpacked once per
#: chunk and k block, two rows x 32 columns of int32 accumulators, vpmaddwd on the two-part int8 activations),
#: each row the one-row GEMV's bits, so a prompt's rows equal decode's. It ran 1.2-1.7x the decoded blocks +
#: sgemm on one core of an AVX2-only EPYC (2026-12-07; benchmarks/linear_formats.py --sections prompt).
#: False: decoded blocks and float32 GEMMs (benchmarks compare the two)
INT4_ROWS = True
#: int8 prompt rows through the AVX2 two-part integer kernel (kernels/cpu/pair_rows.cpp int8_prompt_avx2: x split
#: per group of 32 into two int8 parts, the codes' products summed exactly in int32); False: decoded blocks and
#: float32 GEMMs (benchmarks compare the two)
INT8_ROWS = True
#: int5 (GGUF Q5_0) prompt rows through the module as it is: its AVX2 row kernel (kernels/cpu/avx2_rows.cpp, the
#: int4 kernel's tiles with the fifth bits), each row the GEMV's bits, 1.26-1.33x the decoded blocks + sgemm at 512
#: rows of Gemma-3's shapes (2026-12-07). False: decoded blocks and float32 GEMMs
INT5_ROWS = True
#: float32 weights decoded per block (4 MiB: the block stays in cache between its decode and its GEMM)
BLOCK_BYTES = 4 << 20


def int4_dequant_rows_reference(qweight: torch.Tensor, sz: torch.Tensor, group: int, n0: int, n1: int,
                                block: int) -> torch.Tensor:
    """The torch twin of the extension's int4_dequant_rows: rows n0..n1 (block boundaries) of torch's packed int4
    CPU layout in blocks of `block` rows (per block and k, block / 2 bytes; byte j holds row j in its low nibble
    and row j + block / 2 in its high one) -> float32 [K, n1 - n0] (transposed) as s * (c - 8) + z."""
    k = qweight.shape[1] * 2
    p = qweight.reshape(-1)[n0 * k // 2 : n1 * k // 2].reshape((n1 - n0) // block, k, block // 2)  # [blocks, K, B/2]
    codes = torch.cat([p & 15, p >> 4], dim=2).permute(0, 2, 1).reshape(n1 - n0, k)  # [rows, K]
    s = sz[:, n0:n1, 0].float().t().repeat_interleave(group, dim=1)  # [rows, K]
    z = sz[:, n0:n1, 1].float().t().repeat_interleave(group, dim=1)
    return ((codes.float() - 8) * s + z).t().contiguous()


def _decoder(module: torch.nn.Module, got: Any, ext: Any) -> tuple[Any, int, int] | None:
    """(decode(n0, n1, out) -> rows n0..n1 of the weight as a float32 [K, n1 - n0] matrix (in `out`'s memory), the
    rows' multiple, K) for an int4 (torch's packed CPU layout), int5 (GGUF Q5_0) or int8 linear, from the operands it
    hands the C++ plan (`got`: its plan_args()); None for other formats."""
    if got is None:
        return None
    (weight, scales, *_), (kind, group, *_) = got
    if kind == 1 and getattr(module, "layout", None) == "cpu" and scales is not None and scales.dim() == 3:
        block = ext.torch_int4_block()
        if block <= 0 or weight.shape[0] % block:
            return None
        k = weight.shape[1] * 2

        def int4(n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
            ext.int4_dequant_rows(weight, scales, group, n0, n1, out)
            return out[: (n1 - n0) * k].view(k, n1 - n0)

        return int4, block, k
    if kind == 5:  # Q5_0 (quant/int5.py): nibbles in blocks of 64 rows, the fifth bits' masks
        bits, k = got[0][5], weight.shape[1] * 2

        def int5(n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
            ext.int5_dequant_rows(weight, scales, bits, n0, n1, out)
            return out[: (n1 - n0) * k].view(k, n1 - n0)

        return int5, 64, k
    if kind == 2 and weight.dtype == torch.int8 and scales is not None:
        k = weight.shape[1]

        def int8(n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
            w = out[: (n1 - n0) * k].view(n1 - n0, k)
            w.copy_(weight[n0:n1])
            return w.mul_(scales[n0:n1, None]).t()  # int8 times a bf16 scale: exact in float32

        return int8, 1, k
    return None


def prompt_linear(module: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """module(x) (or module.forward_rotated(x, dtype) for an input already rotated) for `PROMPT_ROWS` rows or more
    of the default mode, through decoded blocks of the weight and float32 GEMMs; None where it does not apply
    (few rows, another format, hooks, a GPU or the Triton kernels, a CPU with VNNI, torch's kernels forced):
    the caller runs the module as it is. A ConcatLinear part by part, a part the path does not take as it is."""
    if x.dim() != 2 or x.shape[0] < PROMPT_ROWS or x.device.type != "cpu" or backend(x.device) != "torch":
        return None
    ext = cext.extension()
    if ext is None or ext.vnni_available() or cext.torch_kernels_forced() or cpu_decode.hooked(module):
        return None
    parts = getattr(module, "parts", None)
    if parts is not None:  # a ConcatLinear: its parts side by side (each prepares its own input)
        if dtype is not None:
            return None
        ys = [prompt_linear(part, x) for part in parts]
        if all(y is None for y in ys):
            return None
        # a part the path does not take (a Q6_K v beside Q4_K q and k) runs as it is, as ConcatLinear.forward
        # runs it, rather than sending the other parts back to torch's kernels with it
        return torch.cat([part(x) if y is None else y for part, y in zip(parts, ys, strict=True)], dim=1)
    if INT4_ROWS and dtype is None:  # int4: the AVX2 row kernel, each row the bits decode gives it
        y = cpu_decode.int4_prompt_linear(module, x)
        if y is not None:
            return y
    if INT8_ROWS and dtype is None:  # int8: the AVX2 two-part integer kernel
        y = cpu_decode.int8_prompt_linear(module, x)
        if y is not None:
            return y
    args = getattr(module, "plan_args", lambda: None)()
    if INT5_ROWS and args is not None and args[1][0] == 5:  # Q5_0's int5 (quant/int5.py's plan kind)
        return None  # the module as it is: its AVX2 row kernel, each row decode's bits
    got = _decoder(module, args, ext)
    if got is None:
        return None
    decode, multiple, k = got
    h = (module.prepare_input(x) if dtype is None else x).float()  # type: ignore[operator]
    if h.shape[1] != k:
        return None
    out = module._out  # type: ignore[attr-defined]
    n_rows = -(-out // multiple) * multiple
    step = max(multiple, BLOCK_BYTES // (4 * k) // multiple * multiple)
    buf = torch.empty(min(step, n_rows) * k)
    ys = [h @ decode(n0, min(n0 + step, n_rows), buf) for n0 in range(0, n_rows, step)]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
    return module.finish(y[:, :out], x.dtype if dtype is None else dtype)  # type: ignore[operator]
