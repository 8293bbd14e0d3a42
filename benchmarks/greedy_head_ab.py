"""The certified greedy head on or off, alternating in one process: aggregate tok/s of `streams` greedy streams.

    python -m benchmarks.greedy_head_ab MODEL.gguf [--streams 16] [--tokens 48] [--rounds 5]

Off is `cpu_decode.GREEDY_MIN_ROWS` set past any step's rows (every step computes the whole head); on is its
default. Prints each round's tok/s, the median ratio and the head's [calls, fallbacks].
"""

from __future__ import annotations

import argparse
import statistics
import time

import superslm
from superslm import Request, Sampling
from superslm.kernels import cpu_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    superslm.set_threads(ns.threads)
    model = superslm.load(ns.model, device="cpu")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)
    greedy = Sampling(ignore_eos=True)
    engine = model.engine(slots=ns.streams, context=256, rows=512, prefix_caching=False)
    engine.generate([Request(ids[:16], 4, greedy)])  # warm-up

    def run() -> float:
        for i in range(ns.streams):
            engine.add(Request(ids[i : i + 24], ns.tokens, greedy))
        engine.advance()  # the prompts
        t, n = time.perf_counter(), 0
        while engine.busy():
            n += sum(len(p.tokens) for p in engine.advance())
        return n / (time.perf_counter() - t)

    default = cpu_decode.GREEDY_MIN_ROWS
    res: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(ns.rounds):
        for mode in ("off", "on"):
            cpu_decode.GREEDY_MIN_ROWS = 10**9 if mode == "off" else default
            res[mode].append(run())
    cpu_decode.GREEDY_MIN_ROWS = default
    ratio = statistics.median(res["on"]) / statistics.median(res["off"])
    print({k: [round(v, 1) for v in vs] for k, vs in res.items()}, f"on/off (medians) {ratio:.2f}x",
          "head [calls, fallbacks]", getattr(model.net.head, "_greedy_stats", None))


if __name__ == "__main__":
    main()
