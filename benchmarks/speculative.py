"""Speculative decoding (n-gram prompt lookup): SuperSLM's plain and `speculative="ngram"` decode beside llama.cpp's
plain decode and its prompt-lookup decoding (`LlamaPromptLookupDecoding`), on the same GGUF, in alternating rounds.

    python -m benchmarks.speculative [--models smollm2-135m-instruct,gemma-3-270m] [--decode 256] [--rounds 3]
                                     [--threads 2] [--batches 1,8] [--workloads rewrite,extract,story]
                                     [--engines ours,ours-ngram,ours-det,ours-ngram-det,llama,llama-pld10,...]
                                     [--exact-rounds 1] [--profile]

Workloads, greedy (temperature 0), `--decode` tokens each (EOS ignored, so every engine decodes the same count):
- "rewrite" (copy-heavy): a 30-line Python function (~340 tokens) in the prompt, the answer asked to repeat it with
  one variable renamed; at batch 8 each sequence renames a different variable;
- "extract" (copy-heavy): a ~300-token contract in the prompt, the answer asked for 18 fields as `field: value`
  lines quoting it; at batch 8 each sequence asks for the fields in another order;
- "story" (open prose): "Write a story about ...", a different topic for each of the 8 sequences.
A model with a chat template gets the request as a user message (SmolLM2-135M-Instruct), a base model (Gemma 3
270M) as plain text ending where the answer starts. Each prompt is tokenized once by SuperSLM's tokenizer and fed
as ids to both engines.

Per model and round, each engine in a fresh process (superslm.bench.run_engine), the engines in turn, in the same
order every round; in it, a warm-up (16 prompt tokens, 4 decoded), then each workload at each batch:
- decode tok/s excludes the prefill: at batch 1 the clock starts when the first token arrives (it comes from the
  prefill step) and stops at the last: (tokens after the first) / that time; at batch 8, from the moment the last
  of the 8 sequences got its first token (every prompt prefilled) to the last token of any, over the tokens that
  arrived in that window (those of the sequences that started earlier included only from then on);
- SuperSLM: `model.engine(slots=batch, prefix_caching=False, adaptive_threads=False, speculative=None or
  "ngram")`, its default load, `superslm.set_threads(threads)`; "ours-det" and "ours-ngram-det" are the same in
  deterministic mode (`deterministic=True`), run in the first `--exact-rounds` rounds: the benchmark asserts that
  they give the same greedy tokens, every sequence of every workload and batch (exit code 1 if not). In the
  default mode the verify step's rows may round differently from one-row steps (other kernels at other row
  counts), so a near-tie can go the other way: "ours-ngram" against "ours" is reported, not asserted;
- llama.cpp (batch 1 only: its Python API decodes one sequence): `llama_cpp.Llama(path, n_ctx=prompt + decode +
  64, n_threads=n_threads_batch=threads, n_batch=512)`, its extra buffer types off (kv_speed.py: AMX segfaults on
  this project's Xeon VM), tokens from `Llama.generate(ids, temp=0)` (the binding's greedy sampler); "llama-pldN"
  passes `draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N)` (max_ngram_size 2, its default), which makes
  the binding keep every row's logits (logits_all) as it needs them to verify the drafts (passed explicitly too:
  the binding sizes its score rows by the argument, n_batch rows without it, too few for prompt + drafts).
`--profile` (ours engines) adds, per workload and batch, the steps taken, the drafts proposed and kept, and the
mean time of a step by the rows it carried (1 row per sequence, or more: drafts to verify).
Prints each round's figures, then per model the median of the rounds, the best llama-pld setting per workload,
and the ratios: ours-ngram / ours, ours-ngram / llama-pld (best), ours-ngram / llama; the load average at the
start and the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

from benchmarks.kv_speed import _no_extra_buffer_types
from superslm.bench import run_engine

ENGINES = ("ours", "ours-ngram", "ours-det", "ours-ngram-det", "llama", "llama-pld10", "llama-pld4", "llama-pld2")
#: the engines whose greedy tokens must be equal, every sequence of every workload and batch
EXACT = ("ours-det", "ours-ngram-det")
WORKLOADS = ("rewrite", "extract", "story")
COPY_HEAVY = ("rewrite", "extract")

CODE = '''def summarize_orders(orders, tax_rate=0.08, min_total=0.0):
    """Group orders by customer and return each customer's totals, largest first."""
    totals = {}
    for order in orders:
        customer = order["customer"].strip().lower()
        subtotal = 0.0
        for item in order["items"]:
            price = float(item["price"])
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                raise ValueError(f"bad quantity {quantity} in order {order['id']}")
            subtotal += price * quantity
        discount = order.get("discount", 0.0)
        if discount:
            subtotal -= subtotal * discount
        tax = subtotal * tax_rate
        entry = totals.setdefault(customer, {"orders": 0, "subtotal": 0.0, "tax": 0.0})
        entry["orders"] += 1
        entry["subtotal"] += subtotal
        entry["tax"] += tax
    result = []
    for customer, entry in totals.items():
        total = entry["subtotal"] + entry["tax"]
        if total < min_total:
            continue
        result.append({"customer": customer, "orders": entry["orders"],
                       "subtotal": round(entry["subtotal"], 2), "tax": round(entry["tax"], 2),
                       "total": round(total, 2)})
    result.sort(key=lambda row: row["total"], reverse=True)
    return result
