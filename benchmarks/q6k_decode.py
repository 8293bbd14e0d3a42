"""Q6_K weights as they are ("gq6k", quant/q6k.py) against their int8 re-quantization: GEMV speed, accuracy and
decode speed of a GGUF file, each in one process.

    python -m benchmarks.q6k_decode --gemv --rounds 5
    python -m benchmarks.q6k_decode --accuracy
    python -m benchmarks.q6k_decode --decode ~/.cache/superslm/published/qwen3_5-0.8b-Q4_K_M.gguf --rounds 3

`--gemv`: each shape's kernels on the same random valid blocks, interleaved, best of `--rounds` x a few calls:
q6k_gemv against the int8 path's kernel for the same rows (one row: the AVX2 int8 GEMV; several: torch's
_weight_int8pack_mm, what Int8Linear runs there without VNNI), and against q6k_gemm (the float32 GEMM over decoded
rows) at several rows. GB/s are of each format's own bytes (Q6_K 6.5625 bits a weight, int8 8).
`--accuracy`: the GEMV's error (x as int8 per 256, llama.cpp's Q8_K) against the int8 path's (the weight
re-quantized per channel, x bf16-exact in two int8 parts) and against float32 x, from the float64 product with the
file's weights, over activations shaped like a decoder's (benchmarks.iq4_decode.activations).
`--decode FILE`: one-sequence greedy decode tokens per second of the file as it loads now (Q6_K as gq6k) and with
Q6_K mapped to int8 as before, alternating, `--rounds` times.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import torch

#: [out, in]: Qwen3.5-0.8B's tied head, its ffn_down, Qwen2.5-0.5B's ffn_down
SHAPES = {"head": (248320, 1024), "down 0.8B": (1024, 3584), "down 0.5B": (896, 4864)}


def random_q6k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K bytes of a weight [n, k]: random codes and scales, d ~ 1e-3 (speed does not depend on them)."""
    m = n * k // 256
    raw = rng.integers(0, 256, (m, 210), dtype=np.uint8)
    raw[:, 208:210] = (np.abs(rng.standard_normal((m, 1))) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def quantize_q6k(w: np.ndarray) -> np.ndarray:
    """w float32 [n, k] -> Q6_K bytes: per 16 values a step max|w| / 32 as d * scale (d per 256, the scale int8),
    codes rounded to the nearest step (ggml's layout, without its scale search)."""
    g = w.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, 16]
    s = np.abs(g).max(-1) / 32  # [blocks, 16]
    d = (s.max(-1) / 127).astype(np.float16)  # [blocks]
    df = d.astype(np.float32)
    sc = np.round(s / np.where(df > 0, df, 1)[:, None]).clip(0, 127).astype(np.int8)  # [blocks, 16]
    step = df[:, None] * sc  # [blocks, 16]
    q = np.round(g / np.where(step > 0, step, 1)[..., None]).clip(-32, 31).astype(np.int16) + 32  # [blocks, 16, 16]
    qv = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, h, q4, i]: value 128 h + 32 q4 + i
    ql = (qv[:, :, :2] & 15) | ((qv[:, :, 2:] & 15) << 4)  # [blocks, h, 2, 32]: q4 < 2 low nibbles, q4 + 2 high
    qh = (qv[:, :, 0] >> 4) | ((qv[:, :, 1] >> 4) << 2) | ((qv[:, :, 2] >> 4) << 4) | ((qv[:, :, 3] >> 4) << 6)
    out = np.empty((len(qv), 210), dtype=np.uint8)
    out[:, :128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    return out.reshape(-1)


def _best(fn, calls: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def gemv_bench(rounds: int, rows_list: tuple[int, ...]) -> None:
    """Each shape: q6k against int8 (and the float32 GEMM past one row), interleaved, best of the rounds."""
    from superslm import cext
    from superslm.formats.blocks import Q6_K
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.q6k import GGUFQ6KLinear

    ext = cext.extension()
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        raw = random_q6k(n, k, rng)
        q6 = GGUFQ6KLinear.from_gguf(raw, Q6_K, (n, k))
        i8 = linear_from_gguf([(raw, Q6_K, (n, k), None)], None, {"Q6_K": ("int8", {})})
        b6, codes, scale = q6.blocks, i8.codes, i8.scale
        del raw, q6, i8
        calls = max(3, int(3e8 // (n * k)))
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            runs = {"q6k": lambda x=x, b=b6: ext.q6k_gemv(x, b)}
            if rows == 1:
                runs["int8"] = lambda x=x, c=codes, s=scale: ext.int8_gemv_avx2(x, c, s)
            else:
                runs["int8"] = lambda x=x, c=codes, s=scale: torch._weight_int8pack_mm(x, c, s)
                runs["q6k f32 gemm"] = lambda x=x, b=b6: ext.q6k_gemm(x, b, False)
            best = dict.fromkeys(runs, 1e9)
            for _ in range(rounds):
                for key, fn in runs.items():
                    fn()
                    best[key] = min(best[key], _best(fn, calls))
            size = {"q6k": n * k * 210 / 256, "int8": n * k, "q6k f32 gemm": n * k * 210 / 256}
            print(f"{name} [{n}, {k}] rows {rows}: " + ", ".join(
                f"{key} {v * 1e3:.3f} ms ({size[key] / v / 1e9:.1f} GB/s)" for key, v in best.items())
                + f"; int8 / q6k {best['int8'] / best['q6k']:.2f}x", flush=True)
        del b6, codes, scale
        gc.collect()


def accuracy(rows: int) -> None:
    """Relative error (rms over outputs / rms of the exact product) of each path, over the shapes' inputs."""
    from benchmarks.iq4_decode import activations
    from superslm.formats.blocks import Q6_K
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.q6k import GGUFQ6KLinear, q6k_gemv

    g = torch.Generator().manual_seed(0)
    for k, n in ((1024, 2048), (3584, 1024), (4864, 896)):
        raw = quantize_q6k((torch.randn(n, k, generator=g) * 0.02).numpy())
        q6 = GGUFQ6KLinear.from_gguf(raw, Q6_K, (n, k))
        i8 = linear_from_gguf([(raw, Q6_K, (n, k), None)], None, {"Q6_K": ("int8", {})})
        w, w8 = q6.dequantize().double(), i8.dequantize().double()
        for kind in ("gauss", "norm", "swiglu"):
            x = activations(kind, k, rows, g)
            ref = x.double() @ w.t()  # [rows, n]
            err = {
                "gq6k (int8 x, a step per 32)": q6k_gemv(x, q6.blocks).double() - ref,  # the kernel's twin, bit for bit
                "int8 weights": (x.double() @ w8.t()).bfloat16().double() - ref,
                "float32 x": ref.bfloat16().double() - ref,
            }
            rms = ref.pow(2).mean().sqrt()
            print(f"[{n}, {k}] {kind:6s}: " + ", ".join(
                f"{key} {e.pow(2).mean().sqrt() / rms * 100:.3f}% (max {e.abs().max() / rms * 100:.2f}%)"
                for key, e in err.items()), flush=True)


def decode_tps(path: Path, rounds: int, tokens: int, streams: int, block: str = "Q6_K", fmt: str = "gq6k") -> None:
    """Greedy decode tokens per second (`streams` sequences of `tokens` each after a 32-token prompt), `block`
    tensors as `fmt` and as int8, alternating (as superslm.bench drives the engine)."""
    import superslm
    from superslm import Request, Sampling
    from superslm.quant.gguf_map import NEAREST

    greedy = Sampling(ignore_eos=True)

    def timed(model) -> float:  # noqa: ANN001
        engine = model.engine(slots=streams, context=32 + tokens + 8, rows=512, prefix_caching=False)
        ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8,
                                     add_special_tokens=False)[:32]
        for i in range(streams):
            engine.add(Request(ids[i:] + ids[:i], tokens, greedy))
        engine.advance()  # the prompts
        t0, n = time.perf_counter(), 0
        while engine.busy():
            n += sum(len(p.tokens) for p in engine.advance())
        return n / (time.perf_counter() - t0)

    kept = NEAREST[block]
    models = {}
    for f in (fmt, "int8"):
        NEAREST[block] = (f, {})
        models[f] = superslm.load(path, device="cpu")
    NEAREST[block] = kept
    for f, m in models.items():
        print(f, m.info()["linears"], flush=True)
        timed(m)  # warm
    for r in range(rounds):
        got = {f: timed(m) for f, m in models.items()}
        print(f"round {r}, {streams} streams: " + ", ".join(f"{f} {v:.2f} tok/s" for f, v in got.items())
              + f"; {fmt} / int8 {got[fmt] / got['int8']:.3f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemv", action="store_true")
    ap.add_argument("--rows", default="1,4,16", help="rows of x for --gemv")
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
        decode_tps(ns.decode.expanduser(), ns.rounds, ns.tokens, ns.streams)


if __name__ == "__main__":
    main()
