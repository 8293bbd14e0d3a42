"""CPU benchmark: SuperSLM beside llama-cpp-python (and optionally transformers) on one GGUF, one run.

    python benchmarks/cpu.py [--model PATH_OR_NAME] [--threads 2] [--peer llama.cpp] [--peer transformers]

Workloads: prefill tok/s of a 512-token prompt; decode tok/s at batch 1 (128 tokens); aggregate decode
tok/s of 16 concurrent streams (128 tokens each). Prints one table and a markdown row for
docs/benchmarks.md. Ratios mean something; absolute numbers on a shared machine less so.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path

import torch

import superslm
from superslm import Request, Sampling


def prompt_ids(model: superslm.Model, n: int) -> list[int]:
    text = Path(__file__).read_text() * 8
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def bench_superslm(path: str, dtype: str | None, prefill: int, decode: int, streams: int) -> dict[str, float]:
    t = time.perf_counter()
    model = superslm.load(path, device="cpu", dtype=dtype)
    load_s = time.perf_counter() - t
    ids = prompt_ids(model, prefill)
    greedy = Sampling(ignore_eos=True)
    engine = model.engine(slots=max(streams, 1), context=prefill + decode + 8, rows=512, prefix_caching=False)
    engine.generate([Request(ids[:16], 4, greedy)])  # warm-up
    # prefill: a 512-token prompt, one token out
    t = time.perf_counter()
    engine.generate([Request(ids, 1, greedy)])
    prefill_tps = prefill / (time.perf_counter() - t)
    # decode at batch 1: time between the first and the last token
    rid = engine.add(Request(ids[:32], decode, greedy))
    first = last = None
    n = 0
    while engine.busy():
        for p in engine.advance():
            if p.id == rid and p.tokens:
                n += len(p.tokens)
                now = time.perf_counter()
                first = first or now
                last = now
    decode_tps = (n - 1) / (last - first)
    # 16 streams: aggregate output tokens over wall time (prefill of short prompts included)
    reqs = [Request(ids[i : i + 24], decode, greedy) for i in range(streams)]
    t = time.perf_counter()
    engine.generate(reqs)
    agg_tps = streams * decode / (time.perf_counter() - t)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_s, "prefill": prefill_tps, "decode": decode_tps, "streams": agg_tps, "rss_mb": rss}


def bench_llama_cpp(path: str, threads: int, prefill: int, decode: int) -> dict[str, float]:
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prefill + decode + 64,
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    ids = llm.tokenize((Path(__file__).read_text() * 8).encode(), add_bos=False)[:prefill]
    llm.eval(ids[:16])  # warm-up
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_tps = prefill / (time.perf_counter() - t)
    llm.reset()
    llm.eval(ids[:32])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(decode - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_tps = (decode - 1) / (time.perf_counter() - t)
    return {"load_s": load_s, "prefill": prefill_tps, "decode": decode_tps}


def bench_transformers(path: str, prefill: int, decode: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ids = tok((Path(__file__).read_text() * 8), add_special_tokens=False)["input_ids"][:prefill]
    with torch.inference_mode():
        t = time.perf_counter()
        hf(torch.tensor([ids]))
        prefill_tps = prefill / (time.perf_counter() - t)
        out = hf(torch.tensor([ids[:32]]), use_cache=True)
        t = time.perf_counter()
        for _ in range(decode - 1):
            nxt = out.logits[:, -1:].argmax(-1)
            out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
        decode_tps = (decode - 1) / (time.perf_counter() - t)
    return {"prefill": prefill_tps, "decode": decode_tps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default=None, help="default: the model's own load (GGUF blocks as they are)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--peer", action="append", default=[], choices=["llama.cpp", "transformers"])
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    path = str(superslm.model.resolve_path(ns.model))
    rows = {"superslm": bench_superslm(path, ns.dtype, ns.prefill, ns.decode, ns.streams)}
    if "llama.cpp" in ns.peer:
        rows["llama.cpp"] = bench_llama_cpp(path, ns.threads, ns.prefill, ns.decode)
    if "transformers" in ns.peer:
        rows["transformers"] = bench_transformers(path, ns.prefill, ns.decode)
    print(f"model {Path(path).name}  threads {ns.threads}  {platform.processor() or platform.machine()}  "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'engine':14} {'prefill tok/s':>14} {'decode tok/s':>13} {'16-stream tok/s':>16} {'load s':>7}")
    for name, r in rows.items():
        print(f"{name:14} {r['prefill']:14.1f} {r['decode']:13.1f} {r.get('streams', float('nan')):16.1f} "
              f"{r.get('load_s', float('nan')):7.2f}")
    if "llama.cpp" in rows:
        ours, peer = rows["superslm"], rows["llama.cpp"]
        print(f"ratios vs llama.cpp: prefill {ours['prefill'] / peer['prefill']:.2f}x, decode "
              f"{ours['decode'] / peer['decode']:.2f}x, 16 streams vs its single stream "
              f"{ours['streams'] / peer['decode']:.2f}x; peak RSS {ours['rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
