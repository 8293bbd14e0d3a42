"""Structured-output benchmark: what a JSON-schema constraint costs per decoded token, and what
jump-forward gains, at batch 1 on the default model (SmolLM2-135M-Instruct), one run.

    python benchmarks/structured.py [--model PATH_OR_NAME] [--device cpu] [--repeats 3] [--max-tokens 96]

For each of a few schema prompts (from tests/schemas/), three runs of the same request:

- constrained, jump-forward off: every token masked and sampled, one per step;
- unconstrained (ignore_eos), as many tokens as the constrained answer had: same positions, no mask;
- constrained, jump-forward on (the default): forced tokens appended without sampling and run
  through the model in the next step's chunk (with --deterministic the tokens equal the
  jump-forward-off run's; without, a near-tie may flip: the count is printed).

Decode time per token is each engine step's wall time (the steps after the first token: prefill
excluded) over the tokens it gave, reported as the median step (robust to a shared machine's
bursts) and as the mean. The mask time per sampled token is the grammar's work in a step, timed by
wrapping the engine's calls: llguidance's mask computation (`GrammarState._compute`), `accept`,
`take_forced` (jump-forward look-ahead), `fill_bitmasks` and `apply_token_bitmask`; and again by
replaying each answer's tokens through the same calls outside the engine (the fastest of 5 replays
per token, so a busy machine's bursts drop out). The runs are interleaved per prompt (the unconstrained one alternately
before and after) and repeated, so the machine's noise hits all three alike; the ratios mean more
than the absolute numbers on a shared machine.
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
    """Wraps the engine's grammar calls and adds up their time per engine step: wall time, and the
    calling thread's CPU time (at batch 1 the mask is computed in that thread; CPU time does not
    count the moments a busy shared machine takes the core away)."""

    def __init__(self) -> None:
        self.step = self.step_cpu = 0.0
        self.per_step: list[float] = []
        self.per_step_cpu: list[float] = []
        self._undo: list[Callable[[], None]] = []
        self._depth = 0

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # inside another timed call: counted there
                return original(*args, **kwargs)
            self._depth += 1
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.step += time.perf_counter() - t
                self.step_cpu += time.thread_time() - c
                self._depth -= 1

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> MaskTimer:
        # the engine imports fill_bitmasks from superslm.grammar at each step, and sample() calls the
        # module-level apply_token_bitmask: patching those names reaches the engine's calls
        # _compute is llguidance's mask computation: the engine triggers it after accepting a token
        # (GrammarState.is_dead), so that the next step's fill_bitmasks only copies the mask
        self._wrap(GrammarState, "take_forced")
        self._wrap(GrammarState, "accept")
        self._wrap(GrammarState, "_compute")
        self._wrap(superslm.grammar, "fill_bitmasks")
        self._wrap(sampler_module, "apply_token_bitmask")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def end_step(self) -> None:
        self.per_step.append(self.step)
        self.per_step_cpu.append(self.step_cpu)
        self.step = self.step_cpu = 0.0


def run(engine: Engine, request: Request, timer: MaskTimer | None = None) -> dict[str, Any]:
    """Run one request alone: its tokens, forced count, and the wall time of each decode step
    (the steps after the one that gave the first token) with the tokens it gave."""
    rid = engine.add(request)
    tokens: list[int] = []
    steps: list[tuple[float, int]] = []  # (seconds, tokens) per decode step
    started, forced = False, 0
    while engine.busy():
        t = time.perf_counter()
        progress = engine.advance()
        took = time.perf_counter() - t
        mine = [p for p in progress if p.id == rid]
        got = sum(len(p.tokens) for p in mine)
        if started and got:
            steps.append((took, got))
        started = started or got > 0
        tokens += [tok for p in mine for tok in p.tokens]
        forced = max([forced] + [p.forced_tokens for p in mine if p.end])
        if timer is not None and any(p.tokens or p.end for p in mine):
            timer.end_step()  # one sampled token per step at batch 1 (add()'s look-ahead goes in the first)
    return {"tokens": tokens, "steps": steps, "forced": forced}


def replay_mask_times(model: superslm.Model, constraint: Constraint, tokens: list[int], jump_forward: bool,
                      repeats: int = 5) -> list[float]:
    """The grammar's work per sampled token, replaying an answer's tokens outside the engine as the
    engine does it (take_forced with jump-forward, fill_bitmasks, apply_token_bitmask, accept):
    per sampled token the fastest of `repeats` replays, so a busy machine's bursts drop out."""
    compiler = superslm.grammar.compiler_for(model.tokenizer, model.arch.vocab)
    grammar = compiler.compile(constraint)
    logits = torch.zeros(1, compiler.vocab_size)
    best: list[float] = []
    for _ in range(repeats):
        state, i, times = GrammarState(grammar), 0, []
        while i < len(tokens):
            t = time.perf_counter()
            if jump_forward:
                i += len(state.take_forced(len(tokens) - i))
            bitmask = torch.full((1, compiler.bitmask_words), -1, dtype=torch.int32)
            superslm.grammar.fill_bitmasks([state], bitmask)
            sampler_module.apply_token_bitmask(logits, bitmask)
            if i < len(tokens):
                state.accept(tokens[i])
                i += 1
            times.append(time.perf_counter() - t)
        best = times if not best else [min(a, b) for a, b in zip(best, times)]
    return best


