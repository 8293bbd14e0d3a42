"""Prefix-aware routing vs round-robin on a local Ray: prefix-cache hit rate and time to first token.

8 conversations x 6 turns, the conversations running at once, each turn waiting for the last one's answer;
conversations 0-3 share one long system prompt, 4-7 another. Each router gets a fresh deployment (2 replicas,
fresh caches); TTFT is the client's (request sent -> first content chunk, streamed), the hit rate the
replicas' own prefix-cache counters (superslm_prefix_cache_hits_total / _queries_total, summed).

    python benchmarks/ray_prefix.py [--model PATH] [--replicas 2] [--turns 6] [--conversations 8] [--threshold 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from typing import Any

SYSTEMS = [
    ("You are the support assistant of the Northwind Lantern Company. Lanterns come in brass, copper and steel; "
     "orders ship in two days; returns are free for thirty days; the warranty covers the glass and the wick holder "
     "for five years but not the paint. Answer briefly and politely. ") * 4,
    ("You are a travel planner for rail journeys across the Alps. Trains run hourly from Zurich, Milan and Munich; "
     "seat reservations are required on panorama trains; children under six travel free; bikes need a ticket of "
     "their own. Suggest one route at a time and keep it short. ") * 4,
]
QUESTIONS = ["Hello, who are you?", "What can you help me with?", "Tell me more about that.", "Any caveats?",
             "Summarise what you said.", "Thanks, anything else I should know?"]


def conversation(base: str, model: str, system: str, c: int, turns: int, max_tokens: int) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0)
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"(customer {c}) {QUESTIONS[t % len(QUESTIONS)]}"})
        sent = time.perf_counter()
        first, text = None, []
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
        ttfts.append((first or time.perf_counter()) - sent)
        messages.append({"role": "assistant", "content": "".join(text)})
    return ttfts


def totals(base: str) -> tuple[float, float]:
    import httpx

    from superslm.ray import stats

    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=30).text
    return (sum(stats.samples(text, "superslm_prefix_cache_hits_total").values()),
            sum(stats.samples(text, "superslm_prefix_cache_queries_total").values()))


def run(router: str, ns: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from superslm.ray.app import ScaleOut, build

    cfg = ScaleOut(model=ns.model, replicas=ns.replicas, slots=ns.slots, context=2048, num_cpus=1, threads=1,
                   router=router, name=f"bench-{router}", port=ns.port, imbalanced_threshold=ns.threshold)
    serve.run(build(cfg), name=cfg.name, route_prefix="/")
    base = f"http://127.0.0.1:{ns.port}/v1"
    import openai

    model = openai.OpenAI(base_url=base, api_key="none").models.list().data[0].id
    time.sleep(2)  # every replica's first post on the board
    hits0, queries0 = totals(base)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(ns.conversations) as pool:
        runs = list(pool.map(lambda c: conversation(base, model, SYSTEMS[c * len(SYSTEMS) // ns.conversations], c,
                                                    ns.turns, ns.max_tokens), range(ns.conversations)))
    wall = time.perf_counter() - start
    time.sleep(1)
    hits, queries = totals(base)
    serve.delete(cfg.name)
    ttft = sorted(x for r in runs for x in r)
    later = sorted(x for r in runs for x in r[1:])
    return {"router": router, "hit_rate": (hits - hits0) / max(1.0, queries - queries0),
            "ttft_p50": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "later_p50": statistics.median(later), "wall": wall, "requests": len(ttft)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the model (default: SmolLM2-135M-Instruct from the cache)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--threshold", type=int, default=2, help="the prefix router's imbalanced_threshold")
    ns = p.parse_args()
    import ray
    from ray import serve

    from superslm import hub

    ns.model = ns.model or str(hub.fetch("smollm2-135m-instruct", progress=False))
    ray.init(num_cpus=ns.replicas, object_store_memory=200 << 20, include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": ns.port})
    rows = [run(router, ns) for router in ("prefix", "round-robin")]
    serve.shutdown()
    print(f"{ns.conversations} conversations x {ns.turns} turns, {ns.replicas} replicas x {ns.slots} slots, "
          f"{ns.max_tokens} tokens an answer, prefix router's imbalanced_threshold {ns.threshold}")
    print("| router | prefix-cache hit rate | TTFT p50 | TTFT p90 | TTFT p50, turns 2-6 | wall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['router']} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p90'] * 1000:.0f} ms "
              f"| {r['later_p50'] * 1000:.0f} ms | {r['wall']:.1f} s |")


if __name__ == "__main__":
    main()
