"""Perplexity of every stored format on a fixed English text, against the fp32 model.

    python benchmarks/perplexity.py [--model PATH] [--tokens 2048] [--threads 1] [--keep DIR] [--only TEXT]
                                    [--tune-steps N]

The text is the Apache License 2.0 as the `safetensors` wheel ships it (a hard dependency of
SuperSLM, so every install has it; the license text itself never changes): the file named
LICENSE in safetensors' dist-info, found through importlib.metadata. Each format is made by
`superslm convert` from the model (default: SmolLM2-135M-Instruct Q4_1 GGUF) and loaded from its
folder; the fp32 row is the GGUF dequantized (`superslm.load(..., quant=None)`). Prints one
markdown table (the one in docs/convert.md): perplexity, relative error of the logits and top-1
agreement against fp32, folder size, conversion and load seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import math
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import superslm
from superslm import hub
from superslm.cache.kv import KVCache
from superslm.convert import convert
from superslm.kernels.attention import AttnMetadata

#: (label, convert options); None: the fp32 reference, loaded from the source itself
FORMATS: list[tuple[str, dict[str, Any] | None]] = [
    ("fp32 (GGUF dequantized)", None),
    ("dense bf16 (load dtype=bf16)", {"format": "dense", "dtype": "bfloat16"}),
    ("bf16", {"format": "bf16"}),
    ("gguf native (Q4_0/Q4_1/Q4_K as they are, other blocks nearest), head nearest", {"format": "gguf"}),
    ("int8, int8 head, rotated", {"format": "int8"}),
    ("int8, int8 head, not rotated", {"format": "int8", "rotate": False}),
    ("int4 g32, int8 head, rotated", {"format": "int4", "group": 32}),
    ("int4 g32, int8 head, not rotated", {"format": "int4", "group": 32, "rotate": False}),
    ("int4 g128, int8 head, rotated", {"format": "int4", "group": 128}),
    ("int4 g128, int8 head, not rotated", {"format": "int4", "group": 128, "rotate": False}),
    ("int4 g128 GPTQ, int8 head, rotated", {"format": "int4", "group": 128, "calibrate": True}),
    ("int4 g128 GPTQ, int8 head, not rotated", {"format": "int4", "group": 128, "rotate": False, "calibrate": True}),
    ("int4 g128 GPTQ + tuned scales (60 steps), int8 head, rotated",
     {"format": "int4", "group": 128, "calibrate": True, "tune_steps": 60}),
]  # fmt: skip


def license_text() -> tuple[str, Path]:
    """The Apache-2.0 text of the installed safetensors distribution, and its path."""
    dist = importlib.metadata.distribution("safetensors")
    for f in dist.files or []:
        if Path(str(f)).name == "LICENSE":
            path = Path(str(dist.locate_file(f)))
            return path.read_text(encoding="utf-8"), path
    raise SystemExit("the safetensors distribution ships no LICENSE file")


def nll_per_token(net: torch.nn.Module, tokens: list[int], chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihood [n-1] of each next token, logits [n-1, vocab] as bf16 to save memory)."""
    a, n, ps = net.arch, len(tokens), 16
    pages = (n + ps - 1) // ps
    kv = KVCache(len(net.layers), pages, ps, a.kv_heads, a.head_dim, net.dtype)
    meta = AttnMetadata.one_prompt(n, ps)
    target = torch.tensor(tokens[1:])
    nll, kept = [], []
    with torch.no_grad():
        h = net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v)
        for start in range(0, n - 1, chunk):  # the head one chunk at a time: [n, vocab] fp32 is large
            logits = net.logits(h[start : min(start + chunk, n - 1)]).float()
            nll.append(F.cross_entropy(logits, target[start : start + chunk], reduction="none"))
            kept.append(logits.to(torch.bfloat16))
    return torch.cat(nll), torch.cat(kept)


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=2048, help="evaluate the text's first N tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", default=None, help="keep the converted folders here")
    ap.add_argument("--only", default=None, help="only the formats whose label contains one of these comma-"
                    "separated texts (the fp32 reference always runs)")
    ap.add_argument("--tune-steps", type=int, default=None, help="the tuned row's steps (default 60)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = FORMATS
    if args.tune_steps is not None:
        formats = [(label.replace("(60 steps)", f"({args.tune_steps} steps)"),
                    None if o is None else {**o, "tune_steps": args.tune_steps} if "tune_steps" in o else o)
                   for label, o in FORMATS]  # fmt: skip
    src = Path(args.model) if args.model else hub.fetch(hub.DEFAULT_MODEL)
    text, text_path = license_text()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="superslm-ppl-"))
    ref_model = superslm.load(src, quant=None, dtype="float32")
    tokens = ref_model.tokenizer.encode(text)[: args.tokens]
    print(f"model {src.name}; text {text_path} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, "
          f"{len(tokens)} tokens); torch {torch.__version__}, {args.threads} thread(s), {platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| format | perplexity | vs fp32 | KL | rel. logits error | top-1 agree | folder MiB | convert s | load s |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref_nll, ref_logits = nll_per_token(ref_model.net, tokens)
    ref_ppl = math.exp(ref_nll.mean().item())
    del ref_model
    for label, options in formats:
        if options is not None and args.only and not any(t in label for t in args.only.split(",")):
            continue
        if options is None:
            nll, logits, size, conv_s, load_s = ref_nll, ref_logits, float(src.stat().st_size) / 2**20, 0.0, 0.0
        else:
            options = dict(options)
            dtype = options.pop("dtype", None)
            dst = work / label.split(",")[0].replace(" ", "-").replace("(", "").replace(")", "") / \
                ("rot" if options.get("rotate", True) else "plain")
            start = time.perf_counter()
            convert(src, dst, overwrite=True, **options)
            conv_s = time.perf_counter() - start
            start = time.perf_counter()
            model = superslm.load(dst, dtype=dtype)
            load_s = time.perf_counter() - start
            nll, logits = nll_per_token(model.net, tokens)
            size = folder_mib(dst)
            del model
        ppl = math.exp(nll.mean().item())
        rel = ((logits.float() - ref_logits.float()).norm() / ref_logits.float().norm()).item()
        # KL(fp32 || format) per token: how far the format's next-token distributions are from the reference's
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(ref_logits.float(), -1), log_target=True,
                      reduction="batchmean").item()
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        print(f"| {label} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.1f}% | {kl:.4f} | {rel:.4f} | {top1:.3f} | "
              f"{size:.0f} | {conv_s:.1f} | {load_s:.2f} |", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
