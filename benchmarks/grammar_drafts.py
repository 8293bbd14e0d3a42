"""Speculative decoding under a JSON schema: SuperSLM's plain and `speculative="ngram"` decode of a structured
extraction, beside llama.cpp's grammar-constrained decode with and without prompt lookup, on the same GGUF.

    python -m benchmarks.grammar_drafts [--model smollm2-135m-instruct] [--rounds 3] [--threads 2] [--batches 1,8]
                                        [--max-tokens 400] [--no-llama]

The workload: benchmarks/speculative.py's ~300-token contract in the prompt, the answer constrained to a JSON object
of its 18 fields (strings, all required, in the order the request lists them; at batch 8 each sequence lists them
from another field on), greedy, ending where the grammar ends (or at --max-tokens). Drafts there come from the
lookup (values quoted from the contract, cut where the schema refuses them) and from the bytes the grammar forces
(keys, quotes and colons where their spelling in tokens is open).

Per round, in one process each: ours plain and ours ngram at each batch (the engine built once per batch, a warm-up
first, `prefix_caching=False`), in turn; then llama.cpp at batch 1 (`LlamaGrammar.from_json_schema`, greedy, with
and without `LlamaPromptLookupDecoding(num_pred_tokens=10)`) in a process of its own. Decode tok/s counts the tokens
after each sequence's first over the time from the last first token to the last token (as benchmarks/speculative.py).
The ours engines' tokens are compared (equal in deterministic mode by construction; the default mode may round a
near tie otherwise: reported). Prints each round, then medians, the ratios and the load average.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from benchmarks.speculative import DOC, FIELDS, timed_batch


def schema(order: list[str]) -> dict[str, Any]:
    keys = [f.replace(" ", "_") for f in order]
    return {"type": "object", "properties": {k: {"type": "string", "maxLength": 160} for k in keys},
            "required": keys, "additionalProperties": False}


def work(i: int) -> tuple[str, dict[str, Any]]:
    k = 2 * i % len(FIELDS)
    order = list(FIELDS[k:] + FIELDS[:k])
    user = (f"{DOC}\nFrom the contract above, extract these fields as a JSON object, quoting the contract's words: "
            f"{', '.join(order)}.")
    return user, schema(order)


def bench_ours(path: str, batches: list[int], max_tokens: int, threads: int, deterministic: bool) -> dict[str, Any]:
    import superslm
    from superslm import Request, Sampling
    from superslm.grammar import Constraint

    superslm.set_threads(threads)
    model = superslm.load(path, device="cpu")
    items = [work(i) for i in range(max(batches))]
    prompts = [model.chat_tokens([{"role": "user", "content": u}]) for u, _ in items]
    out: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    for b in batches:
        for spec in (None, "ngram"):
            engine = model.engine(slots=b, context=max(map(len, prompts)) + max_tokens + 16, prefix_caching=False,
                                  adaptive_threads=False, speculative=spec, deterministic=deterministic)
            engine.generate([Request(prompts[0][:16], 4, Sampling(ignore_eos=True))])  # warm-up
            samplings = [Sampling(grammar=Constraint.json_schema(s, max_whitespace=0)) for _, s in items[:b]]
            st0 = engine.stats()
            tps, tokens, _ = timed_batch(engine, prompts[:b], max_tokens, samplings)
            st = engine.stats()
            texts = [model.tokenizer.decode(t) for t in tokens]
            valid = sum(_valid(t, s) for t, (_, s) in zip(texts, items))
            out[f"{'ngram' if spec else 'plain'}/{b}"] = {
                "tps": tps, "tokens": tokens, "valid": valid, "steps": st["steps"] - st0["steps"],
                "proposed": st["drafts_proposed"] - st0["drafts_proposed"],
                "accepted": st["drafts_accepted"] - st0["drafts_accepted"]}
    out["load"].append(os.getloadavg()[0])
    return out


def _valid(text: str, s: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), s)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def bench_llama(path: str, max_tokens: int, threads: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    import superslm
    from benchmarks.kv_speed import _no_extra_buffer_types

    _no_extra_buffer_types()
    model = superslm.load(path, device="cpu")
    user, s = work(0)
    ids = model.chat_tokens([{"role": "user", "content": user}])
    out: dict[str, Any] = {"load": [os.getloadavg()[0]]}
    for name, pld in (("llama", 0), ("llama-pld", 10)):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=pld) if pld else None
        llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + max_tokens + 64, n_threads=threads,
                              n_threads_batch=threads, n_batch=512, draft_model=draft, logits_all=draft is not None,
                              verbose=False)
        grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(s), verbose=False)
        llm.eval(ids[:16])
        llm.reset()
        tokens: list[int] = []
        first = last = 0.0
        for tok in llm.generate(ids, temp=0.0, reset=True, grammar=grammar):
            last = time.perf_counter()
            first = first or last
            if int(tok) == llm.token_eos() or len(tokens) == max_tokens:
                break
            tokens.append(int(tok))
        out[f"{name}/1"] = {"tps": (len(tokens) - 1) / (last - first), "tokens": [tokens],
                            "valid": _valid(llm.detokenize(tokens).decode(errors="replace"), s)}
        del llm
    out["load"].append(os.getloadavg()[0])
    return out


def _child(queue: Any, fn: Any, args: tuple[Any, ...]) -> None:
    try:
        queue.put(fn(*args))
    except Exception as e:  # reported, the other engines still run
        queue.put({"error": f"{type(e).__name__}: {e}"})


def in_process(fn: Any, *args: Any) -> dict[str, Any]:
    """fn(*args) in a fresh process (each engine alone in its memory and threads)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(queue, fn, args))
    p.start()
    got = queue.get()
    p.join()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--deterministic", action="store_true", help="our engines in deterministic mode")
    ap.add_argument("--no-llama", action="store_true")
    args = ap.parse_args()
    from superslm import hub

    path = str(hub.fetch(args.model, progress=False))
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{args.model} ({path}), {args.threads} threads, {time.strftime('%Y-%m-%d %H:%M %Z')}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    got: dict[str, list[float]] = {}
    for r in range(args.rounds):
        runs = [in_process(bench_ours, path, batches, args.max_tokens, args.threads, args.deterministic)]
        if not args.no_llama:
            runs.append(in_process(bench_llama, path, args.max_tokens, args.threads))
        for res in runs:
            if "error" in res:
                print(f"  round {r + 1} failed: {res['error']}", flush=True)
                continue
            for key, x in res.items():
                if key == "load":
                    continue
                got.setdefault(key, []).append(x["tps"])
                drafts = f", drafts {x['accepted']}/{x['proposed']}, {x['steps']} steps" if "steps" in x else ""
                print(f"  round {r + 1} {key:12} {x['tps']:7.1f} tok/s, {sum(map(len, x['tokens']))} tokens, "
                      f"valid {int(x['valid'])}{drafts}", flush=True)
            print(f"  load average {res['load'][0]:.2f} -> {res['load'][1]:.2f}", flush=True)
        ours = runs[0]
        for b in batches:
            if "error" not in ours:
                a, s = ours[f"plain/{b}"]["tokens"], ours[f"ngram/{b}"]["tokens"]
                print(f"  round {r + 1} batch {b}: ngram tokens {'equal to' if a == s else 'DIFFER from'} plain's",
                      flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    for b in batches:
        line = f"batch {b}: plain {med.get(f'plain/{b}', 0):.1f}, ngram {med.get(f'ngram/{b}', 0):.1f} tok/s"
        if med.get(f"plain/{b}"):
            line += f" ({med[f'ngram/{b}'] / med[f'plain/{b}']:.2f}x)"
        if b == 1 and med.get("llama/1"):
            line += (f"; llama.cpp {med['llama/1']:.1f}, with prompt lookup {med.get('llama-pld/1', 0):.1f} tok/s; "
                     f"ngram / best llama {med['ngram/1'] / max(med['llama/1'], med.get('llama-pld/1', 0)):.2f}x")
        print(line)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
