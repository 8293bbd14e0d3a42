"""/metrics as a scraper reads it: parsed by prometheus_client's own text parser, vLLM's names beside ours
(the Gateway API Inference Extension routes on them), each checked after a known sequence of requests."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server_helpers import LiveServer, slow_steps, tiny_folder

FIXED = {"ignore_eos": True}


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{family name: {((label, value), ...): value}} of every sample, by prometheus_client's parser."""
    text = httpx.get(f"{url}/metrics").text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_vllm_names_after_known_requests() -> None:
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    # an engine that drafts, so the speculative counters have something to count
    app = create_app(model, slots=2, context=128, served_model_name="tiny", speculative="ngram")
    with LiveServer(app) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        before = scrape(s.url)
        tiny = (("model_name", "tiny"),)
        assert before["vllm:num_requests_running"] == {tiny: 0}
        assert before["vllm:num_requests_waiting"] == {tiny: 0}
        assert before["vllm:kv_cache_usage_perc"] == {tiny: 0.0}
        # a repeated text: prompt lookup finds drafts in it
        prompt = "one two three four " * 6
        r1 = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=FIXED, temperature=0)
        r2 = c.completions.create(model="tiny", prompt="The quick", max_tokens=5, n=2, extra_body=FIXED)
        m = scrape(s.url)
        usage = [r1.usage, r2.usage]
        assert m["vllm:prompt_tokens_total"] == {tiny: sum(u.prompt_tokens for u in usage)}
        assert m["vllm:generation_tokens_total"] == {tiny: sum(u.completion_tokens for u in usage)} == {tiny: 22}
        # one first token per sequence (three)
        assert m["vllm:time_to_first_token_seconds_count"] == {tiny: 3}
        assert m["vllm:time_to_first_token_seconds_bucket"][(("le", "+Inf"), *tiny)] == 3
        assert m["vllm:num_requests_running"] == {tiny: 0} and m["vllm:num_requests_waiting"] == {tiny: 0}
        assert m["vllm:kv_cache_usage_perc"] == m["vllm:gpu_cache_usage_perc"] == {tiny: 0.0}
        assert m["vllm:num_preemptions_total"] == {tiny: 0}
        stats = s.state.engine.stats()
        assert stats["drafts_proposed"] > 0
        assert m["vllm:spec_decode_num_draft_tokens_total"] == {tiny: stats["drafts_proposed"]}
        assert m["vllm:spec_decode_num_accepted_tokens_total"] == {tiny: stats["drafts_accepted"]}
        assert m["superslm_spec_decode_draft_tokens_total"] == {(): stats["drafts_proposed"]}
        (labels, stamp), = m["vllm:lora_requests_info"].items()
        assert dict(labels) == {"model_name": "tiny", "running_lora_adapters": "", "waiting_lora_adapters": "",
                                "max_lora": "0"}
        assert stamp > 1.7e9  # a time stamp, as vLLM's gauge holds


def test_running_and_kv_usage_mid_answer() -> None:
    """While one answer runs (each step slowed) and a second waits for the one slot, the gauges say so."""
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    app = create_app(superslm.load(folder), slots=1, context=256, served_model_name="tiny")
    engine = app.state.server.engine
    slow_steps(app, 0.02)
    tiny = (("model_name", "tiny"),)
    body = {"model": "tiny", "prompt": "abc " * 20, "max_tokens": 60, "stream": True, **FIXED}
    with LiveServer(app) as s, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{s.url}/v1/completions", json=body) as first:
            assert first.status_code == 200, first.read()
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))

            second = threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/completions", timeout=60,
                                                                json={**body, "stream": False}))
            second.start()
            deadline = time.monotonic() + 10
            m = scrape(s.url)
            while m["vllm:num_requests_waiting"] != {tiny: 1} and time.monotonic() < deadline:
                time.sleep(0.01)
                m = scrape(s.url)
            assert m["vllm:num_requests_waiting"] == {tiny: 1}
            assert m["vllm:num_requests_running"] == {tiny: 1}
            (usage,) = m["vllm:kv_cache_usage_perc"].values()
            total = engine.pool.num_pages
            # the prompt and the answer so far: at least one page of 16 tokens
            assert 1 / total <= usage <= 1 and usage == m["superslm_kv_pages_used"][()] / total
            for _ in lines:
                pass
        second.join()
        m = scrape(s.url)
        assert m["vllm:num_requests_waiting"] == m["vllm:num_requests_running"] == {tiny: 0}


def test_serve_engine_flags(tmp_path) -> None:
    """`superslm serve --deterministic --speculative ngram --kv int8`: the start-up line names each mode, the
    answer is the library's with the same engine settings, and /metrics counts the drafts."""
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys

    import superslm
    from superslm import Request, Sampling
    from tests.test_server_helpers import wait_for
    from tests.test_server_load import _healthy

    folder, _ = tiny_folder("llama")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "superslm.cli", "serve", str(folder), "--port", str(port), "--slots", "2",
           "--context", "256", "--log-level", "warning", "--deterministic", "--speculative", "ngram", "--kv", "int8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    prompt = "one two three four " * 6
    try:
        wait_for(lambda: _healthy(url), timeout=90, every=0.2)
        body = {"model": folder.name, "prompt": prompt, "max_tokens": 16, "temperature": 0, **FIXED}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        m = scrape(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = proc.stdout.read().decode()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert re.search(r"context 256, slots 2, KV int8 \d+ pages of 16 tokens \(\d+ MB\), deterministic, "
                     r"speculative ngram, threads \d+", log), log
    model = superslm.load(folder)
    engine = model.engine(slots=2, context=256, deterministic=True, speculative="ngram", kv="int8")
    (done,) = engine.generate([Request(model.tokenizer.encode(prompt), 16, Sampling(temperature=0, ignore_eos=True))])
    assert answer["choices"][0]["text"] == model.tokenizer.decode(done.tokens)
    tiny = (("model_name", folder.name),)
    assert m["vllm:spec_decode_num_draft_tokens_total"][tiny] == engine.stats()["drafts_proposed"] > 0


def test_engine_flags_refused_for_an_encoder(tmp_path) -> None:
    import subprocess
    import sys

    from tests.test_encoders import build_bert_family

    folder = tmp_path / "enc"
    build_bert_family(folder, "bert")
    out = subprocess.run([sys.executable, "-m", "superslm.cli", "serve", str(folder), "--kv", "int8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--kv configure a language model's engine, not an encoder" in out.stderr
