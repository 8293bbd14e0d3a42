"""Server metrics in the Prometheus text format (version 0.0.4), with no client library.

Counters and histograms are updated from two threads (the engine loop: tokens and sequence ends; the
event loop: request outcomes), so every update takes one lock. Engine gauges (running, waiting, KV
pages, prefix cache) come from the engine loop's latest snapshot at scrape time.

Beside ours, the names vLLM exports for what we count the same way (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and its older name `vllm:gpu_cache_usage_perc`,
`vllm:lora_requests_info`, token counters, time to first token, speculative decoding), labelled with
`model_name` as vLLM labels them: gateways (the Gateway API Inference Extension) route on them.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Sequence

from superslm.serve.loop import EngineStats

#: the counted endpoints, as the `endpoint` label spells them
ENDPOINTS = ("completions", "chat_completions", "messages", "responses", "embeddings", "rerank")
#: the encoder endpoints (their inputs and tokens are counted apart from the engine's)
ENCODER_ENDPOINTS = ("embeddings", "rerank")
#: request outcomes: finished and answered; the client went away; 4xx; 503 (queue full, draining); 5xx
OUTCOMES = ("success", "cancelled", "invalid", "rejected", "error")
#: why a sequence (one choice) ended
REASONS = ("stop", "length", "cancelled", "grammar", "not_finite")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Histogram:
    """Cumulative buckets, a sum and a count (not thread-safe on its own; Metrics holds the lock)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # `le` buckets: a value equal to a bound belongs in that bound's bucket
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The samples; `labels`: more labels for each (`key="value"`, already escaped)."""
        out, total = [], 0
        more = f",{labels}" if labels else ""
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"{more}}} {total}')
        tail = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{tail} {_num(self.sum)}", f"{name}_count{tail} {self.count}"]
        return out


def _num(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return repr(float(x)) if not float(x).is_integer() else f"{x:.1f}"


class Metrics:
    """Every counter and histogram the server exports; `render(stats)` writes the scrape text."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests = {(e, o): 0 for e in ENDPOINTS for o in OUTCOMES}
        self.sequences = dict.fromkeys(REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.forced_tokens = 0
        self.encoder_inputs = dict.fromkeys(ENCODER_ENDPOINTS, 0)
        self.encoder_tokens = dict.fromkeys(ENCODER_ENDPOINTS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        #: (adapters live requests use, adapters loaded): set by the server that serves adapters
        self.lora_info: Callable[[], tuple[list[str], int]] = lambda: ([], 0)
        self.tpot = Histogram(TPOT_BUCKETS)

    # --- from the event loop ----------------------------------------------------------------------

    def on_request(self, endpoint: str, outcome: str) -> None:
        """Count one HTTP request to a counted endpoint by how it ended."""
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def on_encoded(self, endpoint: str, inputs: int, tokens: int) -> None:
        """Count the inputs (texts, or query-document pairs) and tokens an encoder endpoint ran."""
        with self._lock:
            self.encoder_inputs[endpoint] += inputs
            self.encoder_tokens[endpoint] += tokens

    # --- from the engine loop (the LoopMetrics protocol) -----------------------------------------

    def on_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def on_generated(self, tokens: int) -> None:
        with self._lock:
            self.generation_tokens += tokens

    def on_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def on_next_token(self, seconds: float) -> None:
        with self._lock:
            self.tpot.observe(seconds)

    def on_sequence_end(self, reason: str) -> None:
        with self._lock:
            self.sequences[reason] = self.sequences.get(reason, 0) + 1

    def on_forced(self, tokens: int) -> None:
        with self._lock:
            self.forced_tokens += tokens

    # --- the scrape -------------------------------------------------------------------------------

    def render(self, stats: EngineStats | None, alive: bool) -> str:
        """The Prometheus text exposition of everything, engine gauges from `stats` (None: a server with
        no engine, an encoder's; `alive` then says whether its worker runs)."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        def one(name: str, kind: str, help_text: str, value: float) -> None:
            family(name, kind, help_text, [f"{name} {_num(value) if isinstance(value, float) else value}"])

        with self._lock:
            family(
                "superslm_requests_total", "counter",
                "Requests to the generation and encoder endpoints by outcome "
                "(success, cancelled, invalid, rejected, error).",
                [f'superslm_requests_total{{endpoint="{e}",outcome="{o}"}} {n}'
                 for (e, o), n in self.requests.items()],
            )
            family(
                "superslm_sequences_finished_total", "counter", "Sequences (choices) that ended, by reason.",
                [f'superslm_sequences_finished_total{{reason="{r}"}} {n}' for r, n in self.sequences.items()],
            )
            one("superslm_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens)
            one("superslm_generation_tokens_total", "counter", "Tokens sampled (stop tokens included).",
                self.generation_tokens)
            one("superslm_forced_tokens_total", "counter",
                "Generated tokens a grammar forced (jump-forward), part of generation_tokens_total.",
                self.forced_tokens)
            family("superslm_time_to_first_token_seconds", "histogram",
                   "Seconds from admission to a sequence's first sampled token.",
                   self.ttft.lines("superslm_time_to_first_token_seconds"))
            family("superslm_time_per_output_token_seconds", "histogram",
                   "Seconds between consecutive sampled tokens of a sequence.",
                   self.tpot.lines("superslm_time_per_output_token_seconds"))
            family("superslm_encoder_inputs_total", "counter",
                   "Texts embedded (embeddings) or query-document pairs scored (rerank).",
                   [f'superslm_encoder_inputs_total{{endpoint="{e}"}} {n}' for e, n in self.encoder_inputs.items()])
            family("superslm_encoder_tokens_total", "counter", "Tokens the encoder endpoints ran (their usage).",
                   [f'superslm_encoder_tokens_total{{endpoint="{e}"}} {n}' for e, n in self.encoder_tokens.items()])
        if stats is None:
            one("superslm_engine_alive", "gauge", "1 while the engine loop (or the encoder worker) runs.", int(alive))
            return "\n".join(lines) + "\n"
        s = stats
        one("superslm_requests_running", "gauge", "Sequences in the engine's running set.", s.running)
        one("superslm_requests_waiting", "gauge", "Sequences admitted but not yet running.", s.waiting)
        one("superslm_kv_pages_total", "gauge", "KV cache pages in the pool.", s.pages_total)
        one("superslm_kv_pages_used", "gauge", "KV pages held by sequences.", s.pages_used)
        one("superslm_kv_pages_cached", "gauge", "Free KV pages that keep a prefix (evictable).", s.pages_cached)
        one("superslm_kv_pages_free", "gauge", "Empty KV pages.", s.pages_free)
        one("superslm_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
            s.prefix_query_tokens)
        one("superslm_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
            s.prefix_hit_tokens)
        one("superslm_prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total.",
            float(s.prefix_hit_rate))
        one("superslm_preemptions_total", "counter", "Sequences preempted for lack of KV pages.", s.preemptions)
        one("superslm_kv_evictions_total", "counter", "Cached KV pages evicted to make room.", s.evictions)
        one("superslm_engine_steps_total", "counter", "Engine steps run.", s.steps)
        one("superslm_engine_alive", "gauge", "1 while the engine loop (or the encoder worker) runs.", int(alive))
        one("superslm_spec_decode_draft_tokens_total", "counter", "Draft tokens proposed (speculative decoding).",
            s.drafts_proposed)
        one("superslm_spec_decode_accepted_tokens_total", "counter", "Draft tokens the model accepted.",
            s.drafts_accepted)
        one("superslm_spec_decode_draft_steps_total", "counter", "Sequence steps that carried drafts.", s.draft_steps)
        if s.expert_slots:
            one("superslm_expert_cache_slots", "gauge", "Experts of each MoE block kept on the device.",
                s.expert_slots)
            one("superslm_expert_cache_hits_total", "counter", "Experts the router chose that were on the device.",
                s.expert_hits)
            one("superslm_expert_cache_misses_total", "counter", "Experts read in from host memory.",
                s.expert_misses)
            one("superslm_expert_cache_read_seconds_total", "counter", "Time the expert reads took.",
                s.expert_read_ms / 1000)
        lines.extend(self._vllm(s))
        return "\n".join(lines) + "\n"

    def _vllm(self, s: EngineStats) -> list[str]:
        """vLLM's names for the same quantities (see the module doc)."""
        label = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, value: float | int, more: str = "") -> None:
            shown = _num(value) if isinstance(value, float) else str(value)
            sample = f"{name}_total" if kind == "counter" else name  # a counter's sample, as vLLM's client writes it
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                          f"{sample}{{{label}{more}}} {shown}"])

        usage = float(s.pages_used / s.pages_total) if s.pages_total else 0.0
        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", s.running)
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s.waiting)
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
        family("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage (older name).", usage)
        # the adapters live requests use (running or waiting: one list), and how many are loaded
        used, loaded = self.lora_info()
        running = _escape(",".join(used))
        family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", float(time.time()),
               f',running_lora_adapters="{running}",waiting_lora_adapters="",max_lora="{loaded}"')
        family("vllm:num_preemptions", "counter", "Cumulative number of preemptions from the engine.", s.preemptions)
        with self._lock:
            family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
            family("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                   self.generation_tokens)
            name = "vllm:time_to_first_token_seconds"
            lines += [f"# HELP {name} Histogram of time to first token in seconds.", f"# TYPE {name} histogram",
                      *self.ttft.lines(name, label)]
        family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", s.drafts_proposed)
        family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", s.drafts_accepted)
        return lines


def _escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