'''

RENAMES = (("subtotal", "net_amount"), ("totals", "by_customer"), ("entry", "record"), ("customer", "client"),
           ("quantity", "count"), ("price", "unit_price"), ("discount", "rebate"), ("result", "rows"))

DOC = """MAINTENANCE CONTRACT No. 2024-117
Date of agreement: 14 March 2024. Term: twelve months from 1 April 2024.

Client: Harbor View Apartments LLC, 1820 Shoreline Drive, Unit 4, Portland, Oregon 97209.
Client contact: Margaret Ellison, property manager, phone (503) 555-0142, email m.ellison@harborview-apts.com.

Contractor: Northwind Mechanical Services Inc., 77 Industrial Way, Beaverton, Oregon 97005.
Contractor contact: David Okafor, service director, phone (503) 555-0187, email dokafor@northwind-mech.com.

Scope: quarterly inspection of the two rooftop boiler units and the hot water circulation pumps; annual
cleaning of the ventilation ducts in buildings A and B; emergency repairs within four hours of a call,
at any time of day. Parts are billed at cost plus ten percent.

Fee: 18,400 US dollars a year, paid in four installments of 4,600 US dollars, due on the first business day
of each quarter. Late payments carry interest of one percent a month.

Termination: either party may end this contract with sixty days written notice sent to the contact above.
Governing law: the laws of the State of Oregon. Signed for the client by Margaret Ellison and for the
contractor by David Okafor.
"""

FIELDS = ("contract number", "date of agreement", "term", "client name", "client address", "client contact name",
          "client phone", "client email", "contractor name", "contractor address", "contractor contact name",
          "contractor phone", "contractor email", "scope", "fee", "payment schedule", "termination notice",
          "governing law")

TOPICS = ("a lighthouse keeper who finds a robot on the beach", "a girl who can talk to birds",
          "a baker who opens a shop on the moon", "an old dog that learns to surf",
          "two friends lost in a desert city", "a dragon that is afraid of fire",
          "a clockmaker who stops time by accident", "a boy who finds a map in a library book")


def requests(workload: str, i: int) -> tuple[str, str]:
    """(the user's request, the answer's first words for a base model) of sequence i of a workload."""
    if workload == "rewrite":
        old, new = RENAMES[i % len(RENAMES)]
        return (f"Rewrite this Python function with the variable `{old}` renamed to `{new}`; change nothing else."
                f"\n\n```python\n{CODE}```", "```python\n")
    if workload == "extract":
        k = 2 * i % len(FIELDS)  # the same fields, asked for from another one on
        fields = ", ".join(FIELDS[k:] + FIELDS[:k])
        return (f"{DOC}\nFrom the contract above, extract these fields, one per line as `field: value`, quoting "
                f"the contract's words: {fields}.", f"Extracted fields:\n{FIELDS[k]}:")
    if workload == "story":
        return f"Write a story about {TOPICS[i % len(TOPICS)]}.", "Story:\n"
    raise ValueError(workload)


def prompts(path: str, workloads: list[str], batch: int) -> dict[str, list[list[int]]]:
    """workload -> `batch` prompts as ids, by SuperSLM's tokenizer (the chat template where the model has one)."""
    import superslm

    model = superslm.load(path, device="cpu")
    out: dict[str, list[list[int]]] = {}
    for w in workloads:
        out[w] = []
        for i in range(batch):
            user, lead = requests(w, i)
            if model.chat_template is not None:
                out[w].append(model.chat_tokens([{"role": "user", "content": user}]))
            else:
                out[w].append(model.tokenizer.encode(f"{user}\n\n{lead}", add_special_tokens=True))
    return out


class StepTimes:
    """Wraps an engine's `advance` to time each decode step by the rows it ran (engine.runner.run's StepWork)."""

    def __init__(self, engine: Any) -> None:
        #: rows of a decode step (its sequences' newest tokens and drafts) -> each such step's seconds
        self.by_rows: dict[int, list[float]] = {}
        self._rows = 0
        self._engine = engine
        run, advance = engine.runner.run, engine.advance

        def counted_run(*a: Any, **kw: Any) -> Any:
            work = run(*a, **kw)
            if work is not None:  # prefill chunks (rows not sampled) are another cost: left out
                self._rows = -1 if any(r < 0 for r in work.sample_rows) else len(work.tokens)
            return work

        def timed_advance(*a: Any, **kw: Any) -> Any:
            self._rows = -1
            t = time.perf_counter()
            out = advance(*a, **kw)
            if self._rows > 0:
                self.by_rows.setdefault(self._rows, []).append(time.perf_counter() - t)
            return out

        engine.runner.run, engine.advance = counted_run, timed_advance

    def close(self) -> None:
        """The engine's own methods again (the wrappers are instance attributes over them)."""
        del self._engine.runner.run, self._engine.advance

    def summary(self) -> dict[int, tuple[float, int]]:
        """rows -> (mean ms of a step, steps)."""
        return {r: (1e3 * statistics.mean(v), len(v)) for r, v in sorted(self.by_rows.items())}


def timed_batch(engine: Any, ids: list[list[int]], decode: int,
                samplings: list[Any] | None = None) -> tuple[float, list[list[int]], float]:
    """(decode tok/s, each request's tokens, prefill s) of the requests run together (see the docstring): `decode`
    tokens each with EOS ignored, or at most that many with `samplings` of their own."""
    from superslm import Request, Sampling

    t0 = time.perf_counter()
    rids = [engine.add(Request(p, decode, s))
            for p, s in zip(ids, samplings or [Sampling(ignore_eos=True)] * len(ids), strict=True)]
    got: dict[int, list[int]] = {r: [] for r in rids}
    arrivals: list[tuple[float, int]] = []  # (time, tokens) of every progress after a sequence's first token
    started = 0.0
    while engine.busy():
        for p in engine.advance():
            if not p.tokens:
                continue
            now = time.perf_counter()
            if not got[p.id]:
                started = now  # the last of these is when every prompt is prefilled
                got[p.id] += p.tokens
                arrivals.append((now, len(p.tokens) - 1))
            else:
                got[p.id] += p.tokens
                arrivals.append((now, len(p.tokens)))
    if samplings is None and any(len(t) != decode for t in got.values()):
        raise RuntimeError(f"tokens decoded {[len(t) for t in got.values()]}, not {decode} each")
    window = [(t, n) for t, n in arrivals if t > started]
    end = max(t for t, _ in window)
    return sum(n for _, n in window) / (end - started), [got[r] for r in rids], started - t0


def bench_ours(path: str, work: dict[str, list[list[int]]], batches: list[int], decode: int, threads: int,
               speculative: str | None, deterministic: bool, profile: bool) -> dict[str, Any]:
    import superslm
    from superslm import Request, Sampling

    superslm.set_threads(threads)
    model = superslm.load(path, device="cpu")
    longest = max(len(p) for ps in work.values() for p in ps)
    out: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    for b in batches:
        engine = model.engine(slots=b, context=longest + decode + 16, prefix_caching=False, adaptive_threads=False,
                              speculative=speculative, deterministic=deterministic)
        engine.generate([Request(next(iter(work.values()))[0][:16], 4, Sampling(ignore_eos=True))])  # warm-up
        for w, ps in work.items():
            times = StepTimes(engine) if profile else None
            st0 = engine.stats()
            tps, tokens, prefill_s = timed_batch(engine, ps[:b], decode)
            st = engine.stats()
            res: dict[str, Any] = {"tps": tps, "tokens": tokens, "prefill_s": prefill_s,
                                   "steps": st["steps"] - st0["steps"],
                                   "proposed": st["drafts_proposed"] - st0["drafts_proposed"],
                                   "accepted": st["drafts_accepted"] - st0["drafts_accepted"],
                                   "draft_steps": st["draft_steps"] - st0["draft_steps"]}
            if times is not None:
                res["step_ms"] = times.summary()
                times.close()
            out[f"{w}/{b}"] = res
    out["load"].append(os.getloadavg()[0])
    return out


def bench_llama(path: str, work: dict[str, list[list[int]]], decode: int, threads: int, pld: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    _no_extra_buffer_types()
    longest = max(len(ps[0]) for ps in work.values())
    draft = LlamaPromptLookupDecoding(num_pred_tokens=pld) if pld else None
    llm = llama_cpp.Llama(model_path=path, n_ctx=longest + decode + 64, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, draft_model=draft, logits_all=draft is not None,
                          verbose=False)
    llm.eval(next(iter(work.values()))[0][:16])  # warm-up
    out: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    for w, ps in work.items():
        llm.reset()
        t0 = time.perf_counter()
        tokens: list[int] = []
        first = last = 0.0
        for tok in llm.generate(ps[0], temp=0.0, reset=True):
            last = time.perf_counter()
            first = first or last
            tokens.append(int(tok))
            if len(tokens) == decode:
                break
        out[f"{w}/1"] = {"tps": (decode - 1) / (last - first), "tokens": [tokens], "prefill_s": first - t0}
    out["load"].append(os.getloadavg()[0])
    return out


def run_one(engine: str, path: str, work: dict[str, list[list[int]]], batches: list[int], decode: int,
            threads: int, profile: bool) -> dict[str, Any]:
    if engine.startswith("ours"):
        return run_engine(engine, path, work, batches, decode, threads, "ngram" if "ngram" in engine else None,
                          engine.endswith("-det"), profile, bench=bench_ours)
    one = {w: ps[:1] for w, ps in work.items()}
    return run_engine(engine, path, one, decode, threads, int(engine.removeprefix("llama-pld") or 0)
                      if engine != "llama" else 0, bench=bench_llama)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (their common length where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m", help="known names (hub.fetch)")
    ap.add_argument("--decode", type=int, default=256, help="greedy tokens per sequence (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8", help="concurrent sequences in our engine (llama.cpp: 1 only)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated, in the order each round runs them: of {', '.join(ENGINES)}")
    ap.add_argument("--profile", action="store_true", help="ours engines: step times by rows")
    ap.add_argument("--exact-rounds", type=int, default=1,
                    help=f"rounds that run {' and '.join(EXACT)} (the exactness check; default 1)")
    args = ap.parse_args()
    engines, workloads = args.engines.split(","), args.workloads.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    bad = [e for e in engines if e not in ENGINES] + [w for w in workloads if w not in WORKLOADS]
    if bad or args.rounds < 1 or args.decode < 2 or min(batches) < 1:
        ap.error(f"unknown {bad}" if bad else "--rounds >= 1, --decode >= 2, batches >= 1")
    import llama_cpp

    from superslm import hub

    print(f"{platform.machine()}, {os.cpu_count()} cpus, {args.threads} threads, llama-cpp-python "
          f"{llama_cpp.__version__}, {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {loadavg()}; decode "
          f"{args.decode}, batches {batches}", flush=True)
    failed = False
    summary: list[str] = []
    for name in args.models.split(","):
        path = str(hub.fetch(name, progress=False))
        work = prompts(path, workloads, max(batches))
        print(f"\n{name}: {path} ({os.path.getsize(path) / 2**20:.0f} MB), prompts "
              + ", ".join(f"{w} {min(map(len, ps))}-{max(map(len, ps))}" for w, ps in work.items()), flush=True)
        # (engine, "workload/batch") -> per-round results
        got: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            results = {}
            for e in engines:
                if e in EXACT and r >= args.exact_rounds:
                    continue
                res = run_one(e, path, work, batches, args.decode, args.threads, args.profile)
                results[e] = res
                if "error" in res:
                    failed = True
                    print(f"  round {r + 1} {e:12} failed: {res['error']}", flush=True)
                    continue
                for key, x in res.items():
                    if key == "load":
                        continue
                    got.setdefault((e, key), []).append(x)
                    extra = ""
                    if x.get("proposed"):
                        extra = (f"; {x['steps']} steps, drafts {x['accepted']}/{x['proposed']} kept "
                                 f"({x['accepted'] / x['proposed']:.0%}) in {x['draft_steps']} sequence-steps")
                    if "step_ms" in x:
                        extra += "; ms a step by rows " + ", ".join(f"{k}: {ms:.1f} x{n}"
                                                                     for k, (ms, n) in x["step_ms"].items())
                    print(f"  round {r + 1} {e:12} {key:10} decode {x['tps']:7.1f} tok/s, prefill "
                          f"{x['prefill_s']:.2f} s{extra}", flush=True)
                print(f"  round {r + 1} {e:12} load average {res['load'][0]:.2f} -> {res['load'][1]:.2f}", flush=True)
            # the same greedy tokens with and without drafts: the claim speculation rests on. Exact in deterministic
            # mode; the default mode's multi-row steps may round a near-tie the other way (reported, not failed)
            for plain, spec in (EXACT, ("ours", "ours-ngram")):
                a, b = results.get(plain, {}), results.get(spec, {})
                for key in sorted(a.keys() & b.keys() - {"load", "error"}):
                    diff = [(i, first_difference(x, y)) for i, (x, y) in enumerate(zip(a[key]["tokens"],
                                                                                         b[key]["tokens"])) if x != y]
                    if diff:
                        failed = failed or plain in EXACT
                        print(f"  round {r + 1} {'MISMATCH' if plain in EXACT else 'default mode:'} {key}: {spec} "
                              f"differs from {plain} in {len(diff)} sequences, from tokens "
                              f"{[d for _, d in diff]}", flush=True)
                    elif plain in EXACT:
                        print(f"  round {r + 1} {key}: {spec} tokens equal to {plain}'s", flush=True)
            for e in engines:
                if e.startswith("llama-pld") and "error" not in results.get(e, {"error": 1}) \
                        and "error" not in results.get("llama", {"error": 1}):
                    same = [first_difference(results["llama"][k]["tokens"][0], results[e][k]["tokens"][0])
                            for k in results[e] if k != "load"]
                    print(f"  round {r + 1} {e} tokens equal to llama's for the first {same} (of {args.decode})")
        summary += report(name, engines, workloads, batches, got, args.rounds)
    print("\n".join(summary))
    print(f"\nload average at the end {loadavg()}")
    return 1 if failed else 0


def report(name: str, engines: list[str], workloads: list[str], batches: list[int],
           got: dict[tuple[str, str], list[dict[str, Any]]], rounds: int) -> list[str]:
    """The model's table: median decode tok/s of the rounds per engine, workload and batch, and the ratios."""
    def median(e: str, w: str, b: int) -> float | None:
        v = [x["tps"] for x in got.get((e, f"{w}/{b}"), [])]
        return statistics.median(v) if v else None

    def fmt(v: float | None) -> str:
        return "" if v is None else f"{v:.1f}"

    plds = [e for e in engines if e.startswith("llama-pld")]
    lines = [f"\n{name} (median decode tok/s of {rounds} rounds, the -det engines' of theirs; llama.cpp at batch 1 "
             "only, the same figure beside both batches)",
             "| workload | batch | " + " | ".join(engines)
             + " | ngram / ours | ngram / best pld | ngram / llama | drafts kept (ours-ngram) | steps |",
             "|---|---|" + "---|" * len(engines) + "---|---|---|---|---|"]
    for w in workloads:
        for b in batches:
            v = {e: median(e, w, 1 if e.startswith("llama") else b) for e in engines}
            spec = v.get("ours-ngram")
            best = max((v[e] for e in plds if v[e] is not None), default=None)
            ratio = [f"{spec / x:.2f}x" if spec and x else "" for x in (v.get("ours"), best, v.get("llama"))]
            runs = got.get(("ours-ngram", f"{w}/{b}"), [])
            kept = steps = ""
            if runs:
                p, a = sum(x["proposed"] for x in runs), sum(x["accepted"] for x in runs)
                kept = f"{a / p:.0%} of {p // len(runs)}" if p else "0"
                steps = f"{statistics.median(x['steps'] for x in runs):.0f}"
            lines.append(f"| {w} | {b} | " + " | ".join(fmt(v[e]) for e in engines)
                         + f" | {' | '.join(ratio)} | {kept} | {steps} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
