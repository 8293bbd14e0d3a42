"""Decode speed of IQ4 weights as they are ("giq4", quant/iq4.py) against their int8 re-quantization, one process.

A Qwen2.5-0.5B-shaped model (random weights: speed does not depend on the values) whose body linears are random
valid IQ4 blocks as llama.cpp's IQ4_XS ftype lays them out on that model (IQ4_XS where the input is a multiple of
256, ffn_down; IQ4_NL where it is not, hidden 896), the head int8 in both. The same bytes become each format;
the two models decode in turn, `--rounds` times, one stream, `--decode` tokens after a short prompt.

    python -m benchmarks.iq4_decode --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

#: Qwen2.5-0.5B's shapes
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)


def random_iq4(block: type, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a weight [n, k] with f16 scales of a trained model's size."""
    m = n * k // block.block_size
    raw = rng.integers(0, 256, (m, block.type_size), dtype=np.uint8)
    raw[:, 0:2] = (rng.random((m, 1)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def build(folder: Path) -> None:
    import transformers

    config = transformers.Qwen2Config(**QWEN05)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, config.vocab_size)


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer of exactly `vocab` tokens (any id the random model picks decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "t1", "eos_token": "t2", "add_bos_token": false}')


def load(folder: Path, fmt: str):  # noqa: ANN201
    """The model with its body linears from the same random IQ4 bytes, as `fmt` ("giq4" or "int8")."""
    import superslm
    from superslm.formats.blocks import IQ4_NL, IQ4_XS
    from superslm.quant import quantize_linears
    from superslm.quant.gguf_map import linear_from_gguf

    model = superslm.load(folder, device="cpu")
    quantize_linears(model.net, body=None, head="int8")
    rng = np.random.default_rng(0)
    mapping = {"IQ4_NL": (fmt, {}), "IQ4_XS": (fmt, {})}
    for layer in model.net.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            old = getattr(layer, name)
            n, k = old.weight.shape if hasattr(old, "weight") else (old.out_features, old.in_features)
            block = IQ4_XS if k % 256 == 0 else IQ4_NL
            setattr(layer, name, linear_from_gguf([(random_iq4(block, n, k, rng), block, (n, k), None)],
                                                  getattr(old, "bias", None), mapping))
    gc.collect()
    return model


def decode_tps(model, decode: int) -> float:  # noqa: ANN001
    from superslm import Request, Sampling

    engine = model.engine(slots=1, context=64 + decode, prefix_caching=False)
    engine.generate([Request(list(range(16)), 4, Sampling(ignore_eos=True))])  # warm-up: the plan's first build
    t0 = time.perf_counter()
    engine.generate([Request(list(range(1, 17)), 1, Sampling(ignore_eos=True))])
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate([Request(list(range(1, 17)), decode + 1, Sampling(ignore_eos=True))])
    return decode / (time.perf_counter() - t0 - prefill)


def body_mb(model) -> float:  # noqa: ANN001
    names = ("qkv", "o", "gate_up", "down")
    return sum(getattr(layer, n).nbytes() for layer in model.net.layers for n in names) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("giq4", "int8"), help="one format (its RSS alone)")
    ns = ap.parse_args()
    import superslm

    superslm.set_threads(ns.threads)
    folder = Path(tempfile.gettempdir()) / "superslm-qwen05-random"
    if not (folder / "model.safetensors").exists():
        build(folder)
    fmts = [ns.only] if ns.only else ["int8", "giq4"]
    models = {}
    for f in fmts:
        models[f] = load(folder, f)
        print(f"{f}: body linears {body_mb(models[f]):.0f} MB, {models[f].net.layers[1].down.describe()}")
    rates: dict[str, list[float]] = {f: [] for f in fmts}
    load0 = os.getloadavg()[0]
    for _ in range(ns.rounds):
        for f in fmts:
            rates[f].append(decode_tps(models[f], ns.decode))
    for f in fmts:
        print(f"{f}: decode tok/s {' '.join(f'{r:.2f}' for r in rates[f])} (best {max(rates[f]):.2f})")
    if len(fmts) == 2:
        print("giq4 / int8 per round:", " ".join(f"{a / b:.2f}" for a, b in zip(rates["giq4"], rates["int8"])))
    rss = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(("VmRSS", "VmHWM"))]
    print(" ".join(rss), f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