def per_token(steps: list[tuple[float, int]]) -> float:
    """Mean seconds per token: all decode time over all tokens (bursts of a shared machine count)."""
    return sum(sec for sec, _ in steps) / sum(n for _, n in steps)


def robust_rate(steps: list[tuple[float, int]]) -> tuple[float, float, float]:
    """(median step seconds, tokens per step, tokens/s = tokens per step / median step): the step
    count is exact and the median step drops a shared machine's bursts."""
    median = statistics.median(sec for sec, _ in steps)
    per_step = sum(n for _, n in steps) / len(steps)
    return median, per_step, per_step / median


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
    warm = Sampling(grammar=Constraint.json_object())
    engine.generate([Request(model.chat_tokens([{"role": "user", "content": "Hi"}]), 8, warm)])  # warm-up
    steps: dict[str, list[tuple[float, int]]] = {"plain": [], "off": [], "on": []}
    speedups: list[float] = []  # per request: tokens/s with jump-forward on / off
    masks_on, masks_off = MaskTimer(), MaskTimer()
    forced = produced = differ = 0
    answers: list[tuple[Constraint, list[int], list[int]]] = []  # (constraint, off tokens, on tokens)
    for rep in range(args.repeats):
        for k, (name, ask) in enumerate(ASKS.items()):
            schema = json.loads((SCHEMAS / f"{name}.json").read_text())
            prompt = model.chat_tokens([{"role": "user", "content": ask}])
            grammar = Sampling(grammar=Constraint.json_schema(schema))
            engine.jump_forward = False
            with masks_off:
                off = run(engine, Request(prompt, args.max_tokens, grammar), masks_off)
            plain_request = Request(prompt, len(off["tokens"]), Sampling(ignore_eos=True))
            engine.jump_forward = True
            # alternate which run comes first, so that a drift of the machine does not favour one
            first_plain = (rep + k) % 2 == 0
            plain = run(engine, plain_request) if first_plain else None
            with masks_on:
                on = run(engine, Request(prompt, args.max_tokens, grammar), masks_on)
            plain = plain or run(engine, plain_request)
            # a forced run is computed as a multi-token chunk: outside deterministic mode its logits may
            # differ in the last bits from one-token steps, and a near-tie can then flip
            differ += on["tokens"] != off["tokens"]
            for key, r in (("plain", plain), ("off", off), ("on", on)):
                steps[key] += r["steps"]
            if off["steps"] and on["steps"]:
                speedups.append(robust_rate(on["steps"])[2] / robust_rate(off["steps"])[2])
            if rep == 0:
                forced += on["forced"]
                produced += len(on["tokens"])
                answers.append((grammar.grammar, off["tokens"], on["tokens"]))  # type: ignore[arg-type]

    mean = {k: per_token(v) * 1e3 for k, v in steps.items()}
    robust = {k: robust_rate(v) for k, v in steps.items()}
    cpu = platform.processor() or platform.machine()
    print(f"model {model.name} on {args.device}, {torch.get_num_threads()} threads, {cpu}, "
          f"{datetime.date.today().isoformat()}{', deterministic' if args.deterministic else ''}")
    print(f"{len(ASKS)} schema prompts x {args.repeats} repeats, batch 1, {produced} tokens per pass "
          f"({forced} forced by jump-forward, {100 * forced / max(produced, 1):.0f}%)")
    print("| run | decode step, median | tokens/step | tokens/s (median step) | ms/token (mean) |")
    print("|---|---|---|---|---|")
    labels = {"plain": "unconstrained", "off": "JSON schema, jump-forward off", "on": "JSON schema, jump-forward on"}
    for key in ("plain", "off", "on"):
        med, per_step, rate = robust[key]
        print(f"| {labels[key]} | {med * 1e3:.2f} ms | {per_step:.2f} | {rate:.1f} | {mean[key]:.1f} |")
    print(f"constrained vs unconstrained, per token: {100 * (robust['off'][0] / robust['plain'][0] - 1):+.1f}% "
          f"(median steps), {100 * (mean['off'] / mean['plain'] - 1):+.1f}% (means)")
    print(f"jump-forward speed-up, tokens/s: {robust['on'][2] / robust['off'][2]:.2f}x (median steps), "
          f"{mean['off'] / mean['on']:.2f}x (means), median of {len(speedups)} requests "
          f"{statistics.median(speedups):.2f}x ({differ} of {len(speedups)} answers differ from "
          f"jump-forward off{'' if args.deterministic else '; not in deterministic mode'})")

    def show(label: str, values: list[float]) -> None:
        arr = np.array(values) * 1e3
        print(f"mask time per sampled token, {label} ({len(arr)} tokens): mean {arr.mean():.3f} ms, "
              f"p50 {np.percentile(arr, 50):.3f} ms, p99 {np.percentile(arr, 99):.3f} ms, max {arr.max():.3f} ms")

    show("in the engine, jump-forward off, wall", masks_off.per_step)
    show("in the engine, jump-forward on, wall", masks_on.per_step)
    show("in the engine, jump-forward on, thread CPU", masks_on.per_step_cpu)
    show("replayed (fastest of 5), jump-forward off", [t for c, off, _ in answers
                                                       for t in replay_mask_times(model, c, off, False)])
    show("replayed (fastest of 5), jump-forward on", [t for c, _, on in answers
                                                      for t in replay_mask_times(model, c, on, True)])


if __name__ == "__main__":
    main()
