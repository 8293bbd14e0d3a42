"""GPU benchmark: SuperSLM beside transformers on the same random-weight model, in one run.

    python benchmarks/gpu.py [--models qwen2.5-0.5b,qwen2.5-1.5b,qwen3-0.6b] [--workloads decode1,batch64,
        batch256,nano] [--device cuda] [--dtype bf16] [--quick] [--no-int4] [--no-peer]
    python benchmarks/gpu.py --device cpu --tiny    # shrunk configs and workloads: proves it runs end to end

Each model is its real config.json with random weights, built by transformers on the device itself
(torch.manual_seed(0)) and saved once to a scratch folder for superslm.load, beside a WordLevel tokenizer of
the full vocabulary: both engines are fed token ids. All runs are greedy to max_tokens (superslm:
Sampling(ignore_eos=True); transformers: no eos, min_new_tokens = max_new_tokens).
  decode1   batch 1, a 128-token prompt, 256 new tokens (also int4, where quant="int4" runs on the device)
  batch64   64 sequences, 128-token prompts, 256 new tokens each;  batch256: 256 of them
  nano      nano-vllm's bench.py: 256 sequences, random.seed(0), prompts of randint(100, 1024) ids
            randint(0, 10000), then max_tokens randint(100, 1024) each (greedy here, temperature 0.6 there);
            transformers runs it as one left-padded batch to the longest output, only requested tokens count
transformers generates the first --peer-steps tokens (default 128) of each run and its rates are projected to the
whole output from its prefill and mean step time (a fixed batch's steps cost about the same; later ones a little
more, so the projection flatters it): the whole benchmark then fits 5 minutes. --peer-steps 0 runs every step.
decode tok/s: tokens made after every sequence has its first one, over that time; e2e tok/s: all requested
tokens over the whole wall time (nano-vllm's number); weight GB/s: the bytes of weights a decode step reads
(linears, head, norms) times steps per second, beside a 1 GiB device-to-device copy (read + write bytes).
--quick: decode1 128 tokens, batch runs 64 tokens, nano on its first 64 sequences. --tiny: 2 layers, hidden 64,
vocab 512; decode1 16+16, batches of 2 and 8 (8+8), nano on 8 sequences of 4..16 tokens; targets not checked.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import superslm
from superslm import Request, Sampling

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import (  # noqa: E402  (the script's sibling: models and workloads)
    CONFIGS,
    WORKLOADS,
    Workload,
    build_hf,
    make_config,
    make_workloads,
    scratch_dir,
    weight_bytes,
    write_folder,
)

#: the GPU targets: (model, precision, workload, tok/s, which rate); nano on every model run
TARGETS = [("qwen2.5-0.5b", "bf16", "decode1", 1500.0, "decode"), ("qwen2.5-0.5b", "int4", "decode1", 2500.0, "decode"),
           (None, "bf16", "nano", 40000.0, "e2e")]
TIME_TARGET_S = 300.0


@dataclass
class Run:
    """One engine on one workload: useful output tokens, rates, and (optionally) the tokens themselves."""

    tokens: int
    wall_s: float
    decode_tps: float
    e2e_tps: float
    outputs: list[list[int]] = field(default_factory=list)
    #: seconds spent capturing decode graphs before the run (not in wall_s)
    capture_s: float = 0.0
    #: the peer ran only this many steps and its rates are projected to the whole workload (0: measured whole)
    projected_from: int = 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    # hand a finished run's KV cache back before the next one sizes its own (a collection: ~0.2 s)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def copy_speed(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy speed in bytes/s, counting the bytes read and the bytes written."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = a.clone()  # also the warm-up
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t)


def rates(events: list[tuple[float, int]], t_all: float, t0: float, t_end: float, tokens: int) -> tuple[float, float]:
    """(decode tok/s, e2e tok/s) from (time, new tokens) events; t_all: every sequence has its first token."""
    after = sum(n for t, n in events if t > t_all)
    span = events[-1][0] - t_all
    decode = after / span if span > 0 and after else float("nan")
    return decode, tokens / (t_end - t0)


def run_superslm(model: superslm.Model, wl: Workload, rows: int, graphs: bool | None = None,
                 overlap: bool | None = None) -> Run:
    """The workload through the public engine API: add every request, advance until done. Decode graphs
    (default: on a CUDA device) are captured for every batch bucket before the clock starts."""
    device, n = model.device, len(wl.prompts)
    context = max(len(p) + o for p, o in zip(wl.prompts, wl.outputs, strict=True)) + 1
    engine = model.engine(slots=n, context=context, rows=max(rows, n), prefix_caching=False, graphs=graphs,
                          overlap=overlap)
    capture_s = engine.warm_up_graphs()
    if engine.graphs is not None and engine.graphs.capture_error:
        print(f"  superslm decode graphs run eagerly: {engine.graphs.capture_error}", flush=True)
    greedy = Sampling(ignore_eos=True)
    engine.generate([Request(p[:4], 2, greedy) for p in wl.prompts])  # warm-up at this batch size (JIT)
    sync(device)
    t0 = time.perf_counter()
    index = {engine.add(Request(p, o, greedy)): i for i, (p, o) in enumerate(zip(wl.prompts, wl.outputs, strict=True))}
    outputs: list[list[int]] = [[] for _ in range(n)]
    events: list[tuple[float, int]] = []
    started, t_all = 0, None
    while engine.busy():
        progress = engine.advance()  # tokens come back on the host: the step is finished
        now, new = time.perf_counter(), 0
        for p in progress:
            i = index.get(p.id)
            if i is None or not p.tokens:
                continue
            started += not outputs[i]
            outputs[i] += p.tokens
            new += len(p.tokens)
        if new:
            events.append((now, new))
        if t_all is None and started == n:
            t_all = now
    sync(device)
    t_end = time.perf_counter()
    short = [i for i in range(n) if len(outputs[i]) != wl.outputs[i]]
    if short or t_all is None:
        raise RuntimeError(f"superslm stopped early on {len(short)} of {n} sequences (ignore_eos should prevent it)")
    tokens = sum(wl.outputs)
    return Run(tokens, t_end - t0, *rates(events, t_all, t0, t_end, tokens), outputs, capture_s)


class Clock(BaseStreamer):
    """Stamps each put: transformers' generate puts the prompt, then each step's tokens (on the host)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(hf: Any, wl: Workload, steps: int = 0) -> Run:
    """The workload as one transformers generate call (left-padded to the longest prompt, greedy, to the
    longest output); a streamer stamps each step's tokens. With `steps` (>= 2) it generates only that many and
    projects the rest: a fixed batch's decode steps each cost about the same (later ones a little more, at a
    longer context, so the projection flatters the peer)."""
    device, n, pad = hf.device, len(wl.prompts), 0
    width, new = max(len(p) for p in wl.prompts), max(wl.outputs)
    run = min(new, max(steps, 2)) if steps else new
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(wl.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=False, pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(input_ids=ids[:, -4:], attention_mask=mask[:, -4:], max_new_tokens=2, min_new_tokens=2, **kw)
        clock = Clock()
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=run, min_new_tokens=run,
                          streamer=clock, **kw)
        sync(device)
        t_end = time.perf_counter()
    gen, times = out[:, width:].tolist(), clock.times[1:]  # the first put is the prompt
    if len(gen[0]) != run or len(times) != run:
        raise RuntimeError(f"transformers made {len(gen[0])} tokens, not {run}")
    tokens = sum(wl.outputs)
    outputs = [g[:o] for g, o in zip(gen, wl.outputs, strict=True)]
    if run == new:
        events = [(t, sum(o > s for o in wl.outputs)) for s, t in enumerate(times)]
        return Run(tokens, t_end - t0, *rates(events, times[0], t0, t_end, tokens), outputs)
    return Run(tokens, *project(times, t0, t_end, n, tokens, new), outputs, projected_from=run)


