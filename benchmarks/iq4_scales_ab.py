"""IQ4_XS scales packed (a float32 d a block of 256, an int8 ls - 32 a group: 0.375 bits a weight) or as one
float32 a group (1 bit a weight, the layout before), alternating in one process: decode tok/s of `streams` greedy
streams. The two layouts give the same bits (d * (ls - 32) is exact); decode reads every weight once a step, so
the packed scales' fewer bytes are what moves.

    python -m benchmarks.iq4_scales_ab MODEL-IQ4_XS.gguf [--streams 1] [--tokens 64] [--rounds 5]

Each giq4 module with packed scales gets a twin with float scales (the same codes); a mode swaps the twins in
(setattr: the C++ plan sees the swap and rebuilds). Prints each round's tok/s and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import superslm
from benchmarks.greedy_head_ab import alternate
from superslm.quant.iq4 import GGUFIQ4Linear, group_scales


def twins(net: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]:
    """(parent, name, packed module, float-scales twin) for every giq4 module with packed scales."""
    out = []
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGUFIQ4Linear) and child.scales.dtype == torch.uint8:
                k = child.qweight.shape[1] * 2
                flat = GGUFIQ4Linear(child.qweight, group_scales(child.scales, k), child.in_features,
                                     child.out_features, child.bias, child.note, child.table)
                out.append((parent, name, child, flat))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    superslm.set_threads(ns.threads)
    model = superslm.load(ns.model, device="cpu")
    pairs = twins(model.net)
    if not pairs:
        raise SystemExit(f"{ns.model}: no IQ4_XS linears with packed scales")
    packed = sum(p[2].nbytes() for p in pairs)
    flat = sum(p[3].nbytes() for p in pairs)
    print(f"{len(pairs)} IQ4_XS linears: {packed / 2**20:.0f} MB packed, {flat / 2**20:.0f} MB with float scales")

    def use(which: int) -> None:
        for parent, name, *mods in pairs:
            setattr(parent, name, mods[which])

    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8, add_special_tokens=False)
    engine = model.engine(slots=ns.streams, context=256)
    res = alternate(engine, ids, ns.streams, ns.tokens, ns.rounds,
                    {"float": lambda: use(1), "packed": lambda: use(0)})
    for name, v in res.items():
        print(f"{name:7} " + " ".join(f"{t:6.1f}" for t in v) + f"   median {statistics.median(v):.1f} tok/s")
    ratios = [p / f for p, f in zip(res["packed"], res["float"], strict=True)]
    print(f"packed / float: median {statistics.median(ratios):.3f}x (per round {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
