"""The AVX2 row kernels (kernels/cpu/avx2_rows.cpp) against torch's multi-row kernels and R one-row AVX2 GEMVs, in
one process, interleaved rounds, on the int4 / int8 linears of SmolLM2, Gemma 3 270M and Qwen3.5 0.8B.

    PYTHONPATH=src python -m benchmarks.avx2_rows [--threads 1] [--rows 2,4,8,16] [--only smol]

Prints per shape and row count the best of each round's median time, the row kernel's GB/s of weights and the
ratios torch / row kernel and GEMVs / row kernel, with the load average before and after.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from superslm.kernels import cpu_decode
from superslm.quant.dense import Int8Linear
from superslm.quant.int4 import Int4Linear

#: (name, bits, out, in)
SHAPES = [("smol qkv 576->960", 4, 960, 576), ("smol gate_up 576->3072", 4, 3072, 576),
          ("smol down 1536->576", 4, 576, 1536), ("gemma gate_up 640->4096", 4, 4096, 640),
          ("qwen gate_up 1024->7168", 4, 7168, 1024), ("qwen down 3584->1024", 4, 1024, 3584),
          ("smol head 576->49152 int8", 8, 49152, 576)]  # fmt: skip


def _median(f: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]


def _ways(ext, bits: int, w: torch.Tensor) -> tuple[dict[str, Callable[[torch.Tensor], object]], float]:
    """(torch's kernel, R GEMVs, the row kernel) on w quantized to int4 (group 32) or int8; the weights' bytes."""
    n, k = w.shape
    if bits == 4:
        m4 = Int4Linear.from_dense(w, group=32)
        return {"torch": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, m4.qweight, 32, m4.scales_zeros),
                "gemvs": lambda x: [ext.int4_gemv_avx2(x[r : r + 1], m4.qweight, m4.scales_zeros, 32, 0)
                                    for r in range(x.shape[0])],
                "rows": lambda x: ext.int4_gemm_avx2(x, m4.qweight, m4.scales_zeros, 32, 0)}, n * k / 2 + n * k / 8
    m8 = Int8Linear.from_dense(w)
    return {"torch": lambda x: torch.ops.aten._weight_int8pack_mm(x, m8.codes, m8.scale),
            "gemvs": lambda x: [ext.int8_gemv_avx2(x[r : r + 1], m8.codes, m8.scale) for r in range(x.shape[0])],
            "rows": lambda x: ext.int8_gemm_avx2(x, m8.codes, m8.scale)}, n * k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="2,4,8,16")
    p.add_argument("--only", default="", help="shapes whose name contains this")
    ns = p.parse_args()
    ext = cpu_decode.extension()
    if ext is None or not ext.avx2_available():
        raise SystemExit("the C++ kernels were built without AVX2")
    torch.set_num_threads(ns.threads)
    print(f"load {open('/proc/loadavg').read().strip()}, threads {torch.get_num_threads()}")
    for name, bits, n, k in SHAPES:
        if ns.only not in name:
            continue
        g = torch.Generator().manual_seed(0)
        ways, size = _ways(ext, bits, torch.randn(n, k, generator=g))
        for rows in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            best = {key: float("inf") for key in ways}
            for _ in range(3):  # interleaved rounds
                for key, f in ways.items():
                    f(x)
                    best[key] = min(best[key], _median(lambda f=f, x=x: f(x), 7 if bits == 8 else 11))
            t, v, r = (best[key] * 1e6 for key in ("torch", "gemvs", "rows"))
            print(f"{name:26s} R={rows:2d} torch {t:8.0f} us  {rows}x GEMV {v:8.0f} us  rows {r:8.0f} us "
                  f"({size / r / 1e3:5.1f} GB/s)  torch/rows {t / r:4.2f}  gemvs/rows {v / r:4.2f}")
    print(f"load {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
