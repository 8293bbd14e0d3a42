"""KV page formats: what int8 and 4-bit pages cost in quality and save in memory, against the model dtype's pages.

    python benchmarks/kv_quality.py [--models smollm2-135m-instruct,gemma-3-270m] [--tokens 20480]
                                    [--window 2048] [--steps 1000] [--threads 2]
                                    [--formats int8,k8v4,k4v4,k4v4-plain]

Per model (loaded as `superslm.load(name)` loads it: GGUF blocks as they are, bf16 activations) and KV format
("bf16" = the model's dtype on the CPU, what "auto" gives where the pages fit; "int8" = codes and a float32 scale
per token and kv head; "k8v4" / "k4v4" = int8 keys or 4-bit keys, 4-bit values: each head rotated by a Hadamard
transform, then 4-bit codes and a float32 scale; "k4v4-plain" = the same 4-bit rows without the rotation, a
measured comparison only, not a format users can name), each against bf16:
- perplexity on a fixed text: the text's first `--tokens` tokens (tokenized without special tokens) in windows
  of `--window` - 1 text tokens, each window a fresh sequence from position 0 that starts with the model's BOS
  where its tokenizer adds one (Gemma), so every text token is scored; the executor the engine would pick (SDPA
  prompt steps, the C++ plan where a sliding window cuts the chunk), every key and value read back from pages
  of that format; beside it the share of the text's positions whose argmax is the same under both formats;
- greedy top-1 agreement over `--steps` decode steps (one row a step through the C++ plan, as the engine's
  decode runs): the bf16 run decodes greedily from a 64-token prompt of the text; the int8 run is fed the same
  tokens (teacher forcing) and each step's argmax (the prediction that step's logits make) is compared with the
  bf16 run's; the step where an int8 run of its own (not forced) first leaves the bf16 tokens is printed too;
- memory: KV bytes per token (KVCache.page_bytes / page size) and how many sequences of each context fit in
  1 GiB of pages, per format (every layer keeps every token: sliding-window layers too).

The text: the docstrings of a fixed list of Python standard library modules and of their public members
(`inspect.getdoc`, members in sorted order), joined by blank lines; it comes with every Python, and its sha256
and the Python version are printed (another Python's docstrings give another text).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

import superslm
from superslm.cache import kv as kvmod
from superslm.cache.kv import KVCache
from superslm.kernels.attention import AttnMetadata

MODULES = ("argparse", "collections", "json", "functools", "itertools", "pathlib", "re", "subprocess", "typing",
           "dataclasses", "textwrap", "logging", "csv", "datetime", "decimal", "fractions", "statistics",
           "string", "shutil", "tempfile", "threading", "queue", "heapq", "bisect", "contextlib", "enum",
           "abc", "io", "os", "random", "math", "struct", "zipfile", "tarfile", "email.message", "http.client",
           "urllib.parse", "unittest.case", "difflib", "pprint", "inspect", "ast", "asyncio.tasks", "sqlite3",
           "socket", "selectors", "hashlib", "hmac", "base64", "codecs", "locale", "gettext", "calendar")
FORMATS = ("int8", "k8v4", "k4v4", "k4v4-plain")
#: the comparison that stores 4-bit rows without their rotation (not a user format)
PLAIN = "-plain"
CONTEXTS = (2048, 4096, 8192, 32768)
PAGE = 16


def stdlib_text() -> str:
    parts = []
    for name in MODULES:
        mod = importlib.import_module(name)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if obj is None or inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                continue
            d = inspect.getdoc(obj)
            if d and d not in parts[-1:]:
                parts.append(f"{attr}: {d}")
    return "\n\n".join(parts)


class Rows:
    """`with Rows(fmt) as name:` the KVCache format name of `fmt`; for a "-plain" comparison the 4-bit rows' rotation
    is off inside the block (cache/kv.py _ROTATE: the readers then take the rows as stored, unrotated)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    def __enter__(self) -> str:
        if self.fmt.endswith(PLAIN):
            kvmod._ROTATE = False
            return self.fmt[: -len(PLAIN)]
        return self.fmt

    def __exit__(self, *exc: object) -> None:
        kvmod._ROTATE = True


