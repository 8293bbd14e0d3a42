"""Q8_0 weights as they are ("gq80", quant/q80.py) against their int8 re-quantization: GEMV speed, accuracy and
decode speed of a GGUF file, each in one process.

    python -m benchmarks.q80_decode --gemv --rows 1,16 --rounds 5
    python -m benchmarks.q80_decode --accuracy
    python -m benchmarks.q80_decode --decode ~/.cache/superslm/gemma-3-270m/gemma-3-270m-q4_k_m.gguf --rounds 3

`--gemv`: each shape's kernels on the same random valid blocks, interleaved, best of `--rounds` x a few calls, each
as a decode step runs it (kernels.cpu_decode.rows_linear: the int8 path's AVX2 GEMV at one row, its row kernel or
torch's _weight_int8pack_mm at several; gq80's integer GEMV), and gq80's float32 GEMM over decoded rows beside
them at several rows. GB/s are of each format's own bytes (Q8_0 8.5 bits a weight, int8 8).
`--accuracy`: the GEMV's error (x as int8 per 32, llama.cpp's Q8_0) against the int8 path's (the weight
re-quantized per channel, x bf16-exact in two int8 parts) and against float32 x, from the float64 product with the
file's weights, over activations shaped like a decoder's (benchmarks.iq4_decode.activations).
`--decode FILE`: greedy decode tokens per second of the file with Q8_0 as gq80 and as int8 (the default),
alternating, `--rounds` times (benchmarks.q6k_decode.decode_tps).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import numpy as np
import torch

from benchmarks.q6k_decode import _best, decode_tps

#: [out, in]: Gemma-3-270M's tied head, its gate / up and down projections
SHAPES = {"head": (262144, 640), "gate 270M": (2048, 640), "down 270M": (640, 2048)}


def random_q80(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q8_0 bytes of a weight [n, k]: random codes in -127..127 (ggml's range), d ~ 1e-3."""
    m = n * k // 32
    raw = np.empty((m, 34), dtype=np.uint8)
    raw[:, 2:] = rng.integers(-127, 128, (m, 32), dtype=np.int8).view(np.uint8)
    raw[:, :2] = (np.abs(rng.standard_normal((m, 1))) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def gemv_bench(rounds: int, rows_list: tuple[int, ...]) -> None:
    """Each shape: gq80 against int8 as a decode step runs them (and gq80's float32 GEMM past one row), interleaved,
    best of the rounds."""
    from superslm import cext
    from superslm.formats.blocks import Q8_0
    from superslm.kernels import cpu_decode
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.q80 import GGUFQ80Linear

    ext = cext.extension()
    rng = np.random.default_rng(0)

    def step(module, x):  # noqa: ANN001, ANN202
        y = cpu_decode.rows_linear(module, x)
        return module(x) if y is None else y

    for name, (n, k) in SHAPES.items():
        raw = random_q80(n, k, rng)
        q8 = GGUFQ80Linear.from_gguf(raw, Q8_0, (n, k))
        i8 = linear_from_gguf([(raw, Q8_0, (n, k), None)], None, {"Q8_0": ("int8", {})})
        del raw
        calls = max(3, int(3e8 // (n * k)))
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            runs = {"gq80": lambda x=x, m=q8: step(m, x), "int8": lambda x=x, m=i8: step(m, x)}
            if rows > 1:
                runs["gq80 f32 gemm"] = lambda x=x, m=q8: ext.q80_gemm(x, m.codes, m.d, False)
            best = dict.fromkeys(runs, 1e9)
            for _ in range(rounds):
                for key, fn in runs.items():
                    fn()
                    best[key] = min(best[key], _best(fn, calls))
            size = {"gq80": n * k * 34 / 32, "int8": n * k, "gq80 f32 gemm": n * k * 34 / 32}
            print(f"{name} [{n}, {k}] rows {rows}: " + ", ".join(
                f"{key} {v * 1e3:.3f} ms ({size[key] / v / 1e9:.1f} GB/s)" for key, v in best.items())
                + f"; int8 / gq80 {best['int8'] / best['gq80']:.2f}x", flush=True)
        del q8, i8
        gc.collect()


def accuracy(rows: int) -> None:
    """Relative error (rms over outputs / rms of the exact product) of each path, over the shapes' inputs."""
    from gguf import GGMLQuantizationType, quants

    from benchmarks.iq4_decode import activations
    from superslm.formats.blocks import Q8_0
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.q80 import GGUFQ80Linear, q80_gemv

    g = torch.Generator().manual_seed(0)
    for k, n in ((640, 2048), (2048, 640), (896, 4864)):
        raw = quants.quantize((torch.randn(n, k, generator=g) * 0.02).numpy(), GGMLQuantizationType.Q8_0).reshape(-1)
        q8 = GGUFQ80Linear.from_gguf(raw, Q8_0, (n, k))
        i8 = linear_from_gguf([(raw, Q8_0, (n, k), None)], None, {"Q8_0": ("int8", {})})
        w, w8 = q8.dequantize().double(), i8.dequantize().double()
        for kind in ("gauss", "norm", "swiglu"):
            x = activations(kind, k, rows, g)
            ref = x.double() @ w.t()  # [rows, n]
            err = {
                "gq80 (int8 x per 32)": q80_gemv(x, q8.codes, q8.d).double() - ref,  # the kernel's twin, bit for bit
                "int8 weights": (x.double() @ w8.t()).bfloat16().double() - ref,
                "float32 x": ref.bfloat16().double() - ref,
            }
            rms = ref.pow(2).mean().sqrt()
            print(f"[{n}, {k}] {kind:6s}: " + ", ".join(
                f"{key} {e.pow(2).mean().sqrt() / rms * 100:.3f}% (max {e.abs().max() / rms * 100:.2f}%)"
                for key, e in err.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemv", action="store_true")
    ap.add_argument("--rows", default="1,16", help="rows of x for --gemv")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--decode", type=Path, help="a GGUF file")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    with open("/proc/loadavg") as f:
        print("load average", f.read().split()[:3], "threads", torch.get_num_threads())
    if ns.gemv:
        gemv_bench(ns.rounds, tuple(int(r) for r in ns.rows.split(",")))
    if ns.accuracy:
        accuracy(16)
    if ns.decode:
        decode_tps(ns.decode.expanduser(), ns.rounds, ns.tokens, ns.streams, "Q8_0", "gq80")


if __name__ == "__main__":
    main()