def project(times: list[float], t0: float, t_end: float, n: int, tokens: int, new: int) -> tuple[float, float, float]:
    """(wall s, decode tok/s, e2e tok/s) of a fixed batch of n sequences generating `new` steps (`tokens` of them
    requested), from the step stamps `times` of its first len(times) >= 2 steps, started at t0 and ended at t_end:
    each later step costs the mean step so far. For len(times) == new it is what `rates` measures."""
    step = (times[-1] - times[0]) / (len(times) - 1)
    decode_s = (new - 1) * step  # from every sequence's first token to the longest output's last
    wall = (times[0] - t0) + decode_s + (t_end - times[-1])
    return wall, (tokens - n) / decode_s, tokens / wall


def load_int4(folder: str, device: torch.device) -> tuple[superslm.Model | None, str]:
    """The model with quant="int4", or None and why it does not run on this device: one int4 linear is tried
    there first (cheaper than quantizing the whole model to find out)."""
    from superslm.quant import Int4Linear

    try:
        w = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
        y = Int4Linear.from_dense(w).to(device)(torch.randn(1, 128, device=device, dtype=torch.bfloat16))
        if y.device.type != device.type:
            return None, f"Int4Linear returned its output on {y.device}"
        return superslm.load(folder, device=device, quant="int4"), ""
    except Exception as e:  # any failure is the answer: report it, do not crash the benchmark
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"quant='int4' does not run on {device.type}: {type(e).__name__}: {first[:100]}"


