"""Structured-output benchmark: what a JSON-schema constraint costs per decoded token, and what
jump-forward gains, at batch 1 on the default model (SmolLM2-135M-Instruct), one run.

    python benchmarks/structured.py [--model PATH_OR_NAME] [--device cpu] [--repeats 3] [--max-tokens 96]

For each of a few schema prompts (from tests/schemas/), three runs of the same request:

- constrained, jump-forward off: every token masked and sampled, one per step;
- unconstrained (ignore_eos), as many tokens as the constrained answer had: same positions, no mask;
- constrained, jump-forward on (the default): forced tokens appended without sampling and run
  through the model in the next step's chunk (with --deterministic the tokens equal the
  jump-forward-off run's; without, a near-tie may flip: the count is printed).

Decode time per token is measured from the first token to the last (prefill excluded). The mask
time per sampled token is the grammar's work in a step, timed by wrapping the engine's calls:
`GrammarState.take_forced` (jump-forward look-ahead), `fill_bitmasks` and `apply_token_bitmask`.
The runs are interleaved per prompt and repeated, so the machine's noise hits all three alike;
the ratios mean more than the absolute numbers on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import superslm
import superslm.grammar
import superslm.sampling.sampler as sampler_module
from superslm import Request, Sampling
from superslm.engine import Engine
from superslm.grammar import Constraint, GrammarState

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "schemas"
ASKS = {
    "sentiment": "What is the sentiment of 'I loved this film'? Answer as JSON.",
    "product": "Describe a coffee mug for sale as JSON.",
    "event": "Describe a concert in Paris as JSON.",
    "user_profile": "Make up a user profile as JSON.",
    "invoice": "Write an invoice for two books as JSON.",
    "function_call": "Call a function to get the weather in Oslo, as JSON.",
}


class MaskTimer:
    """Wraps the engine's grammar calls and adds up their time per engine step."""

    def __init__(self) -> None:
        self.step = 0.0
        self.per_step: list[float] = []
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.step += time.perf_counter() - t

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> MaskTimer:
        # the engine imports fill_bitmasks from superslm.grammar at each step, and sample() calls the
        # module-level apply_token_bitmask: patching those names reaches the engine's calls
        self._wrap(GrammarState, "take_forced")
        self._wrap(superslm.grammar, "fill_bitmasks")
        self._wrap(sampler_module, "apply_token_bitmask")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def end_step(self) -> None:
        self.per_step.append(self.step)
        self.step = 0.0


def run(engine: Engine, request: Request, timer: MaskTimer | None = None) -> dict[str, Any]:
    """Run one request alone; its tokens, steps and decode seconds (first token to last)."""
    rid = engine.add(request)
    tokens: list[int] = []
    first_n, first_t, last_t, steps, forced = 0, None, None, 0, 0
    while engine.busy():
        progress = engine.advance()
        now = time.perf_counter()
        steps += 1
        for p in progress:
            if p.id != rid:
                continue
            if p.tokens:
                if first_t is None:
                    first_t, first_n = now, len(tokens) + len(p.tokens)
                last_t = now
            tokens += p.tokens
            if p.end:
                forced = p.forced_tokens
        if timer is not None and any(p.id == rid and (p.tokens or p.end) for p in progress):
            timer.end_step()  # one sampled token per step at batch 1 (add()'s look-ahead goes in the first)
    decode_s = (last_t - first_t) if first_t is not None and last_t is not None else 0.0
    return {"tokens": tokens, "decoded": len(tokens) - first_n, "decode_s": decode_s, "steps": steps,
            "forced": forced}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant kernels: jump-forward on and off then give the same tokens")
    args = ap.parse_args()

    model = superslm.load(args.model, device=args.device)
    engine = model.engine(slots=1, context=512, deterministic=args.deterministic)
    engine.generate([Request(model.chat_tokens([{"role": "user", "content": "Hi"}]), 4)])  # warm-up
    totals = {k: [0.0, 0] for k in ("off", "plain", "on")}  # seconds, tokens
    ratios: list[float] = []
    masks_on, masks_off = MaskTimer(), MaskTimer()
    forced = produced = differ = 0
    for rep in range(args.repeats):
        rep_s = {k: [0.0, 0] for k in totals}
        for name, ask in ASKS.items():
            schema = json.loads((SCHEMAS / f"{name}.json").read_text())
            prompt = model.chat_tokens([{"role": "user", "content": ask}])
            grammar = Sampling(grammar=Constraint.json_schema(schema))
            engine.jump_forward = False
            with masks_off:
                off = run(engine, Request(prompt, args.max_tokens, grammar), masks_off)
            plain = run(engine, Request(prompt, len(off["tokens"]), Sampling(ignore_eos=True)))
            engine.jump_forward = True
            with masks_on:
                on = run(engine, Request(prompt, args.max_tokens, grammar), masks_on)
            # a forced run is computed as a multi-token chunk: outside deterministic mode its logits may
            # differ in the last bits from one-token steps, and a near-tie can then flip
            differ += on["tokens"] != off["tokens"]
            for key, r in (("off", off), ("plain", plain), ("on", on)):
                rep_s[key][0] += r["decode_s"]
                rep_s[key][1] += r["decoded"]
            if rep == 0:
                forced += on["forced"]
                produced += len(on["tokens"])
        for key in totals:
            totals[key][0] += rep_s[key][0]
            totals[key][1] += rep_s[key][1]
        ratios.append((rep_s["off"][0] / rep_s["off"][1]) / (rep_s["plain"][0] / rep_s["plain"][1]))

    ms = {k: 1e3 * s / n for k, (s, n) in totals.items()}
    tps = {k: n / s for k, (s, n) in totals.items()}
    on_ms, off_ms = np.array(masks_on.per_step) * 1e3, np.array(masks_off.per_step) * 1e3
    overhead = ms["off"] / ms["plain"] - 1
    cpu = platform.processor() or platform.machine()
    print(f"model {model.name} on {args.device}, {torch.get_num_threads()} threads, {cpu}")
    print(f"{len(ASKS)} schema prompts x {args.repeats} repeats, batch 1, {produced} tokens per pass "
          f"({forced} forced, {100 * forced / max(produced, 1):.0f}%)")
    print("| run | decode ms/token | tokens/s |")
    print("|---|---|---|")
    print(f"| unconstrained | {ms['plain']:.1f} | {tps['plain']:.1f} |")
    print(f"| JSON schema, jump-forward off | {ms['off']:.1f} | {tps['off']:.1f} |")
    print(f"| JSON schema, jump-forward on | {ms['on']:.1f} | {tps['on']:.1f} |")
    print(f"constrained vs unconstrained: {100 * overhead:+.1f}% per token "
          f"(per repeat: {', '.join(f'{100 * (r - 1):+.1f}%' for r in ratios)}; median "
          f"{100 * (statistics.median(ratios) - 1):+.1f}%)")
    print(f"jump-forward speed-up: {tps['on'] / tps['off']:.2f}x tokens/s "
          f"({differ} of {len(ASKS) * args.repeats} answers differ from jump-forward off"
          f"{'' if args.deterministic else '; deterministic mode off'})")
    for label, arr in (("jump-forward off", off_ms), ("jump-forward on", on_ms)):
        print(f"mask time per sampled token ({label}, {len(arr)} steps): mean {arr.mean():.3f} ms, "
              f"p50 {np.percentile(arr, 50):.3f} ms, p99 {np.percentile(arr, 99):.3f} ms, max {arr.max():.3f} ms")
    print(f"date {datetime.date.today().isoformat()}")


if __name__ == "__main__":
    main()
