"""Draft policies replayed over recorded greedy answers: what the Speculator would draft and keep, each step priced by
a cost curve, with no model run and no clock (so a shared machine's load does not move the figures).

    python -m benchmarks.spec_replay [--model smollm2-135m-instruct] [--decode 128] [--tokens answers.json]
                                     ["costs=AVX2_COSTS, prior=0.75" "row_tile=4" ...]

First the answers: benchmarks/speculative.py's "story" and "rewrite" prompts, 8 of each, decoded plainly and greedily
at batch 8 (`--tokens FILE`: read from FILE when it exists, else written there). Then, per policy (the arguments of
a `Speculative(...)`, evaluated with AVX2_COSTS, AVX2_PRIOR and VNNI_PRICES in scope), each workload at batch 1 (its
first prompt) and 8: each step the Speculator proposes every live sequence's drafts (`propose_all`, the engine's own
code), a draft is kept while it equals the recorded answer, and the step is priced `step_cost(rows)` by
AVX2_COSTS. Prints plain decoding's cost over the policy's (the speed-up the curve predicts) and the drafts kept.
Greedy answers with drafts equal the plain ones (deterministic mode; in the default mode a near tie may differ).
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace
from typing import Any

from superslm.engine import speculative
from superslm.engine.speculative import AVX2_COSTS, Speculative, Speculator


def answers(model: str, decode: int, path: str | None) -> dict[str, list[tuple[list[int], list[int]]]]:
    """workload -> (prompt, greedy answer) of its 8 prompts."""
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import superslm
    from benchmarks.speculative import prompts
    from superslm import Request, Sampling, hub

    file = str(hub.fetch(model, progress=False))
    work = prompts(file, ["story", "rewrite"], 8)
    net = superslm.load(file, device="cpu")
    out: dict[str, Any] = {}
    for w, ps in work.items():
        engine = net.engine(slots=8, context=max(map(len, ps)) + decode + 16, prefix_caching=False)
        done = engine.generate([Request(p, decode, Sampling(ignore_eos=True)) for p in ps])
        out[w] = [(list(p), list(c.tokens)) for p, c in zip(ps, done, strict=True)]
    if path:
        with open(path, "w") as f:
            json.dump(out, f)
    return out


def replay(data: list[Any], batch: int, config: Speculative, curve: Speculative) -> tuple[float, int, int]:
    """(plain decoding's cost over the policy's, drafts kept, drafts proposed) of the first `batch` answers."""
    spec = Speculator(config)
    seqs = [SimpleNamespace(request=SimpleNamespace(speculative=True), grammar=None, spec=None, max_tokens=len(out),
                            sampler=SimpleNamespace(params=SimpleNamespace(damped=None)), output=[out[0]],
                            tokens=[*prompt, out[0]], answer=out) for prompt, out in data[:batch]]
    cost, kept, proposed = 0.0, 0, 0
    while live := [s for s in seqs if len(s.output) < s.max_tokens]:
        drafts = spec.propose_all(live)  # type: ignore[arg-type]
        cost += curve.step_cost(sum(1 + len(d) for d in drafts))
        for s, d in zip(live, drafts, strict=True):
            at, a = len(s.output), 0
            while a < len(d) and at + a < len(s.answer) and d[a] == s.answer[at + a]:
                a += 1
            new = s.answer[at : at + min(a + 1, s.max_tokens - at)]
            if d:
                spec.record(s, len(d), a)  # type: ignore[arg-type]
                kept, proposed = kept + a, proposed + len(d)
            s.output += new
            s.tokens += new
    longest = max(len(s.answer) for s in seqs)
    plain = sum(curve.step_cost(sum(len(s.answer) > i for s in seqs)) for i in range(1, longest))
    return plain / cost, kept, proposed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--tokens", default=None, help="a JSON file of the answers (read if there, else written)")
    ap.add_argument("policies", nargs="*",
                    default=["row_tile=4", "costs=AVX2_COSTS", "costs=AVX2_COSTS, prior=AVX2_PRIOR"])
    args = ap.parse_args()
    data = answers(args.model, args.decode, args.tokens)
    curve = Speculative(costs=AVX2_COSTS)
    names = {n: getattr(speculative, n) for n in ("AVX2_COSTS", "AVX2_PRIOR", "VNNI_PRICES")}
    for text in args.policies:
        config = eval(f"Speculative({text})", {"Speculative": Speculative, **names}).validate()  # noqa: S307
        cells = []
        for w in ("story", "rewrite"):
            for b in (1, 8):
                gain, kept, proposed = replay(data[w], b, config, curve)
                cells.append(f"{w}-{b} {gain:.3f}x ({kept}/{proposed})")
        print(f"{text:40} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
