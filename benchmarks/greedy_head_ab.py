"""The certified greedy head on or off, alternating in one process: aggregate tok/s of `streams` greedy streams.

    python -m benchmarks.greedy_head_ab MODEL.gguf [--streams 16] [--tokens 48] [--rounds 5]
    python -m benchmarks.greedy_head_ab MODEL.gguf --head-rows 16     # the head alone, on real hidden rows

Off is `cpu_decode.GREEDY_MIN_ROWS` set past any step's rows (every step computes the whole head); on is its
default. Prints each round's tok/s, the median ratio and the head's [calls, fallbacks].
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import superslm
from superslm import Request, Sampling
from superslm.kernels import cpu_decode


def alternate(engine: superslm.Engine, ids: list[int], streams: int, tokens: int, rounds: int,
              modes: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """Per mode (its setter called before each of its runs), `rounds` aggregate decode tok/s of `streams` greedy
    streams of `tokens` tokens (the prompts' step excluded), the modes in turn; the last mode's setter stays."""
    greedy = Sampling(ignore_eos=True)
    engine.generate([Request(ids[:16], 4, greedy)])  # warm-up

    def run() -> float:
        for i in range(streams):
            engine.add(Request(ids[i : i + 24], tokens, greedy))
        engine.advance()  # the prompts
        t, n = time.perf_counter(), 0
        while engine.busy():
            n += sum(len(p.tokens) for p in engine.advance())
        return n / (time.perf_counter() - t)

    res: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, setter in modes.items():
            setter()
            res[name].append(run())
    return res


def head_alone(model: superslm.Model, ids: list[int], rows: int, rounds: int) -> None:
    """ms per call of the whole head + argmax and of the certified head, on the hidden rows of a short greedy run
    of `rows` streams (the head's input as the engine hands it over), and the candidates per row."""
    import torch

    seen: list[torch.Tensor] = []
    real = cpu_decode.greedy_head

    def record(module: torch.nn.Module, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor | None:
        seen.append(x.clone())
        return real(module, x, deterministic)

    cpu_decode.greedy_head = record
    model.engine(slots=rows, context=128).generate([Request(ids[: 4 + i], 8, Sampling(ignore_eos=True))
                                                    for i in range(rows)])
    cpu_decode.greedy_head = real
    xs = [x for x in seen if x.shape[0] == rows][:8]
    head = model.net.head
    if not xs or real(head, xs[0]) is None:
        raise SystemExit("the head is not certified here at this many rows")

    def whole(x: torch.Tensor) -> torch.Tensor:
        return cpu_decode.vnni_linear(head, x).float().argmax(dim=1)

    def per_call(fn: object) -> float:
        runs = []
        for _ in range(9):
            t = time.perf_counter()
            for x in xs:
                fn(x)
            runs.append((time.perf_counter() - t) / len(xs))
        return statistics.median(runs)

    assert all(torch.equal(whole(x), real(head, x)) for x in xs)
    for _ in range(rounds):
        a, b = per_call(whole), per_call(lambda x: real(head, x))
        print(f"{rows} rows: whole head {a * 1e3:.2f} ms, certified {b * 1e3:.2f} ms, {a / b:.2f}x")
    ext = superslm.cext.extension()
    print("candidates", [int(ext.int8_greedy_candidates(x, head.codes, head.scale, head._rowsum, head._greedy_w2,
                                                         4096)[0].numel()) for x in xs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head-rows", type=int, default=0, help="time the head alone at this many rows")
    ns = ap.parse_args()
    superslm.set_threads(ns.threads)
    model = superslm.load(ns.model, device="cpu")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)
    if ns.head_rows:
        head_alone(model, ids, ns.head_rows, ns.rounds)
        return
    engine = model.engine(slots=ns.streams, context=256, rows=512, prefix_caching=False)
    default = cpu_decode.GREEDY_MIN_ROWS
    res = alternate(engine, ids, ns.streams, ns.tokens, ns.rounds, {
        "off": lambda: setattr(cpu_decode, "GREEDY_MIN_ROWS", 10**9),
        "on": lambda: setattr(cpu_decode, "GREEDY_MIN_ROWS", default)})
    ratio = statistics.median(res["on"]) / statistics.median(res["off"])
    print({k: [round(v, 1) for v in vs] for k, vs in res.items()}, f"on/off (medians) {ratio:.2f}x",
          "head [calls, fallbacks]", getattr(model.net.head, "_greedy_stats", None))


if __name__ == "__main__":
    main()
