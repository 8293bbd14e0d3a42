"""Runtime linear formats: kernel timings on SmolLM2-135M's shapes, whole-model decode, and errors.

    python benchmarks/linear_formats.py [--sections kernels,decode,errors,prompt] [--threads 2] [--tokens 64]

Prints markdown tables (the numbers in docs/quantization.md). Kernel timings are the best of repeated
runs; on a shared machine read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import superslm
from superslm import hub
from superslm.cache.kv import KVCache
from superslm.engine import Request
from superslm.kernels.attention import AttnMetadata
from superslm.quant import FORMATS, Int4Linear, quantize_from_source, quantize_linears
from superslm.sampling import Sampling

#: SmolLM2-135M's linears: name, in, out
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("head", 576, 49152)]
KERNEL_FORMATS: list[tuple[str, str | None, dict]] = [
    ("fp32", None, {}), ("bf16", "bf16", {}), ("int8", "int8", {}), ("int4 g32", "int4", {"group": 32}),
    ("int4 g128", "int4", {"group": 128}), ("int4 g128 rot", "int4", {"group": 128, "rotate": 0}),
]  # fmt: skip


def best_time(fn: Callable[[], object], repeats: int = 9, min_time: float = 0.03) -> float:
    """Seconds per call: the best of `repeats` runs of enough calls to last `min_time` (on a shared
    machine the minimum is the run least disturbed by other processes)."""
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / one))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n)
    return statistics.median(runs)


def bench_kernels() -> None:
    print("### Kernels: microseconds per call (best of 9), SmolLM2-135M shapes\n")
    cols = [f"{label} M={m}" for label, _, _ in KERNEL_FORMATS for m in (1, 16)]
    print("| linear (in -> out) | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        row = []
        for _, fmt, opts in KERNEL_FORMATS:
            module = (lambda x, w=w: F.linear(x, w)) if fmt is None else FORMATS[fmt].from_dense(w, **opts)
            for m in (1, 16):
                x = torch.randn(m, k, dtype=torch.float32 if fmt is None else torch.bfloat16)
                with torch.no_grad():
                    row.append(best_time(lambda module=module, x=x: module(x)) * 1e6)
        print(f"| {name} ({k} -> {n}) | " + " | ".join(f"{t:.0f}" for t in row) + " |")
    print()


#: prompt-chunk shapes (in, out) of SmolLM2-135M, Gemma-3-270M, Qwen3.5-0.8B (attention qkv with its gate,
#: delta-rule in_proj, MLP) and Qwen2.5-1.5B (MLP)
PROMPT_SHAPES = [
    ("smollm2 qkv", 576, 960), ("smollm2 gate_up", 576, 3072), ("smollm2 down", 1536, 576),
    ("gemma3 gate_up", 640, 4096), ("gemma3 down", 2048, 640), ("qwen3.5 qkv+gate", 1024, 5120),
    ("qwen3.5 in_proj", 1024, 8224), ("qwen3.5 gate_up", 1024, 7168), ("qwen3.5 down", 3584, 1024),
    ("qwen2.5-1.5b gate_up", 1536, 17920), ("qwen2.5-1.5b down", 8960, 1536),
]  # fmt: skip


def bench_prompt() -> None:
    """Prompt rows of int4 and int8 linears: torch's packed kernels against kernels/cpu_prompt.py's decoded
    blocks and float32 GEMMs (the path the default mode takes from PROMPT_ROWS rows) and, for int4, the AVX2 int4
    row kernel it takes there where the kernel runs (cpu_prompt.INT4_ROWS), interleaved."""
    from superslm.kernels import cpu_prompt

    rows = (16, 64, 128, 512)
    print("### Prompt rows: milliseconds per call (median of 5), torch's kernel / decoded blocks + sgemm "
          "[/ int4 row kernel]\n")
    print(f"load average {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads\n")
    print("| linear (in -> out) | format | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---" * (len(rows) + 2) + "|")
    saved = cpu_prompt.PROMPT_ROWS, cpu_prompt.INT4_ROWS
    try:
        for name, k, n in PROMPT_SHAPES:
            w = torch.randn(n, k) * 0.02
            for fmt, opts in (("int4", {"group": 32}), ("int8", {})):
                module = FORMATS[fmt].from_dense(w, **opts)
                cells = []
                for m in rows:
                    x = torch.randn(m, k, dtype=torch.bfloat16)
                    with torch.no_grad():
                        cpu_prompt.PROMPT_ROWS = 1
                        cpu_prompt.INT4_ROWS = False
                        if cpu_prompt.prompt_linear(module, x) is None:
                            print(f"(the path does not run here: {fmt})")
                            return
                        times = [best_time(lambda module=module, x=x: module(x), repeats=5),
                                 best_time(lambda module=module, x=x: cpu_prompt.prompt_linear(module, x), repeats=5)]
                        if fmt == "int4":
                            cpu_prompt.INT4_ROWS = True
                            times.append(best_time(lambda module=module, x=x: cpu_prompt.prompt_linear(module, x),
                                                   repeats=5))
                    cells.append(" / ".join(f"{t * 1e3:.1f}" for t in times))
                print(f"| {name} ({k} -> {n}) | {fmt} | " + " | ".join(cells) + " |")
    finally:
        cpu_prompt.PROMPT_ROWS, cpu_prompt.INT4_ROWS = saved
    print()


def smollm2() -> Path:
    return hub.fetch("smollm2-135m-instruct", progress=False)


#: whole-model variants: label, load dtype, how to swap the linears
VARIANTS: list[tuple[str, str, Callable[[superslm.Model], object] | None]] = [
    ("fp32 dense", "fp32", None),
    ("bf16 dense", "bf16", None),
    ("gguf native (Q4_1 as is), int8 head", "bf16", lambda m: quantize_from_source(m.net, m.source)),
    ("int8, int8 head", "bf16", lambda m: quantize_linears(m.net, "int8", "int8", rotate=False)),
    ("int4 g32, int8 head", "bf16", lambda m: quantize_linears(m.net, "int4", "int8", group=32, rotate=False)),
    ("int4 g128, int8 head", "bf16", lambda m: quantize_linears(m.net, "int4", "int8", group=128, rotate=False)),
    ("int4 g128 rotated, int8 head rotated", "bf16", lambda m: quantize_linears(m.net, "int4", "int8", group=128)),
]


def prefill_logits(net: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    a, n, ps = net.arch, len(tokens), 16
    pages = (n + ps - 1) // ps
    kv = KVCache(len(net.layers), pages, ps, a.kv_heads, a.head_dim, net.dtype)
    meta = AttnMetadata.one_prompt(n, ps)
    with torch.no_grad():
        return net.logits(net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v)).float()


def decode_tok_s(model: superslm.Model, prompt: str, tokens: int) -> float:
    """Decode tokens per second at batch 1: the steps after the first (prefill) one."""
    engine = model.engine(slots=1, context=512)
    engine.add(Request(prompt, max_tokens=tokens, sampling=Sampling(ignore_eos=True)))
    got = sum(len(p.tokens) for p in engine.advance())
    t0 = time.perf_counter()
    decoded = 0
    while decoded + got < tokens:
        decoded += sum(len(p.tokens) for p in engine.advance())
    return decoded / (time.perf_counter() - t0)


def bench_decode(tokens: int) -> None:
    path = smollm2()
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ref_model = superslm.load(path)
    ids = ref_model.tokenizer.encode(text)[:256]
    ref = prefill_logits(ref_model.net, ids)
    target = torch.tensor(ids[1:])
    del ref_model
    print(f"### SmolLM2-135M-Instruct Q4_1: decode at batch 1 ({tokens} tokens) and closeness to fp32\n")
    print("Perplexity and logits over the first 256 tokens of Python's LICENSE.txt; `rel`: relative")
    print("Frobenius error of the logits against the fp32 model; `top-1`: argmax agreement.\n")
    print("| body format | build s | decode tok/s | perplexity | rel | top-1 | greedy: The capital of France is |")
    print("|---|---|---|---|---|---|---|")
    for label, dtype, swap in VARIANTS:
        model = superslm.load(path, dtype=dtype)
        t0 = time.perf_counter()
        if swap is not None:
            swap(model)
        build = time.perf_counter() - t0
        logits = prefill_logits(model.net, ids)
        ppl = math.exp(F.cross_entropy(logits[:-1], target).item())
        rel = float((logits - ref).norm() / ref.norm())
        top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        speed = decode_tok_s(model, "Once upon a time", tokens)
        text = model.engine(slots=1, context=128).complete("The capital of France is", 8).strip().replace("\n", " ")
        print(f"| {label} | {build:.1f} | {speed:.1f} | {ppl:.2f} | {rel:.3f} | {top1:.3f} | {text} |")
    print()


def rel_err(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    ref = x @ w.t()
    return float((x @ q.t() - ref).norm() / ref.norm())


ERR_CASES = [("int4 g128", "int4", {"group": 128}), ("int4 g32", "int4", {"group": 32}), ("int8", "int8", {})]


def error_row(label: str, x: torch.Tensor, weights: list[torch.Tensor], xs: list[torch.Tensor] | None = None) -> str:
    cells = []
    for _, fmt, opts in ERR_CASES:
        for rotate in (None, 0):
            errs = []
            for i, w in enumerate(weights):
                xi = x if xs is None else xs[i]
                q = FORMATS[fmt].from_dense(w, **opts, **({} if rotate is None else {"rotate": rotate}))
                errs.append(rel_err(xi, w, q.dequantize()))
            cells.append(f"{sum(errs) / len(errs):.4f}")
    return f"| {label} | " + " | ".join(cells) + " |"


def bench_errors() -> None:
    print("### Rotation: relative Frobenius error of W x, without / with the Hadamard rotation\n")
    head = " | ".join(f"{label} {r}" for label, _, _ in ERR_CASES for r in ("plain", "rotated"))
    print(f"| weights, activations | {head} |")
    print("|---" * (2 * len(ERR_CASES) + 1) + "|")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g)
    x = torch.randn(256, 1024, generator=g)
    print(error_row("Gaussian 1024x1024, Gaussian x", x, [w]))
    wo = w.clone()
    wo[:, torch.randperm(1024, generator=g)[:8]] *= 20
    print(error_row("Gaussian, 8 input channels x20, Gaussian x", x, [wo]))
    # SmolLM2: its linears with the activations they see on real text (captured by hooks)
    model = superslm.load(smollm2())
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = model.tokenizer.encode(text)[:128]
    acts: dict[str, torch.Tensor] = {}
    hooks = []
    for i in (0, 10, 20, 29):
        for name in ("qkv", "o", "gate_up", "down"):
            key = f"{i}.{name}"
            hooks.append(getattr(model.net.layers[i], name).register_forward_pre_hook(
                lambda mod, inp, key=key: acts.__setitem__(key, inp[0].detach().float())))  # fmt: skip
    hooks.append(model.net.head.register_forward_pre_hook(lambda mod, inp: acts.__setitem__("head", inp[0].float())))
    prefill_logits(model.net, ids)
    for h in hooks:
        h.remove()
    for name in ("qkv", "o", "gate_up", "down"):
        keys = [k for k in acts if k.endswith("." + name)]
        ws = [getattr(model.net.layers[int(k.split(".")[0])], name).weight.float() for k in keys]
        print(error_row(f"SmolLM2 {name} (Q4_1), layers 0/10/20/29, real x", x, ws, [acts[k] for k in keys]))
    hw = model.net.head.weight.float()[:8192]
    print(error_row("SmolLM2 head rows 0-8191 (Q8_0), real x", x, [hw], [acts["head"]]))
    print()
    # the range search: lower weight MSE, but worse on real activations when not rotated
    print("int4 g128 with the range search (`search=True`) on the head rows above, plain / rotated: ", end="")
    cells = []
    for rotate in (None, 0):
        q = Int4Linear.from_dense(hw, group=128, rotate=rotate, search=True)
        cells.append(f"{rel_err(acts['head'], hw, q.dequantize()):.4f}")
    print(" / ".join(cells) + "\n")
    bench_mapping()


def bench_mapping() -> None:
    """Gemma-3-270M's non-int4 blocks re-quantized: the error against the block's own values."""
    from superslm.models.loader import canonical_names, open_source

    src = open_source(hub.fetch("gemma-3-270m", progress=False))
    by_kind: dict[str, list[torch.Tensor]] = {}
    for key, stored in canonical_names(src).items():
        if key != "embed" and stored.kind in ("Q5_0", "Q6_K", "Q8_0"):
            lst = by_kind.setdefault(stored.kind, [])
            if len(lst) < 4:
                lst.append(src.gguf.dequantize(stored.name))
    print("### Gemma-3-270M blocks re-quantized: relative error of W x (Gaussian x) against the block's values\n")
    head = " | ".join(f"{label} {r}" for label, _, _ in ERR_CASES for r in ("plain", "rotated"))
    print(f"| block type | {head} |")
    print("|---" * (2 * len(ERR_CASES) + 1) + "|")
    g = torch.Generator().manual_seed(1)
    for kind, ws in sorted(by_kind.items()):
        xs = [torch.randn(64, w.shape[1], generator=g) for w in ws]
        print(error_row(f"{kind} ({len(ws)} tensors)", xs[0], ws, xs))
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="kernels,decode,errors")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"torch {torch.__version__}, {args.threads} threads, {platform.machine()}, {os.cpu_count()} CPUs{load}, "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    sections = args.sections.split(",")
    if "kernels" in sections:
        bench_kernels()
    if "decode" in sections:
        bench_decode(args.tokens)
    if "errors" in sections:
        bench_errors()
    if "prompt" in sections:
        bench_prompt()


if __name__ == "__main__":
    main()
