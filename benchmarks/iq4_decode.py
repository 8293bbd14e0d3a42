"""Decode speed of IQ4 weights as they are ("giq4", quant/iq4.py) against their int8 re-quantization, one process.

A Qwen2.5-0.5B-shaped model (random weights: speed does not depend on the values) whose body linears are random
valid IQ4 blocks as llama.cpp's IQ4_XS ftype lays them out on that model (IQ4_XS where the input is a multiple of
256, ffn_down; IQ4_NL where it is not, hidden 896), the head int8 in both. The same bytes become each format;
the two models decode in turn, `--rounds` times, one stream, `--decode` tokens after a short prompt.

    python -m benchmarks.iq4_decode --rounds 3

`--gemv`: each body linear's GEMV alone (giq4's against int8's AVX2 GEMV on the same values), interleaved, best of
`--rounds` x 20 calls, warm (one matrix, in cache) and cold (copies cycled past a 32 MiB L3).
`--accuracy`: the giq4 GEMV's error (x as int8 per 32) against the int8 path's (the weight re-quantized per channel,
x in two int8 parts: ~exact), against x as two int8 parts per 32 and against float32 x, all from the float64 product
with the file's weights, over activations shaped like a decoder's.
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


#: Qwen2.5-0.5B's body linears [out, in]
SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


def gemv_bench(rounds: int) -> None:
    """Each shape's GEMV, giq4 against int8 (AVX2), one thread or the set threads, warm and cold."""
    from superslm import cext
    from superslm.formats.blocks import IQ4_NL, IQ4_XS
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.iq4 import GGUFIQ4Linear

    ext = cext.extension()
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        block = IQ4_XS if k % 256 == 0 else IQ4_NL
        copies = max(1, -(-96 * 2**20 // (n * k // 2 + n * k // 8)))  # giq4 bytes past L3 (int8 then 1.6x that)
        iq, i8 = [], []
        for _ in range(copies):
            raw = random_iq4(block, n, k, rng)
            iq.append(GGUFIQ4Linear.from_gguf(raw, block, (n, k)))
            i8.append(linear_from_gguf([(raw, block, (n, k), None)], None, {block.name: ("int8", {})}))
        x = torch.randn(1, k).bfloat16()

        def run_iq(m, x=x) -> None:  # noqa: ANN001
            ext.iq4_gemv(x, m.qweight, m.scales, m.table)

        def run_i8(m, x=x) -> None:  # noqa: ANN001
            ext.int8_gemv_avx2(x, m.codes, m.scale)

        best = {"giq4 warm": 1e9, "int8 warm": 1e9, "giq4 cold": 1e9, "int8 cold": 1e9}
        for _ in range(rounds):
            for fmt, fn, mods in (("giq4", run_iq, iq), ("int8", run_i8, i8)):
                for _ in range(3):
                    fn(mods[0])
                t0 = time.perf_counter()
                for _ in range(20):
                    fn(mods[0])
                best[f"{fmt} warm"] = min(best[f"{fmt} warm"], (time.perf_counter() - t0) / 20)
                t0 = time.perf_counter()
                reps = max(20, copies)
                for i in range(reps):
                    fn(mods[i % copies])
                best[f"{fmt} cold"] = min(best[f"{fmt} cold"], (time.perf_counter() - t0) / reps)
        gb = n * k * 0.625 / 1e9
        ratio = (f"giq4/int8 warm {best['giq4 warm'] / best['int8 warm']:.2f},"
                 f" cold {best['giq4 cold'] / best['int8 cold']:.2f}")
        print(f"{name} [{n}, {k}] {block.name}: " + ", ".join(f"{key} {v * 1e6:.0f} us" for key, v in best.items())
              + f"; {ratio}; giq4 {gb / best['giq4 warm']:.1f} / {gb / best['giq4 cold']:.1f} GB/s")


def activations(kind: str, k: int, rows: int, g: torch.Generator) -> torch.Tensor:
    """[rows, k] bf16 activations: "gauss" N(0, 1); "norm" an RMSNorm output (per-channel gains, lognormal, and 4
    channels of every 896 ~20x the rest, as decoders' massive activations); "swiglu" silu(a) * b of Gaussians
    scaled 2x, a down projection's heavy-tailed input."""
    x = torch.randn(rows, k, generator=g)
    if kind == "norm":
        gain = torch.exp(0.5 * torch.randn(k, generator=g))
        hot = torch.randperm(k, generator=g)[: max(1, 4 * k // 896)]
        gain[hot] *= 20
        x = x * gain
    elif kind == "swiglu":
        x = torch.nn.functional.silu(2 * x) * (2 * torch.randn(rows, k, generator=g))
    return x.bfloat16()


def accuracy(rows: int) -> None:
    """Relative error (rms over outputs / rms of the exact product) of each path, over the shapes' inputs."""
    from superslm.formats.blocks import IQ4_NL
    from superslm.quant.gguf_map import linear_from_gguf
    from superslm.quant.iq4 import GGUFIQ4Linear, iq4_gemv, quantize_groups

    g = torch.Generator().manual_seed(0)
    for k, n in ((896, 1024), (4864, 512)):
        w32 = torch.randn(n, k, generator=g) * 0.02
        raw = quantize_iq4_nl(w32.numpy())
        iq = GGUFIQ4Linear.from_gguf(raw, IQ4_NL, (n, k))  # the twin: no kernels needed
        i8 = linear_from_gguf([(raw, IQ4_NL, (n, k), None)], None, {"IQ4_NL": ("int8", {})})
        w = iq.dequantize().double()
        w8 = i8.dequantize().double()
        for kind in ("gauss", "norm", "swiglu"):
            x = activations(kind, k, rows, g)
            err = {"giq4 int8 x": [], "int8 weights": [], "two-part x": [], "float32 x": []}
            refs = []
            for r in range(rows):
                xr = x[r : r + 1]
                ref = (xr.double() @ w.t())[0]
                refs.append(ref)
                y = iq4_gemv(xr, iq.qweight, iq.scales, iq.table).double()[0]
                err["giq4 int8 x"].append(y - ref)
                err["int8 weights"].append((xr.double() @ w8.t())[0].bfloat16().double() - ref)
                q, dx = quantize_groups(xr)  # [groups, 32]: the hi part, then the remainder in steps of dx / 254
                xf = xr.float().view(-1, 32)
                lo = torch.round((xf - q * dx[:, None]) / (dx[:, None] / 254)).clamp(-127, 127)
                x2 = (q * dx[:, None].double() + lo * (dx[:, None].double() / 254)).view(1, k)
                err["two-part x"].append((x2 @ w.t())[0].bfloat16().double() - ref)
                err["float32 x"].append((xr.double() @ w.t())[0].bfloat16().double() - ref)
            rms = torch.stack(refs).pow(2).mean().sqrt()
            parts = []
            for key, v in err.items():
                e = torch.stack(v)
                parts.append(f"{key} {e.pow(2).mean().sqrt() / rms * 100:.3f}% (max {e.abs().max() / rms * 100:.2f}%)")
            print(f"[{n}, {k}] {kind:6s}: " + ", ".join(parts))


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """w float32 [n, k] -> IQ4_NL bytes: per 32 values d = (the value of largest magnitude) / -127, each code the
    table's nearest value (ggml's first guess, without its scale search)."""
    from superslm.formats.blocks import _IQ4_VALUES

    grp = w.reshape(-1, 32)
    big = grp[np.arange(len(grp)), np.abs(grp).argmax(1)]
    d = (big / _IQ4_VALUES[0]).astype(np.float16)
    inv = np.where(d != 0, 1 / d.astype(np.float32), 0)
    codes = np.abs(grp[..., None] * inv[:, None, None] - _IQ4_VALUES).argmin(-1).astype(np.uint8)  # [blocks, 32]
    out = np.empty((len(grp), 18), dtype=np.uint8)
    out[:, :2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out.reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("giq4", "int8"), help="one format (its RSS alone)")
    ap.add_argument("--gemv", action="store_true", help="each body linear's GEMV alone, giq4 against int8")
    ap.add_argument("--accuracy", action="store_true", help="the GEMV's error against the int8 path's")
    ns = ap.parse_args()
    import superslm

    superslm.set_threads(ns.threads)
    if ns.accuracy:
        accuracy(16)
        return
    if ns.gemv:
        print(f"threads {ns.threads}, load {os.getloadavg()[0]:.2f}")
        gemv_bench(ns.rounds)
        print(f"load {os.getloadavg()[0]:.2f}")
        return
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
