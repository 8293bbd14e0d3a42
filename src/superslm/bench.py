"""`superslm bench`: SuperSLM beside llama-cpp-python and transformers on one model, in one run.

    superslm bench [--model PATH_OR_NAME] [--threads 2] [--peer llama.cpp] [--peer transformers]

Workloads: prefill tok/s of a 512-token prompt; decode tok/s at batch 1 (128 tokens, greedy, timed from
the first to the last token); aggregate output tok/s of 16 concurrent streams of 128 tokens (their short
prompts' prefill included); time to load; peak RSS. Each engine runs in a fresh child process so its
peak RSS and its warm caches are its own. Peers are optional (`pip install llama-cpp-python`;
transformers reads the GGUF with `gguf` installed). Ratios from one run mean something on a shared
machine; absolute figures less so.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from superslm.memory import freeze_heap

#: the prompt text: this file, repeated (fixed, ships with the package)
_TEXT = Path(__file__).read_text() * 8


def _prompt_text(prefill: int) -> str:
    """Enough of _TEXT for `prefill` tokens (~3.5 characters a token here, so 16 per token is ample):
    tokenizing all 84 KB to keep 512 tokens left ~18 MB of the tokenizer's buffers in the peak RSS."""
    return _TEXT[: 16 * prefill]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_decode(engine: Any, ids: list[int], decode: int) -> tuple[float, float]:
    """(decode tok/s, prefill s) of one greedy request of `decode` tokens (EOS ignored) on an idle engine: the
    prefill up to its first token, the decode from it to the last."""
    from superslm import Request, Sampling

    t0 = time.perf_counter()
    rid = engine.add(Request(ids, decode, Sampling(ignore_eos=True)))
    first = last = 0.0
    n = 0
    while engine.busy():
        for p in engine.advance():
            if p.id == rid and p.tokens:
                n += len(p.tokens)
                last = time.perf_counter()
                first = first or last
    if n != decode:
        raise RuntimeError(f"{n} tokens decoded, not {decode}")
    return (n - 1) / (last - first), first - t0


def bench_superslm(path: str, threads: int, prefill: int, decode: int, streams: int) -> dict[str, float]:
    """SuperSLM's figures (its default load of the model)."""

    import superslm
    from superslm import Request, Sampling

    superslm.set_threads(threads)
    t = time.perf_counter()
    model = superslm.load(path, device="cpu")
    load_s = time.perf_counter() - t
    ids = model.tokenizer.encode(_prompt_text(prefill), add_special_tokens=False)[:prefill]
    greedy = Sampling(ignore_eos=True)
    engine = model.engine(slots=max(streams, 1), context=prefill + decode + 8, rows=512, prefix_caching=False)
    engine.generate([Request(ids[:16], 4, greedy)])  # warm-up (and the C++ layers' first-use build)
    # as `superslm serve` and the CLI's commands do once their model is loaded; a library caller gets the same by
    # calling superslm.memory.freeze_heap() (3-8% of a small model's decode went to full collections)
    freeze_heap()
    t = time.perf_counter()
    engine.generate([Request(ids, 1, greedy)])
    prefill_tps = len(ids) / (time.perf_counter() - t)
    decode_tps = timed_decode(engine, ids[:32], decode)[0]
    reqs = [Request(ids[i : i + 24], decode, greedy) for i in range(streams)]
    t = time.perf_counter()
    engine.generate(reqs)
    agg = streams * decode / (time.perf_counter() - t)
    kv_mb = (engine.kv.k.numel() * engine.kv.k.element_size() * 2) / 2**20
    if engine.states is not None:  # a delta-rule model's recurrent states: one row a slot, like its KV pages
        kv_mb += sum(t.numel() * t.element_size() for t in (engine.states.conv, engine.states.ssm)) / 2**20
    return {"load_s": load_s, "prefill": prefill_tps, "decode": decode_tps, "streams": agg, "rss_mb": _rss_mb(),
            "kv_mb": kv_mb, "states": float(engine.states is not None)}


