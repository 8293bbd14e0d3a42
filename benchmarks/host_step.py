"""Host time per decode step: what the engine's Python does around a GPU step, measured on any machine.

    python benchmarks/host_step.py [--seqs 256] [--tokens 60] [--prefix-caching] [--no-overlap]

A tiny Qwen2 model runs its graph steps (engine/graphs.py) with the forward replaced by a no-op, under the
Triton interpreter on a CPU, so only the host's work is timed: building the step's rows, sampling, launching the
step ahead (engine/overlap.py) and accepting tokens (detokenizer, stop checks, page registration). Prints ms a
step and the share of the main parts. On a GPU the same work overlaps the step ahead; it bounds the step time
when it exceeds the GPU's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["SUPERSLM_KERNELS"] = "triton"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import superslm  # noqa: E402
from superslm import Request, Sampling  # noqa: E402
from superslm.engine import output, overlap  # noqa: E402
from superslm.engine.graphs import DecodeGraphs  # noqa: E402
from tests.tiny_models import build_hf_model  # noqa: E402


def timed(spent: Counter, cls: type, name: str) -> None:
    """Wrap cls.name to add its wall time to spent[name]."""
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=60, help="new tokens per sequence")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    build_hf_model("qwen2", folder)
    model = superslm.load(folder, device="cpu", dtype="fp32")
    DecodeGraphs._forward = lambda self, b, meta: None  # the device's work: nothing, so the host's is what counts
    spent: Counter = Counter()
    timed_parts = ((output.OutputProcessor, "accept"), (overlap.GraphSteps, "_launch_ahead"), (DecodeGraphs, "run"))
    for cls, name in timed_parts:
        timed(spent, cls, name)
    n = ns.seqs
    engine = model.engine(slots=n, context=ns.tokens + 16, page_size=16, rows=4 * n, graphs=True,
                          overlap=not ns.no_overlap, prefix_caching=ns.prefix_caching)  # fmt: skip
    rng = random.Random(0)
    for _ in range(n):
        engine.add(Request([rng.randrange(2, 300) for _ in range(3)], ns.tokens, Sampling(ignore_eos=True)))
    engine.advance()  # the prompts (interpreted kernels: not timed)
    spent.clear()
    steps0, t0 = engine.steps, time.perf_counter()
    while engine.busy():
        engine.advance()
    steps = engine.steps - steps0
    per_step = (time.perf_counter() - t0) / steps
    print(f"{n} sequences, {steps} decode steps: {per_step * 1e3:.3f} ms of host time a step "
          f"({per_step / n * 1e6:.2f} us a sequence)")  # fmt: skip
    for name, s in spent.most_common():
        print(f"  {name}: {s / steps * 1e3:.3f} ms a step")
    return per_step


if __name__ == "__main__":
    main()