def perplexity(net: torch.nn.Module, tokens: list[int], window: int, fmt: str,
               bos: int | None) -> tuple[float, int, torch.Tensor]:
    """(perplexity, tokens scored, each scored position's argmax): windows of `window` rows, each `bos` (where
    not None) then the next text tokens, every text token scored once (a window's first text token from BOS
    alone; without a BOS a window's first token is its context and not scored)."""
    a = net.arch
    total, count, top = 0.0, 0, []
    step = window - (bos is not None)
    with torch.inference_mode():
        for start in range(0, len(tokens), step):
            ids = ([bos] if bos is not None else []) + tokens[start : start + step]
            n = len(ids)
            if n < 2:
                break
            kv = KVCache(net.kv_layers, -(-n // PAGE), PAGE, a.kv_heads, a.head_dim, net.dtype, kv=fmt)
            h = net.run_layers(net.embed(torch.tensor(ids)), AttnMetadata.one_prompt(n, PAGE), kv.k, kv.v)
            for c in range(0, n - 1, 256):  # the head a block of rows at a time ([rows, vocab] float32)
                logits = net.logits(h[c : min(c + 256, n - 1)]).float()
                target = torch.tensor(ids[c + 1 : min(c + 257, n)])
                total += F.cross_entropy(logits, target, reduction="sum").item()
                count += target.numel()
                top.append(logits.argmax(-1))
    return math.exp(total / count), count, torch.cat(top)


def decode(net: torch.nn.Module, prompt: list[int], steps: int, fmt: str,
           forced: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Each decode step's argmax: the prompt prefilled, its argmax fed as the first decode step's token, then
    `steps` one-row decode steps, each fed the previous step's argmax (or, teacher-forced, forced[i] at step i:
    `forced` is the reference run's answer, so each step gets the token the reference fed there). Returns
    ([the prompt's argmax, step 0's argmax, ..., step steps-1's], each step's top-1 minus top-2 logit)."""
    a = net.arch
    n = len(prompt) + steps + 1
    kv = KVCache(net.kv_layers, -(-n // PAGE), PAGE, a.kv_heads, a.head_dim, net.dtype, kv=fmt)
    table = (tuple(range(kv.num_pages)),)
    out: list[int] = []
    margins: list[float] = []
    with torch.inference_mode():
        p = len(prompt)
        h = net.run_layers(net.embed(torch.tensor(prompt)), AttnMetadata.one_prompt(p, PAGE), kv.k, kv.v)
        first = int(net.logits(h[-1:]).argmax())
        for i in range(steps):
            feed = (first if i == 0 else out[-1]) if forced is None else forced[i]
            meta = AttnMetadata(torch.tensor([p]), torch.tensor([p]), (0, 1), (p + 1,), table, PAGE)
            h = net.run_layers(net.embed(torch.tensor([feed])), meta, kv.k, kv.v)
            logits = net.logits(h)[0]
            top2 = logits.topk(2).values
            out.append(int(logits.argmax()))  # first index on ties, as the engine's greedy head
            margins.append(float(top2[0] - top2[1]))
            p += 1
    return [first, *out], margins


def near(differ: list[int], margin: list[float]) -> str:
    """The bf16 run's top-1 - top-2 logit margin at the steps where the other format's argmax differs (max, and
    the median over every step for scale): a disagreement at a near tie is rounding, not damage."""
    at = sorted(margin[i] for i in differ)
    every = sorted(margin)[len(margin) // 2]
    if not at:
        return f"- ({every:.2f})"
    return f"max {at[-1]:.3f}, median {at[len(at) // 2]:.3f} ({every:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m", help="known names or paths")
    ap.add_argument("--tokens", type=int, default=20480, help="text tokens scored per format (default 20480)")
    ap.add_argument("--window", type=int, default=2048, help="rows per perplexity window (default 2048)")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps compared (default 1000)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS), help="the formats compared with bf16")
    args = ap.parse_args()
    formats = args.formats.split(",")
    superslm.set_threads(args.threads)
    text = stdlib_text()
    print(f"text: docstrings of {len(MODULES)} stdlib modules, Python {platform.python_version()}, "
          f"{len(text)} chars, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}; torch {torch.__version__}, "
          f"{args.threads} threads, {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n", flush=True)
    quality, memory = [], []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model = superslm.load(name, device="cpu")
        net, a, tok = model.net, model.arch, model.tokenizer
        if model.dtype != torch.bfloat16:
            sys.exit(f"{name} loads as {model.dtype}: this comparison is bf16 pages (the CPU's 'auto') against the "
                     "quantized formats")
        bos = tok.bos_id if tok.add_bos else None
        tokens = tok.encode(text, add_special_tokens=False)
        if len(tokens) < args.tokens:
            sys.exit(f"the text has {len(tokens)} tokens for {name}, fewer than --tokens {args.tokens}")
        tokens = tokens[: args.tokens]
        base, scored, base_top = perplexity(net, tokens, args.window, "bf16", bos)
        prompt = ([bos] if bos is not None else []) + tokens[:64]
        ref, margin = decode(net, prompt, args.steps, "bf16")
        print(f"{name}: bf16 KV perplexity {base:.4f} over {scored} tokens", flush=True)
        for fmt in formats:
            t1 = time.perf_counter()
            with Rows(fmt) as rows:
                ppl, _, top = perplexity(net, tokens, args.window, rows, bos)
                forced, _ = decode(net, prompt, args.steps, rows, forced=ref)
                free, _ = decode(net, prompt, args.steps, rows)
            same = (base_top == top).float().mean().item()
            differ = [i for i, (x, y) in enumerate(zip(ref[1:], forced[1:])) if x != y]
            agree = args.steps - len(differ)
            first = next((i for i, (x, y) in enumerate(zip(ref[1:], free[1:])) if x != y), None)
            quality.append(f"| {name} | {fmt} | {scored} ({args.window}-row windows"
                           f"{', BOS each' if bos is not None else ''}) | {base:.4f} | {ppl:.4f} | "
                           f"{100 * (ppl / base - 1):+.3f}% | {100 * same:.2f}% | "
                           f"{agree} / {args.steps} ({100 * agree / args.steps:.1f}%) | {near(differ, margin)} | "
                           f"{'none' if first is None else first} | {time.perf_counter() - t1:.0f} s, "
                           f"load {os.getloadavg()[0]:.2f} |")
            print(quality[-1], flush=True)
        for fmt in ("fp32", "bf16", "int8", "k8v4", "k4v4"):
            page = KVCache.page_bytes(net.kv_layers, PAGE, a.kv_heads, a.head_dim, model.dtype, fmt)
            fits = [2**30 // (page * -(-c // PAGE)) for c in CONTEXTS]
            memory.append(f"| {name} | {net.kv_layers} x {a.kv_heads} x {a.head_dim} | {fmt} | {page // PAGE} | "
                          f"{page} | {2**30 // page * PAGE} | " + " | ".join(str(f) for f in fits) + " |")
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        del model, net
    print("\n| model | format | text tokens scored | ppl bf16 KV | ppl | vs bf16 | same argmax (ppl pass) |"
          " greedy top-1 agreement, teacher-forced | bf16 top-1 - top-2 logit where they differ (all steps: median) |"
          " free run's first differing step | time, load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(quality))
    print("\n| model | KV layers x kv heads x head_dim | format | KV bytes per token | bytes per 16-token page | "
          "tokens in 1 GiB | " + " | ".join(f"slots of {c} in 1 GiB" for c in CONTEXTS) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(CONTEXTS))
    print("\n".join(memory))


if __name__ == "__main__":
    main()
