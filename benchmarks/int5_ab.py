"""Q5_0 as it is ("gguf5", quant/int5.py) against its int8 re-quantization (the path AVX2-only CPUs took before the
AVX2 5-bit kernels): `superslm bench`'s engine figures, and one GEMV's CPU time.

    python -m benchmarks.int5_ab --bench --rounds 2 [--model gemma-3-270m] [--peer]
    python -m benchmarks.int5_ab --gemv --rounds 12

`--bench`: superslm.bench's workloads (512-token prefill, 128-token decode, 16 streams, peak RSS), each engine in a
fresh process: ours as it loads now, ours with Q5_0 forced to int8 (`gguf_map.int5_runs` patched off in the child),
and with `--peer` llama.cpp; the order alternates between rounds, and each row notes the load average it started at.
`--gemv`: the one-row kernels on [4096, 640] (Gemma-3-270M's gate_up), one thread, interleaved; the thread's CPU time
per call (stable on a shared machine, where wall time is not), with the weights streamed from memory (24 matrices
in turn) and with one matrix in cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from superslm import bench


def bench_int8(*args: Any) -> dict[str, float]:
    """bench.bench_superslm with Q5_0 re-quantized to int8 (a module-level function: the child process imports it)."""
    from superslm.quant import gguf_map

    gguf_map.int5_runs = lambda: False  # type: ignore[assignment]
    return bench.bench_superslm(*args)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def run_bench(model: str, rounds: int, peer: bool) -> None:
    from superslm.hub import resolve_path

    args = (str(resolve_path(model)), 2, 512, 128, 16)
    for r in range(rounds):
        order = ["int5", "int8"] if r % 2 == 0 else ["int8", "int5"]
        rows: dict[str, dict[str, Any]] = {}
        for name in [*order, *(["llama.cpp"] if peer else [])]:
            load = _load()
            if name == "llama.cpp":
                rows[name] = bench.run_engine("llama.cpp", *args)
            else:
                rows[name] = bench.run_engine("superslm", *args, bench=None if name == "int5" else bench_int8)
            figures = {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[name].items()}
            print(f"round {r} {name} (load {load}): {figures}", flush=True)
        a, b = rows["int5"], rows["int8"]
        if "error" not in a and "error" not in b:
            print(f"round {r} int5 / int8: decode {a['decode'] / b['decode']:.3f}, prefill "
                  f"{a['prefill'] / b['prefill']:.3f}, peak RSS {a['rss_mb']:.0f} / {b['rss_mb']:.0f} MB", flush=True)
        p = rows.get("llama.cpp", {"error": "not run"})
        for name in ("int5", "int8"):
            if "error" not in rows[name] and "error" not in p:
                print(f"round {r} {name} vs llama.cpp: prefill {rows[name]['prefill'] / p['prefill']:.2f}x, decode "
                      f"{rows[name]['decode'] / p['decode']:.2f}x", flush=True)


def run_gemv(rounds: int) -> None:
    from gguf import quants

    from superslm import cext
    from superslm.formats.blocks import Q5_0
    from superslm.quant.dense import Int8Linear
    from superslm.quant.int5 import GGUFInt5Linear

    ext = cext.extension()
    if ext is None or not ext.avx2_available():
        raise SystemExit("the C++ kernels with AVX2 are not built here")
    torch.set_num_threads(1)
    n, k = 4096, 640
    m5, m8 = [], []
    for i in range(24):
        w = np.random.default_rng(i).standard_normal((n, k)).astype(np.float32)
        raw = quants.quantize(w, quants.GGMLQuantizationType.Q5_0).reshape(-1)
        m5.append(GGUFInt5Linear.from_gguf(raw, Q5_0, (n, k)))
        m8.append(Int8Linear.from_dense(torch.from_numpy(w)))
    x = torch.randn(1, k).bfloat16()
    for label, count in (("streamed (24 matrices)", 24), ("one matrix in cache", 1)):
        def five(mods: list[GGUFInt5Linear] = m5[:count]) -> None:
            for m in mods:
                ext.int5_gemv(x, m.qweight, m.scales_zeros, m.bits)

        def eight(mods: list[Int8Linear] = m8[:count]) -> None:
            for m in mods:
                ext.int8_gemv_avx2(x, m.codes, m.scale)

        got: dict[str, list[float]] = {"int5": [], "int8": []}
        for r in range(rounds):
            for name, fn in (("int5", five), ("int8", eight)) if r % 2 == 0 else (("int8", eight), ("int5", five)):
                t = time.thread_time()
                fn()
                fn()
                got[name].append((time.thread_time() - t) / (2 * count) * 1e6)
        a, b = statistics.median(got["int5"]), statistics.median(got["int8"])
        print(f"[{n}, {k}] {label}: int5 {a:.0f} us, int8 {b:.0f} us of CPU a GEMV; int5 / int8 {a / b:.3f} "
              f"(load {_load()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", action="store_true")
    p.add_argument("--gemv", action="store_true")
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--peer", action="store_true", help="llama.cpp too (llama-cpp-python)")
    p.add_argument("--rounds", type=int, default=2)
    ns = p.parse_args()
    if ns.bench:
        run_bench(ns.model, ns.rounds, ns.peer)
    if ns.gemv:
        run_gemv(ns.rounds)


if __name__ == "__main__":
    main()