def bench_llama_cpp(path: str, threads: int, prefill: int, decode: int, streams: int) -> dict[str, float]:
    """llama-cpp-python's figures on the same GGUF (single stream: its Python API has no batch of sequences)."""
    import numpy as np
    from llama_cpp import Llama

    t = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prefill + decode + 64,
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    ids = llm.tokenize(_prompt_text(prefill).encode(), add_bos=False)[:prefill]
    llm.eval(ids[:16])  # warm-up
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_tps = len(ids) / (time.perf_counter() - t)
    llm.reset()
    llm.eval(ids[:32])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(decode - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_tps = (decode - 1) / (time.perf_counter() - t)
    return {"load_s": load_s, "prefill": prefill_tps, "decode": decode_tps, "rss_mb": _rss_mb()}


def bench_transformers(path: str, threads: int, prefill: int, decode: int, streams: int) -> dict[str, float]:
    """transformers' figures (fp32 eager, the GGUF dequantized by its own reader)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    p = Path(path)
    kw: dict[str, Any] = {"gguf_file": p.name} if p.is_file() else {}
    folder = str(p.parent) if p.is_file() else str(p)
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    load_s = time.perf_counter() - t
    ids = tok(_prompt_text(prefill), add_special_tokens=False)["input_ids"][:prefill]
    with torch.inference_mode():
        t = time.perf_counter()
        hf(torch.tensor([ids]))
        prefill_tps = len(ids) / (time.perf_counter() - t)
        out = hf(torch.tensor([ids[:32]]), use_cache=True)
        t = time.perf_counter()
        for _ in range(decode - 1):
            nxt = out.logits[:, -1:].argmax(-1)
            out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
        decode_tps = (decode - 1) / (time.perf_counter() - t)
    return {"load_s": load_s, "prefill": prefill_tps, "decode": decode_tps, "rss_mb": _rss_mb()}


ENGINES = {"superslm": bench_superslm, "llama.cpp": bench_llama_cpp, "transformers": bench_transformers}


def _child(bench: Any, args: tuple, out: Any) -> None:
    try:
        out.put(bench(*args))
    except BaseException as e:  # reported by the parent, which goes on with the other engines
        out.put({"error": f"{type(e).__name__}: {e}"})


def run_engine(name: str, *args: Any, timeout_s: float = 3600.0, bench: Any = None) -> dict[str, Any]:
    """One engine's figures, measured in a fresh process (spawned: no state shared with this one) by
    `bench` (a module-level function; default: the engine's in ENGINES). A child that dies without a
    result (a crash in a peer's native code, the OOM killer) or outlives `timeout_s` is an error row,
    never a wait for a result that cannot come."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(bench or ENGINES[name], args, q))
    proc.start()
    deadline = time.monotonic() + timeout_s
    res: dict[str, Any] | None = None
    try:
        while res is None:
            try:
                res = q.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    try:  # the result may have landed between the two looks
                        res = q.get(timeout=1.0)
                    except queue.Empty:
                        res = {"error": f"the {name} process ended without a result (exit code {proc.exitcode})"}
                elif time.monotonic() > deadline:
                    res = {"error": f"the {name} process gave no result within {timeout_s:g} s"}
                    proc.kill()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=30)
    return res


def table(model: str, threads: int, rows: dict[str, dict[str, Any]], streams: int = 16) -> str:
    """The printed report: one line per engine, then the ratios against each peer."""
    nan = float("nan")
    lines = [f"model {Path(model).name}  threads {threads}  {platform.machine()}  {time.strftime('%Y-%m-%d %H:%M')}"
             f"  load average {os.getloadavg()[0]:.1f}",
             f"{'engine':14} {'prefill tok/s':>14} {'decode tok/s':>13} {f'{streams}-stream tok/s':>16} {'load s':>7} "
             f"{'peak RSS MB':>12}"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:14} failed: {r['error']}")
            continue
        lines.append(f"{name:14} {r['prefill']:14.1f} {r['decode']:13.1f} {r.get('streams', nan):16.1f} "
                     f"{r['load_s']:7.2f} {r['rss_mb']:12.0f}")
    ours = rows.get("superslm", {})
    for peer, r in rows.items():
        if peer == "superslm" or "error" in r or "error" in ours or not ours:
            continue
        q = ratios(ours, r)
        lines.append(f"vs {peer}: prefill {q['prefill']:.2f}x, decode {q['decode']:.2f}x, "
                     f"{streams} streams vs its single stream {q['streams']:.2f}x")
    if ours and "error" not in ours:
        path = Path(model)
        # a converted folder: its files (the weights are memory-mapped as a GGUF's are)
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        size = sum(p.stat().st_size for p in files) / 2**20 if files else float("nan")
        kv = "KV and recurrent states" if ours.get("states") else "KV"
        lines.append(f"superslm peak RSS {ours['rss_mb']:.0f} MB = file {size:.0f} MB + {kv} {ours['kv_mb']:.0f} MB + "
                     f"{ours['rss_mb'] - size - ours['kv_mb']:.0f} MB")
    return "\n".join(lines)


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """Our figures over a peer's: prefill, decode, and our 16 streams over its single stream."""
    return {"prefill": ours["prefill"] / peer["prefill"], "decode": ours["decode"] / peer["decode"],
            "streams": ours["streams"] / peer["decode"]}


def summary(rounds: list[dict[str, dict[str, Any]]], streams: int = 16) -> str:
    """Median (min-max) of each ratio over rounds whose engines all ran: on a shared machine one peer
    figure can move by 20% between runs, so claims rest on the median of alternating rounds."""
    lines = []
    peers = [p for p in rounds[0] if p != "superslm"]
    for peer in peers:
        got = [ratios(r["superslm"], r[peer]) for r in rounds
               if "error" not in r.get("superslm", {"error": 1}) and "error" not in r.get(peer, {"error": 1})]
        if not got:
            continue
        parts = []
        labels = (("prefill", "prefill"), ("decode", "decode"), ("streams", f"{streams} streams vs its single stream"))
        for key, label in labels:
            v = [g[key] for g in got]
            parts.append(f"{label} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})")
        lines.append(f"median of {len(got)} rounds vs {peer}: " + ", ".join(parts))
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="prefill, decode and 16-stream speed, load time and peak RSS (with peers)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file, folder or known name (default: the default model)")
    p.add_argument("--threads", "-t", type=int, default=2, help="threads of every engine (default: 2)")
    p.add_argument("--prefill", type=int, default=512,
                   help="tokens of the prompt whose prefill is timed (default: 512)")
    p.add_argument("--decode", type=int, default=128, help="tokens decoded at batch 1 (default: 128)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams of --decode tokens (default: 16)")
    p.add_argument("--peer", action="append", default=[], choices=["llama.cpp", "transformers"],
                   help="an engine to run beside SuperSLM, in the same run (repeatable; default: none)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the engines in turn this many times and end with the median ratios (default: 1)")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from superslm.errors import InvalidArgument
    from superslm.hub import resolve_path

    rounds = ns.rounds
    for name, v in (("threads", ns.threads), ("prefill", ns.prefill), ("decode", ns.decode), ("streams", ns.streams),
                    ("rounds", rounds)):
        if v < 1 or (name == "decode" and v < 2):
            raise InvalidArgument(f"--{name} must be at least {2 if name == 'decode' else 1}, not {v}")
    path = str(resolve_path(ns.model))
    args = (path, ns.threads, ns.prefill, ns.decode, ns.streams)
    done = []
    for _ in range(rounds):
        rows = {name: run_engine(name, *args) for name in ["superslm", *dict.fromkeys(ns.peer)]}
        print(table(path, ns.threads, rows, ns.streams), flush=True)
        done.append(rows)
    if rounds > 1 and ns.peer:
        print(summary(done, ns.streams))
    return 1 if any("error" in r for rows in done for r in rows.values()) else 0
