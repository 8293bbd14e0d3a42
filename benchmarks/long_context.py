"""Single-stream decode after a long prompt: SuperSLM beside llama.cpp on the same GGUF, each in a fresh process.

    python -m benchmarks.long_context [--model smollm2-135m-instruct] [--contexts 32,1800] [--decode 96]
                                      [--threads 2] [--rounds 1]

The prompt is `superslm bench`'s text (superslm/bench.py), its first 500 tokens repeated to the context's length;
greedy decoding of `--decode` tokens, EOS ignored. Decode tok/s counts from the first answer token (the prefill's)
to the last: (tokens - 1) / that time. Ours: `model.engine(slots=2, prefix_caching=False)` after
`superslm.memory.freeze_heap()`, as `superslm bench` runs it; llama.cpp: `Llama(n_ctx=context + decode + 64,
n_threads=n_threads_batch=threads, n_batch=512)`, tokens from `Llama.generate(ids, temp=0)`. Prints one line per
context and engine, then ours over llama.cpp's, with the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from superslm.bench import run_engine, timed_decode


def _ids(path: str, context: int) -> list[int]:
    import superslm
    from superslm.bench import _prompt_text

    tok = superslm.load(path, device="cpu").tokenizer
    ids = tok.encode(_prompt_text(512), add_special_tokens=False)[:500]
    return (ids * (context // len(ids) + 1))[:context]


def ours(path: str, context: int, decode: int, threads: int) -> dict[str, float]:
    """Our decode tok/s after a `context`-token prompt."""
    import superslm
    from superslm import Request, Sampling
    from superslm.memory import freeze_heap

    superslm.set_threads(threads)
    ids = _ids(path, context)
    model = superslm.load(path, device="cpu")
    greedy = Sampling(ignore_eos=True)
    engine = model.engine(slots=2, context=context + decode + 8, prefix_caching=False)
    engine.generate([Request(ids[:16], 4, greedy)])  # warm-up
    freeze_heap()
    return {"decode": timed_decode(engine, ids, decode)[0]}


def llama(path: str, context: int, decode: int, threads: int) -> dict[str, float]:
    """llama-cpp-python's decode tok/s after the same prompt."""
    import llama_cpp

    ids = _ids(path, context)
    llm = llama_cpp.Llama(path, n_ctx=context + decode + 64, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    n, start = 0, 0.0
    for _ in llm.generate(ids, temp=0):
        n += 1
        if n == 1:
            start = time.perf_counter()
        if n == decode:
            break
    return {"decode": (n - 1) / (time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF path or a known name (hub.fetch)")
    ap.add_argument("--contexts", default="32,1800")
    ap.add_argument("--decode", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ns = ap.parse_args(argv)
    path = ns.model
    if not os.path.exists(path):
        from superslm import hub

        path = str(hub.fetch(path, progress=False))
    print(f"{os.path.basename(path)}, {ns.threads} threads, load average {os.getloadavg()}", flush=True)
    for context in (int(c) for c in ns.contexts.split(",")):
        figures: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
        for _ in range(ns.rounds):
            for name, fn in (("ours", ours), ("llama.cpp", llama)):
                res: dict[str, Any] = run_engine(name, path, context, ns.decode, ns.threads, bench=fn)
                if "error" in res:
                    print(f"context {context} {name}: {res['error']}", flush=True)
                    continue
                figures[name].append(res["decode"])
                print(f"context {context:6d} {name:10} decode {res['decode']:7.1f} tok/s", flush=True)
        if figures["ours"] and figures["llama.cpp"]:
            ratio = max(figures["ours"]) / max(figures["llama.cpp"])
            print(f"context {context:6d} ours / llama.cpp (best of {ns.rounds}): {ratio:.2f}x", flush=True)
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
