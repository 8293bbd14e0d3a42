"""Two SuperSLM trees and llama.cpp on the same GGUFs, in one invocation, rounds alternating.

    git worktree add /tmp/before OLD_COMMIT
    python benchmarks/before_after.py --before /tmp/before/src --after src MODEL.gguf [MODEL.gguf ...]

Each round runs, per model, the old tree's `bench_superslm`, llama-cpp-python's `bench_llama_cpp` and the new
tree's `bench_superslm` (superslm/bench.py's workloads: a 512-token prefill, 128 decode tokens at batch 1, 4
streams), each in a fresh process (`PYTHONPATH=<tree>`). Prints per model and side the median (range) of the
ratios against llama.cpp from the same round, and the load averages. A warm-up run per tree first (the C++
kernels build once per tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CODE = ("import json, sys; from superslm.bench import {fn} as f; "
         "print('RESULT' + json.dumps(f(sys.argv[1], {threads}, 512, 128, 4)))")


def one(tree: str, fn: str, model: str, threads: int) -> dict:
    """One engine's figures from `tree`'s code, in a process of its own."""
    env = dict(os.environ, PYTHONPATH=tree)
    try:
        r = subprocess.run([sys.executable, "-c", _CODE.format(fn=fn, threads=threads), model], env=env,
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    return {"error": r.stderr[-300:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--before", required=True, help="the old tree's src folder")
    ap.add_argument("--after", required=True, help="the new tree's src folder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args(argv)
    trees = {"before": os.path.abspath(ns.before), "after": os.path.abspath(ns.after)}
    for model in ns.models:
        for tree in trees.values():
            one(tree, "bench_superslm", model, ns.threads)
        rows = []
        for _ in range(ns.rounds):
            row = {"load": os.getloadavg()[0], "before": one(trees["before"], "bench_superslm", model, ns.threads),
                   "llama.cpp": one(trees["after"], "bench_llama_cpp", model, ns.threads),
                   "after": one(trees["after"], "bench_superslm", model, ns.threads)}  # fmt: skip
            rows.append(row)
        name = os.path.basename(model)
        ok = [r for r in rows if not any("error" in r[k] for k in ("before", "after", "llama.cpp"))]
        if not ok:
            print(name, "no round ran:", rows[-1])
            continue
        for side in ("before", "after"):
            parts = []
            for key, peer_key in (("prefill", "prefill"), ("decode", "decode"), ("streams", "decode")):
                v = [r[side][key] / r["llama.cpp"][peer_key] for r in ok]
                a = [r[side][key] for r in ok]
                parts.append(f"{key} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f}), "
                             f"{statistics.median(a):.1f} tok/s")
            print(f"{name} {side}: " + "; ".join(parts))
        peer = [r["llama.cpp"] for r in ok]
        print(f"{name} llama.cpp: prefill {statistics.median(p['prefill'] for p in peer):.1f}, "
              f"decode {statistics.median(p['decode'] for p in peer):.1f} tok/s")
        print(f"{name} rounds {len(ok)}, load averages {[round(r['load'], 2) for r in rows]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
