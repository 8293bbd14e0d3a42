"""KV page formats: decode speed at a long context, SuperSLM's bf16 and int8 pages beside llama.cpp's f16 and q8_0
KV cache, on the same GGUF, in alternating rounds.

    python benchmarks/kv_speed.py [--models smollm2-135m-instruct,gemma-3-270m] [--context 4000] [--decode 128]
                                  [--rounds 3] [--threads 2] [--engines ours-bf16,ours-int8,llama-q8_0,llama-f16]

Per model (the GGUF that `superslm.hub.fetch(name)` returns, read by both engines) and round, each engine in a
fresh process (superslm.bench.run_engine), the engines in turn, the order the same every round:
- the prompt: the first `--context` tokens of a fixed text (superslm/bench.py's own text, repeated), tokenized
  once by SuperSLM's tokenizer of the model (BOS first where it adds one) and fed as ids to both engines;
- a warm-up (a 16-token prompt, 4 tokens; llama.cpp: 16 tokens evaluated), then the prompt's prefill, untimed
  for decode; then `--decode` greedy tokens at batch 1, timed from the first token's arrival to the last's:
  (decode - 1) tokens over that time, the prefill left out; then the same at a 32-token prompt ("short"), so
  the cost of the long context's attention shows as the difference;
- SuperSLM: `model.engine(slots=1, context=..., prefix_caching=False, kv=FORMAT, adaptive_threads=False)`, its
  default load of the GGUF, `superslm.set_threads(threads)`: its steps always on `--threads` threads, as
  llama.cpp's (`--adaptive-threads` gives SuperSLM its default policy instead, fewer threads while other
  processes keep cores busy);
- llama.cpp: `llama_cpp.Llama(path, n_ctx=context + decode + 480, n_threads=threads, n_threads_batch=threads,
  n_batch=512, type_k=type_v=GGML_TYPE_Q8_0 (8) or GGML_TYPE_F16 (1), flash_attn=True for q8_0 (a quantized V
  cache needs it), False (the Python binding's default) for f16; "llama-f16-fa" is f16 with flash attention);
  each step `eval([token])` and the argmax of its scores, as superslm/bench.py times it; its extra buffer types
  (AMX, repacked weights) off unless `--extra-bufts`: on this project's Xeon VM its AMX matmul segfaults;
Prints each round's figures with the load average, then per engine the median and range over rounds of decode
tok/s, and the median (range) of the per-round ratios of ours-int8 to each other engine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

from superslm.bench import _TEXT, run_engine, timed_decode

ENGINES = ("ours-bf16", "ours-int8", "llama-q8_0", "llama-f16", "llama-f16-fa")
SHORT = 32


def bench_ours(path: str, ids: list[int], decode: int, threads: int, kv: str, adaptive: bool) -> dict[str, Any]:
    import superslm
    from superslm import Request, Sampling

    superslm.set_threads(threads)
    model = superslm.load(path, device="cpu")
    engine = model.engine(slots=1, context=len(ids) + decode + 16, prefix_caching=False, kv=kv,
                          adaptive_threads=adaptive)
    engine.generate([Request(ids[:16], 4, Sampling(ignore_eos=True))])  # warm-up (the C++ plan's first build)
    la0 = os.getloadavg()[0]
    tps, prefill_s = timed_decode(engine, ids, decode)
    short, _ = timed_decode(engine, ids[:SHORT], decode)
    kv_mb = (engine.kv.k.numel() * engine.kv.k.element_size() + engine.kv.v.numel() * engine.kv.v.element_size())
    return {"decode": tps, "short": short, "prefill_s": prefill_s, "load": (la0 + os.getloadavg()[0]) / 2,
            "kv_mb": kv_mb / 2**20}


def _timed_decode_llama(llm: Any, ids: list[int], decode: int) -> tuple[float, float]:
    import numpy as np

    llm.reset()
    t0 = time.perf_counter()
    def last() -> int:
        # the context's own logits of the batch's last token: without logits_all the binding leaves llm.scores unset
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.eval(ids)
    tok = last()
    t = time.perf_counter()
    for _ in range(decode - 1):
        llm.eval([tok])
        tok = last()
    return (decode - 1) / (time.perf_counter() - t), t - t0


def _no_extra_buffer_types() -> None:
    """llama.cpp's model parameters with use_extra_bufts off (llama-cpp-python has no argument for it): on a
    CPU with AMX the weights go to ggml's AMX buffer type, whose matmul segfaults (SIGSEGV at `ldtilecfg` in
    ggml_backend_amx_mul_mat) on this project's 2-core Xeon VM in the first llama_decode; off, they stay in plain
    CPU buffers (no AMX and no repacked layouts)."""
    import llama_cpp.llama as binding

    default = binding.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    binding.llama_cpp.llama_model_default_params = params


def bench_llama(path: str, ids: list[int], decode: int, threads: int, kv: str, flash: bool,
                extra_bufts: bool) -> dict[str, Any]:
    import llama_cpp

    if not extra_bufts:
        _no_extra_buffer_types()
    kind = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + decode + 480, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, type_k=kind, type_v=kind, flash_attn=flash,
                          verbose=False)
    llm.eval(ids[:16])  # warm-up
    la0 = os.getloadavg()[0]
    tps, prefill_s = _timed_decode_llama(llm, ids, decode)
    short, _ = _timed_decode_llama(llm, ids[:SHORT], decode)
    return {"decode": tps, "short": short, "prefill_s": prefill_s, "load": (la0 + os.getloadavg()[0]) / 2}


def run_one(engine: str, path: str, ids: list[int], decode: int, threads: int, adaptive: bool,
            extra_bufts: bool) -> dict[str, Any]:
    if engine.startswith("ours-"):
        return run_engine(engine, path, ids, decode, threads, engine[5:], adaptive, bench=bench_ours)
    kv = engine[6:].removesuffix("-fa")
    return run_engine(engine, path, ids, decode, threads, kv, kv == "q8_0" or engine.endswith("-fa"), extra_bufts,
                      bench=bench_llama)


def prompt_ids(name: str, context: int) -> tuple[str, list[int]]:
    """(the model's GGUF path, the first `context` ids of the fixed text, BOS first where the tokenizer adds one)."""
    import superslm
    from superslm import hub

    path = str(hub.fetch(name))
    tok = superslm.load(path, device="cpu").tokenizer
    ids = tok.encode(_TEXT * 2, add_special_tokens=True)[:context]
    if len(ids) < context:
        sys.exit(f"the text gives {len(ids)} tokens, fewer than --context {context}")
    return path, ids


def med(v: list[float]) -> str:
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m", help="known names (hub.fetch)")
    ap.add_argument("--context", type=int, default=4000, help="prompt tokens before the decode (default 4000)")
    ap.add_argument("--decode", type=int, default=128, help="greedy tokens timed at batch 1 (default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="ours-bf16,ours-int8,llama-q8_0,llama-f16",
                    help=f"comma-separated, in the order each round runs them: of {', '.join(ENGINES)}")
    ap.add_argument("--adaptive-threads", action="store_true",
                    help="SuperSLM's default thread policy instead of --threads threads every step")
    ap.add_argument("--extra-bufts", action="store_true",
                    help="leave llama.cpp's extra buffer types on (AMX, repacked weights): they crash on AMX VMs here")
    args = ap.parse_args()
    engines = args.engines.split(",")
    bad = [e for e in engines if e not in ENGINES]
    if bad or args.rounds < 1 or args.decode < 2 or args.context < SHORT:
        ap.error(f"unknown engines {bad}" if bad else "--rounds >= 1, --decode >= 2, --context >= 32")
    import llama_cpp

    print(f"{platform.machine()}, {os.cpu_count()} cpus, {args.threads} threads, llama-cpp-python "
          f"{llama_cpp.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; context {args.context}, decode {args.decode}, "
          f"short {SHORT}; SuperSLM {'adaptive' if args.adaptive_threads else 'pinned'} threads; llama.cpp extra "
          f"buffer types {'on' if args.extra_bufts else 'off'}", flush=True)
    failed = False
    summary = []
    for name in args.models.split(","):
        path, ids = prompt_ids(name, args.context)
        print(f"\n{name}: {path} ({os.path.getsize(path) / 2**20:.0f} MB), prompt {len(ids)} ids")
        got: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for e in engines:
                res = run_one(e, path, ids, args.decode, args.threads, args.adaptive_threads, args.extra_bufts)
                got[e].append(res)
                if "error" in res:
                    failed = True
                    print(f"  round {r + 1} {e:13} failed: {res['error']}", flush=True)
                    continue
                extra = f", KV {res['kv_mb']:.0f} MB" if "kv_mb" in res else ""
                print(f"  round {r + 1} {e:13} decode {res['decode']:6.1f} tok/s at {len(ids)}, "
                      f"{res['short']:6.1f} at {SHORT}; prefill {res['prefill_s']:.2f} s{extra}; "
                      f"load average {res['load']:.2f}", flush=True)
        summary.append(f"\n{name} ({args.rounds} rounds; median (range))")
        summary.append(f"| engine | decode tok/s at {len(ids)} | decode tok/s at {SHORT} | prefill s of {len(ids)} |"
                       " ours-int8 / this engine, decode at long context |")
        summary.append("|---|---|---|---|---|")
        ok = {e: [x for x in v if "error" not in x] for e, v in got.items()}
        for e in engines:
            if not ok[e]:
                summary.append(f"| {e} | failed | | | |")
                continue
            ratio = ""
            if e != "ours-int8" and "ours-int8" in got:
                q = [a["decode"] / b["decode"] for a, b in zip(got["ours-int8"], got[e])
                     if "error" not in a and "error" not in b]
                ratio = f"{statistics.median(q):.3f}x ({min(q):.3f}-{max(q):.3f})" if q else ""
            summary.append(f"| {e} | {med([x['decode'] for x in ok[e]])} | {med([x['short'] for x in ok[e]])} | "
                           f"{statistics.median([x['prefill_s'] for x in ok[e]]):.2f} | {ratio} |")
    print("\n".join(summary))
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
