"""What drafting with the MTP block costs a decode step, on a tiny random Qwen3.5 with an MTP layer (float32, CPU):
engines without drafts, with speculative="mtp" (adaptive), and with 1 or 3 drafts forced every step, in one
process, the engines interleaved round by round. Random weights never agree, so no draft is kept: this measures
the cost alone (the MTP's pass over each step's verified rows, the head and the chained rows), not a speed-up.

    python benchmarks/mtp_overhead.py [--rounds 5] [--batches 1,4] [--tokens 64] [--family qwen3_5]

Prints each engine's median decode-step time, the part of it spent drafting (Speculator.propose_all), and the
load average before and after.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    import superslm
    from superslm import Request, Sampling
    from superslm.engine.speculative import Speculative
    from tests.test_mtp import build_mtp_folder
    from tests.test_speculative_mtp import prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    folder = Path(tempfile.mkdtemp()) / "hf"
    build_mtp_folder(ns.family, folder)
    model = superslm.load(folder, dtype="float32", quant="none")
    engines = {
        "plain": None,
        "mtp": "mtp",
        "mtp-k1-forced": Speculative(method="mtp", k=1, row_cost=0.0, draft_cost=0.0),
        "mtp-k3-forced": Speculative(method="mtp", k=3, row_cost=0.0, draft_cost=0.0),
    }

    def once(spec, batch: int) -> tuple[float, float, dict]:  # type: ignore[no-untyped-def]
        e = model.engine(slots=batch, context=256, page_size=16, speculative=spec, adaptive_threads=False)
        for p in prompts(batch, seed=9):
            e.add(Request(p, ns.tokens, Sampling(ignore_eos=True)))
        while e.scheduler.waiting or any(s.prefilling or not s.num_computed_tokens for s in e.scheduler.running):
            e.advance()  # the prompts first: only decode steps are timed
        spent = [0.0]
        if e.speculator is not None:
            propose = e.speculator.propose_all

            def timed(seqs, work=None):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                out = propose(seqs, work)
                spent[0] += time.perf_counter() - t
                return out

            e.speculator.propose_all = timed
        t0, steps = time.perf_counter(), e.steps
        while e.busy():
            e.advance()
        n = e.steps - steps
        return (time.perf_counter() - t0) / n * 1e3, spent[0] / n * 1e3, e.stats()

    print("load", open("/proc/loadavg").read().split()[:3])
    for batch in (int(b) for b in ns.batches.split(",")):
        runs: dict[str, list[tuple[float, float, dict]]] = {k: [] for k in engines}
        for _ in range(ns.rounds):
            for name, spec in engines.items():
                runs[name].append(once(spec, batch))
        for name, rs in runs.items():
            st = rs[-1][2]
            print(f"batch {batch} {name:14s} step {statistics.median(r[0] for r in rs):6.2f} ms, drafting "
                  f"{statistics.median(r[1] for r in rs):5.2f} ms; drafts proposed {st['drafts_proposed']}, "
                  f"kept {st['drafts_accepted']}")
    print("load", open("/proc/loadavg").read().split()[:3])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
