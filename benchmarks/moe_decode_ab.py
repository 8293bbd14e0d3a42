"""Decode tok/s of a MoE model with its experts' decode rows in one C++ call (kernels/moe_step.py) and without,
in one process, interleaved step by step (the mode changes every decode step, in turn), so a busy machine's
bursts spread over all modes; tok/s from each mode's median step time.

    python benchmarks/moe_decode_ab.py MODEL [--quant int4] [--rounds 4] [--tokens 64] [--threads 2]

Modes: "torch" (MoE.forward's torch code, each one-row linear on the module's own kernel: this tree before the
AVX2 GEMVs reached `one_row_linear`, on a CPU without VNNI), "gemv" (the torch code, one-row linears on the
plan's GEMVs) and "moe_step" (the C++ step). Prints each mode's tok/s per round (--tokens steps of each mode),
the whole run's and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    import superslm
    from superslm import cext
    from superslm.kernels import cpu_decode, moe_step

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args(argv)
    superslm.set_threads(ns.threads)
    model = superslm.load(ns.model, device="cpu", quant=ns.quant)
    engine = model.engine(slots=1, context=256, prefix_caching=False)
    prompt = list(range(5, 37))
    real_run, real_row = moe_step.run, cpu_decode.one_row_linear
    vnni = cext.vnni() is not None

    def mode(name: str) -> None:
        moe_step.run = real_run if name == "moe_step" else (lambda *a: None)  # type: ignore[assignment]
        # without VNNI, one_row_linear took no linear before the AVX2 GEMVs (its test asked for cext.vnni())
        old = name == "torch" and not vnni
        cpu_decode.one_row_linear = (lambda *a: None) if old else real_row  # type: ignore[assignment]

    def decode(tokens: int, modes: list[str], times: dict[str, list[float]]) -> None:
        # Engine.step (caller-driven rows): greedy tokens fed back as ids, so a random-weight model whose tokenizer
        # is smaller than its vocabulary (benchmarks/published.py's folders) needs no detokenizer. The mode changes
        # every step, in turn: a burst of another process's work lands on all modes alike
        engine.reset(0)
        logits = engine.step(prompt, [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        for i in range(tokens):
            name = modes[i % len(modes)]
            mode(name)
            t = time.perf_counter()
            logits = engine.step([int(logits[0].argmax())], [0], [True])
            times[name].append(time.perf_counter() - t)

    modes = ["torch", "gemv", "moe_step"]
    decode(12, modes, {m: [] for m in modes})  # warm-up: the C++ step's first build, the allocator
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(ns.rounds):
        order = modes[r % 3:] + modes[: r % 3]
        decode(3 * ns.tokens, order, times)
        print(f"round {r}  load {os.getloadavg()[0]:.1f}  "
              + "  ".join(f"{m} {1 / statistics.median(times[m][-ns.tokens:]):.2f}" for m in modes), flush=True)
    mode("moe_step")
    med = {m: 1 / statistics.median(v) for m, v in times.items()}
    mean = {m: len(v) / sum(v) for m, v in times.items()}
    print("tok/s from the median step  " + "  ".join(f"{m} {med[m]:.2f}" for m in modes)
          + f"  moe_step/gemv {med['moe_step'] / med['gemv']:.2f}x"
          + f"  moe_step/torch {med['moe_step'] / med['torch']:.2f}x")
    print("tok/s from the mean step    " + "  ".join(f"{m} {mean[m]:.2f}" for m in modes)
          + f"  load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
