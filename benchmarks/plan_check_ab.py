"""The C++ plan's module check at every call (as before the registration count) against the counted check, in turns
in one process: aggregate decode tok/s of `streams` greedy streams.

    python -m benchmarks.plan_check_ab MODEL.gguf [--streams 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import superslm
from benchmarks.greedy_head_ab import alternate
from superslm.kernels import cpu_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ns = ap.parse_args()
    superslm.set_threads(2)
    model = superslm.load(ns.model, device="cpu")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)
    engine = model.engine(slots=ns.streams, context=256, prefix_caching=False)
    counted = cpu_decode.plan_for

    def every_call(net: object) -> object:
        cpu_decode._registrations += 1  # as if a module had been registered: the full key check
        return counted(net)

    res = alternate(engine, ids, ns.streams, ns.tokens, ns.rounds, {
        "every call": lambda: setattr(cpu_decode, "plan_for", every_call),
        "counted": lambda: setattr(cpu_decode, "plan_for", counted)})
    ratio = statistics.median(res["counted"]) / statistics.median(res["every call"])
    print({k: [round(v, 1) for v in vs] for k, vs in res.items()}, f"counted / every call (medians) {ratio:.3f}x")

if __name__ == "__main__":
    main()
