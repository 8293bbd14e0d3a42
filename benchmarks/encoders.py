"""Sentence encoders: SuperSLM against sentence-transformers in the same process, on the CPU.

    python benchmarks/encoders.py                      # 1,000 mixed-length texts, batch 32, 3 rounds
    python benchmarks/encoders.py --texts 200 --rounds 1 --ablation

Each system runs the batches it forms itself for the whole list (sentence-transformers: texts sorted
by length in characters; superslm: by token count; both cut every --batch), with the same torch
thread count, timed batch by batch with the two alternating, so a shared machine's changing load
falls on both alike; each round's ratio is printed. Sentences per second counts tokenization too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "search engine retrieval vector embedding sentence model query document passage ranking neural network "
    "Paris London Tokyo river mountain coffee algorithm database latency throughput kernel compiler "
    "économie naïve café Zürich Straße 東京 мир العربية 😀 3.14 2024 42% $100 e-mail co-operate don't"
).split()


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    """n texts, a quarter each of about 2-12, 10-40, 30-120 and 100-300 words (the last often truncated)."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        k = r.choice([r.randint(2, 12), r.randint(10, 40), r.randint(30, 120), r.randint(100, 300)])
        s = " ".join(r.choice(WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + r.choice([".", "?", "!", ""]))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all-minilm-l6-v2", help="a sentence-transformers folder or known name")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--ablation", action="store_true",
                    help="also time ours without the oneDNN linear kernel, and without the step workers")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object too")
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)

    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    from superslm.encoders import Encoder, net, workers
    from superslm.encoders.batching import plan
    from superslm.hub import resolve_path

    folder = resolve_path(ns.model)
    texts = mixed_texts(ns.texts)
    st = SentenceTransformer(str(folder), device="cpu")
    ours = Encoder.load(folder, device="cpu")
    plain = None
    if ns.ablation:
        net.USE_MKLDNN = False
        plain = Encoder.load(folder, device="cpu")
        net.USE_MKLDNN = True
        plain.embed_batch(texts[: 2 * ns.batch], batch=ns.batch)
    tokens = sum(len(t) for t in ours.tokenize(texts))
    print(f"{ns.model}: {ns.texts} texts, {tokens} tokens after truncation to {ours.max_seq_length}, "
          f"batch {ns.batch}, {torch.get_num_threads()} torch threads")
    print(f"{cpu_name()}, {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, "
          f"{datetime.date.today()}")

    # warm-up: first-call allocations, oneDNN primitive caches
    warm = texts[: 2 * ns.batch]
    st.encode(warm, batch_size=ns.batch)
    ours.embed_batch(warm, batch=ns.batch)

    # Each system's own batches of the whole run, timed batch by batch with the two alternating, so both
    # see the same machine load: sentence-transformers sorts the texts by length in characters and cuts
    # every `batch`; superslm sorts by token count and cuts every `batch` (encoders.batching.plan).
    by_chars = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    by_tokens = [i for step in plan([len(t) for t in ours.tokenize(texts)], ns.batch) for i in step]

    def cut(order: list[int]) -> list[list[str]]:
        return [[texts[i] for i in order[k : k + ns.batch]] for k in range(0, len(order), ns.batch)]

    batches = {"sentence-transformers": cut(by_chars), "superslm": cut(by_tokens)}
    calls: dict[str, Callable[[list[str]], torch.Tensor]] = {
        "sentence-transformers": lambda b: torch.from_numpy(st.encode(b, batch_size=ns.batch)),
        "superslm": lambda b: ours.embed_batch(b, batch=ns.batch),
    }
    if plain is not None:
        batches["superslm (F.linear)"] = batches["superslm"]
        calls["superslm (F.linear)"] = lambda b: plain.embed_batch(b, batch=ns.batch)

        def intra_op(b: list[str]) -> torch.Tensor:
            workers.USE_WORKERS = False  # the whole step in this thread, operators split across torch's threads
            try:
                return ours.embed_batch(b, batch=ns.batch)
            finally:
                workers.USE_WORKERS = True

        batches["superslm (intra-op threads)"] = batches["superslm"]
        calls["superslm (intra-op threads)"] = intra_op
    # to compare the vectors, each system's rows back in input order
    unsort = {n: sorted(range(len(texts)), key=(by_chars if n.startswith("sentence") else by_tokens).__getitem__)
              for n in calls}
    names = list(calls)
    rates: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[torch.Tensor]] = {}
    for r in range(ns.rounds):
        spent = dict.fromkeys(names, 0.0)
        outputs = {n: [] for n in names}
        for j in range(len(batches["superslm"])):
            for n in names if (j + r) % 2 == 0 else names[::-1]:
                dt, out = timed(lambda n=n, j=j: calls[n](batches[n][j]))
                spent[n] += dt
                outputs[n].append(out)
        for n in names:
            rates[n].append(len(texts) / spent[n])
        row = "  ".join(f"{n} {rates[n][-1]:6.1f}/s" for n in names)
        print(f"round {r + 1}: {row}  ratio {rates['superslm'][-1] / rates['sentence-transformers'][-1]:.2f}x")

    ratios = [a / b for a, b in zip(rates["superslm"], rates["sentence-transformers"])]
    ours_rows = torch.cat(outputs["superslm"])[unsort["superslm"]]
    st_rows = torch.cat(outputs["sentence-transformers"])[unsort["sentence-transformers"]]
    cos = F.cosine_similarity(ours_rows, st_rows)
    result = {
        "model": ns.model, "texts": ns.texts, "tokens": tokens, "batch": ns.batch,
        "threads": torch.get_num_threads(), "cpu": cpu_name(), "date": str(datetime.date.today()),
        "sentences_per_s": {n: [round(x, 1) for x in v] for n, v in rates.items()},
        "ratio_per_round": [round(x, 2) for x in ratios], "ratio_median": round(statistics.median(ratios), 2),
        "min_cosine": cos.min().item(),
    }
    print(f"median ratio {result['ratio_median']}x (per round {result['ratio_per_round']}); "
          f"min cosine to sentence-transformers {result['min_cosine']:.7f}")
    if ns.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