def greedy_tokens(name: str, workloads: tuple[str, ...] = ("decode1",), device: str = "cpu", dtype: str = "fp32"
                  ) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """{workload: (superslm's, transformers' greedy tokens, one list per sequence)} for --tiny workloads of
    one model (what tests/test_gpu_benchmark.py compares)."""
    dev = torch.device(device)
    dt = superslm.model.pick_dtype(dtype, dev)
    config = make_config(name, tiny=True)
    hf = build_hf(config, dev, dt, tiny=True)
    with tempfile.TemporaryDirectory() as folder:
        write_folder(hf, Path(folder))
        ours = superslm.load(folder, device=dev, dtype=dt, quant=None)
        return {wl.key: (run_superslm(ours, wl, rows=64).outputs, run_transformers(hf, wl).outputs)
                for wl in make_workloads(list(workloads), config.vocab_size, tiny=True, quick=False)}


def bench_model(name: str, ns: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Every chosen workload on one model: SuperSLM (and its int4 variant at batch 1), then transformers."""
    dt = superslm.model.pick_dtype(ns.dtype, device)
    precision = str(dt).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
    config = make_config(name, ns.tiny)
    hf = build_hf(config, device, dt, ns.tiny)
    workloads = make_workloads(ns.workloads, config.vocab_size, ns.tiny, ns.quick)
    rows = 64 if ns.tiny else 8192
    nbytes = sum(p.nbytes for p in hf.parameters())
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=scratch_dir(nbytes)) as folder:
        write_folder(hf, Path(folder))
        ours = superslm.load(folder, device=device, dtype=dt, quant=None)
        variants: list[tuple[str, superslm.Model | None, str]] = [(precision, ours, "")]
        if not ns.no_int4 and "decode1" in ns.workloads:
            variants.append(("int4", *load_int4(folder, device)))
        wbytes = {p: weight_bytes(m.net) for p, m, _ in variants if m is not None}
        for wl in workloads:
            for prec, model, why in variants:
                if prec == "int4" and wl.key != "decode1":
                    continue
                row = dict(model=name, workload=wl.key, label=wl.label, precision=prec, seqs=len(wl.prompts),
                           note=why, weight_bytes=wbytes.get(prec, 0))
                if model is not None:
                    row["superslm"] = run_superslm(model, wl, rows, graphs=False if ns.no_graphs else None,
                                                   overlap=False if ns.no_overlap or ns.no_graphs else None)
                    free(device)
                if prec == precision and not ns.no_peer:
                    row["transformers"] = run_transformers(hf, wl, ns.peer_steps)
                    free(device)
                out.append(row)
        del ours, variants
    del hf
    free(device)
    return out


def bandwidth(row: dict[str, Any], run: Run, copy_bps: float) -> str:
    """Weight GB/s (% of the copy speed) of a fixed-batch decode row; "-" where the batch varies (nano)."""
    if row["workload"] == "nano" or not row["weight_bytes"] or math.isnan(run.decode_tps):
        return "-"
    bps = row["weight_bytes"] * run.decode_tps / row["seqs"]
    return f"{bps / 1e9:,.1f} ({100 * bps / copy_bps:.0f}%)"


def report(results: list[dict[str, Any]], copy_bps: float, tiny: bool, quick: bool) -> None:
    """One table per model, markdown rows for docs/benchmarks.md, and the acceptance targets."""
    head = (f"{'workload':22} {'engine':13} {'seqs':>5} {'out tok':>8} {'decode tok/s':>13} {'e2e tok/s':>11} "
            f"{'wall s':>8}  weight GB/s (% copy)")
    md = ["| model | workload | precision | superslm decode tok/s | transformers decode tok/s | ratio "
          "| superslm e2e tok/s | transformers e2e tok/s | ratio | weight GB/s (% of copy) |",
          "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == name]
        wb = {r["precision"]: r["weight_bytes"] for r in rows if r["weight_bytes"]}
        print(f"\nmodel {name}  weights read per decode step: "
              + ", ".join(f"{b / 1e6:,.1f} MB ({p})" for p, b in wb.items()))
        print(head)
        for r in rows:
            label, a, b = f"{r['label']} {r['precision']}", r.get("superslm"), r.get("transformers")
            if a is None:
                print(f"{label:22} {'superslm':13} n/a: {r['note']}")
                md.append(f"| {name} | {r['label']} | {r['precision']} | n/a ({r['note']}) | | | | | | |")
                continue
            for engine, run in (("superslm", a), ("transformers", b)):
                if run is not None:
                    print(f"{label:22} {engine:13} {r['seqs']:5d} {run.tokens:8d} {run.decode_tps:13.1f} "
                          f"{run.e2e_tps:11.1f} {run.wall_s:8.3f}  {bandwidth(r, run, copy_bps)}")
                    if run.capture_s:
                        print(f"{'':22} {'':13} decode graphs captured in {run.capture_s:.2f} s, before the clock")
                    if run.projected_from:
                        print(f"{'':22} {'':13} projected from its first {run.projected_from} steps (--peer-steps)")
            dec = f"{a.decode_tps / b.decode_tps:.2f}x" if b else "-"
            e2e = f"{a.e2e_tps / b.e2e_tps:.2f}x" if b else "-"
            if b:
                print(f"{label:22} {'ratio':13} {'':5} {'':8} {dec:>13} {e2e:>11}")
            star = "*" if b and b.projected_from else ""  # projected from the peer's first steps
            bd, be = (f"{b.decode_tps:,.0f}{star}", f"{b.e2e_tps:,.0f}{star}") if b else ("-", "-")
            md.append(f"| {name} | {r['label']} | {r['precision']} | {a.decode_tps:,.0f} | {bd} | {dec} "
                      f"| {a.e2e_tps:,.0f} | {be} | {e2e} | {bandwidth(r, a, copy_bps)} |")
    print("\nmarkdown rows for docs/benchmarks.md:")
    print("\n".join(md))
    steps = {r["transformers"].projected_from for r in results if r.get("transformers")} - {0}
    if steps:
        print(f"\n\\* transformers' rates projected from its first {', '.join(map(str, sorted(steps)))} steps "
              "(--peer-steps; 0 runs every step)")
    note = ": tiny configs, the targets do not apply" if tiny else (
        " (--quick: shortened workloads; the targets are for the full ones)" if quick else "")
    print("\nGPU targets" + note)
    for model, prec, key, need, which in [] if tiny else TARGETS:
        for r in results:
            if r["workload"] == key and r["precision"] == prec and model in (None, r["model"]):
                run = r.get("superslm")
                got = "n/a: " + r["note"] if run is None else f"{getattr(run, which + '_tps'):,.0f} tok/s"
                verdict = "" if run is None else ("PASS" if getattr(run, which + "_tps") >= need else "FAIL")
                print(f"  {r['model']} {prec} {r['label']} {which} >= {need:,.0f} tok/s: {got} {verdict}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=lambda s: s.split(","), default=list(CONFIGS))
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quick", action="store_true", help="shorter outputs, nano-vllm on 64 sequences")
    ap.add_argument("--tiny", action="store_true", help="shrunk configs and workloads (runs on a CPU in seconds)")
    ap.add_argument("--no-int4", action="store_true", help="skip the int4 batch-1 decode")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--peer-steps", type=int, default=128,
                    help="transformers generates this many tokens a run and its rates are projected to the whole "
                         "output (its steps cost about the same; default 128: the full run fits 5 minutes); 0: all")
    ap.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs (to measure what they give)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="accept each decode step before launching the next (to measure what overlap gives)")
    ns = ap.parse_args(argv)
    for given, known in ((ns.models, CONFIGS), (ns.workloads, WORKLOADS)):
        if set(given) - set(known):
            raise SystemExit(f"unknown: {sorted(set(given) - set(known))} (known: {', '.join(known)})")
    if ns.peer_steps and ns.peer_steps < 2:
        raise SystemExit("--peer-steps must be 0 (every step) or at least 2")
    device = torch.device(ns.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu --tiny to check the script")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # as tensors report it: cuda:0
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    copy_bps = copy_speed(device, (64 if ns.tiny else 1024) << 20)
    print(f"superslm {superslm.__version__}  transformers {transformers.__version__}  torch {torch.__version__}  "
          f"device {device} ({gpu})  dtype {ns.dtype}  {time.strftime('%Y-%m-%d')}" + ("  TINY" if ns.tiny else ""))
    print(f"copy speed ({'64 MiB' if ns.tiny else '1 GiB'} device to device, read + write): {copy_bps / 1e9:,.1f} GB/s")
    results: list[dict[str, Any]] = []
    for name in ns.models:
        t = time.perf_counter()
        results += bench_model(name, ns, device)
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
    report(results, copy_bps, ns.tiny, ns.quick)
    total = time.perf_counter() - start
    print(f"\ntotal {total:.1f} s" + ("" if ns.tiny else f" (target: under {TIME_TARGET_S:.0f} s on an H200)"))
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
