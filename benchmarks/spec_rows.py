"""A decode step's time by its rows, for pricing draft rows (`Speculative.step_cost`, engine/speculative.py).

    python -m benchmarks.spec_rows [--model smollm2-135m-instruct] [--batch 8] [--rows 8,9,12,16,32,63,64,72]
                                   [--reps 4] [--threads 2]

`--batch` sequences (the "rewrite" prompts of benchmarks/speculative.py) decode greedily on a
`speculative="ngram"` engine whose drafter is replaced by one that gives each step `rows - batch` drafts spread over
the sequences (tokens the model does not choose: rejected, so every sequence stays at one token a step); the
settings alternate, forwards then backwards each repeat, 3 steps each after one to switch. Prints, per row count,
the median and least wall time of a step and of the process's CPU time (all threads: under load the CPU time moves
less than the wall time), and each median relative to the first row count's. Under a shared machine's load run it
with `--threads 1` and OMP_WAIT_POLICY=PASSIVE: the CPU time of one thread is then the step's work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", default="8,9,10,12,16,24,32,48,63,64,72")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import superslm
    from benchmarks.speculative import prompts
    from superslm import Request, Sampling, hub

    b = args.batch
    counts = [int(r) - b for r in args.rows.split(",")]
    if min(counts) < 0:
        ap.error("every row count must be at least --batch")
    superslm.set_threads(args.threads)
    path = str(hub.fetch(args.model, progress=False))
    work = prompts(path, ["rewrite"], b)["rewrite"]
    model = superslm.load(path, device="cpu")
    engine = model.engine(slots=b, context=max(map(len, work)) + 2000, prefix_caching=False,
                          adaptive_threads=False, speculative="ngram")
    drafts = {"n": 0}

    def rejected(seqs: Any, work: Any = None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        for j in range(drafts["n"]):  # a token other than the last one's neighbours: the model hardly picks it
            i = j % len(seqs)
            out[i].append((seqs[i].tokens[-1] + 7 + j) % 1000 + 5)
        return out

    engine.speculator.propose_all = rejected  # type: ignore[method-assign]
    for p in work:
        engine.add(Request(p, 1900, Sampling(ignore_eos=True)))
    while not all(len(s.output) >= 1 for s in engine.output.seqs.values()):
        engine.advance()
    wall: dict[int, list[float]] = {d: [] for d in counts}
    cpu: dict[int, list[float]] = {d: [] for d in counts}
    for r in range(args.reps):
        for d in counts if r % 2 == 0 else counts[::-1]:
            drafts["n"] = d
            engine.advance()  # its drafts were proposed under the setting before
            for _ in range(3):
                t, c = time.perf_counter(), time.process_time()
                engine.advance()
                wall[d].append(time.perf_counter() - t)
                cpu[d].append(time.process_time() - c)
    print(f"{args.model}, batch {b}, {args.threads} threads, load average {os.getloadavg()}")
    first_wall = first_cpu = 0.0
    for d in counts:
        w, c = 1e3 * statistics.median(wall[d]), 1e3 * statistics.median(cpu[d])
        first_wall, first_cpu = first_wall or w, first_cpu or c
        print(f"rows {b + d:3d}: wall {w:7.1f} ms (least {1e3 * min(wall[d]):7.1f}, x{w / first_wall:5.2f}), "
              f"cpu {c:7.1f} ms (least {1e3 * min(cpu[d]):7.1f}, x{c / first_cpu:5.2f})")


if __name__ == "__main__":
    main()
