"""superslm.ray on a local Ray started here: 2 replicas of SmolLM2 behind the ingress, driven with the official
openai client. Chat and streaming answer as `superslm serve` does; requests sharing a long system prompt stay
on one replica (its prefix-cache hit counter moves) while unrelated load spreads; a replica killed mid-run
loses no request that had not started streaming and gives the others a clean error; scale-down lets the
streams in flight finish. The pure parts (text extraction, chunk hashes, merged metrics) are checked without Ray."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from superslm.errors import InvalidArgument

pytest.importorskip("ray.serve")

from superslm.ray import stats  # noqa: E402
from superslm.ray.app import ScaleOut, build, read_config  # noqa: E402
from superslm.ray.bridge import carry  # noqa: E402
from superslm.ray.ingress import stream_error  # noqa: E402
from superslm.ray.routers import chunk_hashes  # noqa: E402

HEADER = "x-superslm-replica"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the name a GGUF file is served as
SYSTEM = ("You are the support assistant of the Northwind Lantern Company. Lanterns come in brass, copper and steel; "
          "every order ships in two days; returns are free for thirty days; the warranty covers the glass and the "
          "wick holder for five years but not the paint. Answer in one short sentence, politely, and never promise "
          "a discount. ") * 3


# --- the parts that need no cluster -------------------------------------------------------------------------


def test_carry_reads_routing_text_from_each_api() -> None:
    body = (b'{"messages": [{"role": "system", "content": "S"}, '
            b'{"role": "user", "content": [{"type": "text", "text": "U"}]}]}')
    chat = carry("POST", "/v1/chat/completions", b"", [], body)
    assert chat.routing_text == "SU"
    body = b'{"system": "S", "messages": [{"role": "user", "content": "U"}]}'
    anthropic = carry("POST", "/v1/messages", b"", [], body)
    assert anthropic.routing_text == "SU"
    assert carry("POST", "/v1/completions", b"", [], b'{"prompt": "P"}').routing_text == "P"
    assert carry("POST", "/v1/responses", b"", [], b'{"instructions": "I", "input": "U"}').routing_text == "IU"
    # not JSON, another route, a GET: no routing text (the replica's app answers them as the server does)
    assert carry("POST", "/v1/chat/completions", b"", [], b"{oops").routing_text == ""
    assert carry("POST", "/tokenize", b"", [], b'{"prompt": "P"}').routing_text == ""
    assert carry("GET", "/v1/models", b"", [], b"").routing_text == ""


def test_chunk_hashes_chain_the_prefix() -> None:
    a, b = chunk_hashes("x" * 300 + "tail-a", 100), chunk_hashes("x" * 300 + "tail-b", 100)
    assert len(a) == 3 and a == b  # the partial last chunk is not hashed
    c = chunk_hashes("y" + "x" * 299, 100)
    assert c[1] != a[1]  # equal second chunks after a different first one: different hashes (chained)


def test_merge_labels_every_sample_with_its_replica() -> None:
    text = ("# HELP m_total Things.\n# TYPE m_total counter\nm_total 3\n"
            '# HELP h Hist.\n# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_count 2\n')
    merged = stats.merge({"r1": (text, 100.0, 1), "r2": (text.replace("3", "5"), 100.0, 2),
                          "old": (text, 0.0, 3)}, now=101.0)
    lines = merged.splitlines()
    assert lines.count("# HELP m_total Things.") == 1 and lines.count("# TYPE h histogram") == 1
    assert 'm_total{replica="r1"} 3' in lines and 'm_total{replica="r2"} 5' in lines
    assert 'h_bucket{replica="r1",le="1.0"} 2' in lines
    assert "old" not in merged  # a replica that stopped posting is left out
    # the families stay grouped: every sample of m_total comes before h's HELP
    assert lines.index('m_total{replica="r2"} 5') < lines.index("# HELP h Hist.")
    assert stats.samples(merged, "m_total") == {"r1": 3.0, "r2": 5.0}


def test_stream_error_in_each_api_shape() -> None:
    from superslm.ray.ingress import ReplicaLost

    err = ReplicaLost("gone")
    assert stream_error("/v1/chat/completions", err).endswith(b"data: [DONE]\n\n")
    assert b'"code":"replica_lost"' in stream_error("/v1/chat/completions", err)
    assert stream_error("/v1/messages", err).startswith(b"event: error\n")
    assert stream_error("/v1/responses", err).startswith(b"event: error\n")


def test_config_is_checked(tmp_path: Any) -> None:
    good = tmp_path / "c.toml"
    good.write_text('address = "auto"\nmodel = "m.gguf"\nreplicas = 3\nrouter = "round-robin"\n')
    cfg, address = read_config(str(good))
    assert (cfg.model, cfg.replicas, cfg.router, address) == ("m.gguf", 3, "round-robin", "auto")
    for body, what in [('replicas = 0\n', "replicas"), ('router = "random"\n', "router"),
                       ('replica = 2\n', "unknown keys")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(body)
        with pytest.raises(InvalidArgument, match=what):
            read_config(str(bad))


# --- a local cluster ----------------------------------------------------------------------------------------


def _free_port() -> int:
    """A port free now below the kernel's ephemeral range: one the kernel hands out (port 0) can be taken again by
    any outgoing connection before Serve's proxy binds it, and Ray's processes (here and in a test beside this one
    under xdist) open many: the proxy then failed to bind."""
    import random

    lo = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = min(lo, int(f.read().split()[0]) - 2000)
    except OSError:
        pass
    for port in random.Random(os.getpid()).sample(range(lo - 8000, lo), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: Any) -> Any:
    import ray
    from ray import serve

    from superslm.ray.app import start

    cfg = ScaleOut(model=str(smollm2_gguf), replicas=2, slots=4, context=1024, num_cpus=1, threads=1,
                   port=_free_port(), health_check_period_s=1.0, drain_timeout=30.0, name="superslm-test")
    start(cfg, num_cpus=2, object_store_bytes=200 << 20)
    yield cfg
    serve.shutdown()
    ray.shutdown()


def _client(cfg: ScaleOut) -> Any:
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.port}/v1", api_key="none", timeout=60, max_retries=0)


def _metrics(cfg: ScaleOut, name: str) -> dict[str, float]:
    import httpx

    return stats.samples(httpx.get(f"http://127.0.0.1:{cfg.port}/metrics", timeout=10).text, name)


def _chat(client: Any, messages: list[dict[str, str]], **kw: Any) -> tuple[Any, str]:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)
    return raw.parse(), raw.headers[HEADER]


def test_chat_and_stream_through_the_deployment(cluster: ScaleOut) -> None:
    client = _client(cluster)
    assert [m.id for m in client.models.list().data][0] == MODEL
    reply, _ = _chat(client, [{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # the server's own errors, through the ingress: an unknown model is the app's 404
    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_shared_system_prompt_sticks_unrelated_load_spreads(cluster: ScaleOut) -> None:
    client = _client(cluster)
    hits_before = _metrics(cluster, "superslm_prefix_cache_hits_total")
    seen, cached = [], []
    for q in ("Do you ship to Norway?", "Is the paint covered?", "Can I return a lantern?", "Brass or steel?"):
        reply, replica = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                               max_tokens=4, temperature=0)
        seen.append(replica)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert len(set(seen)) == 1, seen  # one replica holds the system prompt: all four go there
    assert all(c > 100 for c in cached[1:]), cached  # and its prefix cache answers their shared part
    home = seen[0]
    hits = _metrics(cluster, "superslm_prefix_cache_hits_total")
    assert hits[home] - hits_before.get(home, 0) >= sum(cached[1:]), (hits, hits_before)

    # unrelated prompts at once: load balance spreads them over both replicas
    def one(i: int) -> str:
        topic = ["volcanoes", "chess openings", "sourdough", "tidal power", "origami", "jazz chords"][i]
        return _chat(client, [{"role": "user", "content": f"Write a long essay about {topic}. " * 8}],
                     max_tokens=24, temperature=0, extra_body={"ignore_eos": True})[1]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        spread = list(pool.map(one, range(6)))
    assert len(set(spread)) == 2, spread


def _live_replicas(name: str) -> dict[str, int]:
    import ray

    board = ray.get_actor(f"superslm-stats-{name}", namespace=stats.NAMESPACE)
    now = time.time()
    return {r: pid for r, (_, at, pid) in ray.get(board.all.remote()).items() if now - at < 3}


def _wait_replicas(cfg: ScaleOut, n: int, timeout: float = 90) -> None:
    from ray import serve

    deadline = time.time() + timeout
    while time.time() < deadline:
        status = serve.status().applications[cfg.name].deployments["SuperSLMEngine"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"the engine deployment did not reach {n} running replicas: {status}")


def test_killed_replica_loses_no_unstarted_request(cluster: ScaleOut) -> None:
    import openai

    client = _client(cluster)
    started: dict[int, str] = {}  # request -> the replica that streamed its first chunk
    kill_at = threading.Event()
    killed: dict[str, Any] = {}

    def stream(i: int) -> tuple[str, int, str | None]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"Story {i}: tell me a tale."}],
            max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
        replica = raw.headers[HEADER]  # the headers come with the first token
        chunks, finish = 0, None
        try:
            for c in raw.parse():
                if c.choices and c.choices[0].finish_reason:
                    finish = c.choices[0].finish_reason
                if c.choices and c.choices[0].delta.content:
                    chunks += 1
                    if i not in started:
                        started[i] = replica
                    if chunks == 4:
                        kill_at.set()
        except openai.APIError as e:
            return "error", chunks, getattr(e, "code", None) or str(e)
        return "ok" if finish == "length" else f"ended {finish}", chunks, replica

    def plain(i: int) -> tuple[str, int, str | None]:
        reply, replica = _chat(client, [{"role": "user", "content": f"Fact {i}: name a river."}], max_tokens=48,
                               temperature=0, extra_body={"ignore_eos": True})
        return "ok" if reply.usage.completion_tokens == 48 else "short", 0, replica

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = {("stream", i): pool.submit(stream, i) for i in range(12)}
        futures.update({("plain", i): pool.submit(plain, i) for i in range(4)})
        assert kill_at.wait(60), "no stream started"
        pids = _live_replicas(cluster.name)
        victim = next(iter(started.values()))
        killed["before"] = {k for k, v in started.items() if v == victim}
        os.kill(pids[victim], signal.SIGKILL)
        results = {k: f.result(timeout=120) for k, f in futures.items()}  # a hang fails here
    streamed_on_victim = killed["before"]
    errors = {k for k, r in results.items() if r[0] == "error"}
    assert errors, results  # the victim's running streams were cut...
    for kind, i in errors:
        # ...with the ingress's clean error, only streams that had started there
        assert kind == "stream" and i in started and started[i] == victim, (kind, i, results[(kind, i)])
        assert results[(kind, i)][2] == "replica_lost", results[(kind, i)]
    assert {i for _, i in errors} <= streamed_on_victim | {k for k, v in started.items() if v == victim}
    for key, (outcome, _, replica) in results.items():
        if outcome == "ok":
            assert replica != victim, (key, results[key])  # finished whole ("length"), on the survivor
    # the ones the victim held but had not started: answered by the other replica (none lost)
    assert sum(r[0] == "ok" for r in results.values()) == len(results) - len(errors)
    assert len(results) - len(errors) > 6, results  # more than the survivor's own share: retried ones among them
    _wait_replicas(cluster, 2)  # Serve replaces the dead replica


def test_scale_down_lets_streams_finish(cluster: ScaleOut) -> None:
    from ray import serve

    _wait_replicas(cluster, 2)
    client = _client(cluster)
    results: dict[int, tuple[str, int]] = {}
    first = threading.Barrier(5)

    def stream(i: int) -> None:
        s = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"Poem {i}: about the sea."}],
            max_tokens=64, temperature=0, stream=True, extra_body={"ignore_eos": True})
        replica, n, waited = s.headers[HEADER], 0, False
        for c in s.parse():
            if c.choices and c.choices[0].finish_reason:
                n = c.usage.completion_tokens if c.usage else 64 if c.choices[0].finish_reason == "length" else 0
            if c.choices and c.choices[0].delta.content:
                if not waited:
                    waited = True
                    first.wait(60)
        results[i] = (replica, n)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first.wait(60)  # four streams running, on both replicas (load balance)
    serve.run(build(replace(cluster, replicas=1)), name=cluster.name, route_prefix="/")
    for t in threads:
        t.join(120)
    assert len({r for r, _ in results.values()}) == 2, results
    assert all(n == 64 for _, n in results.values()), results  # the drained replica's streams finished whole
    _wait_replicas(cluster, 1)


def test_cli_refuses_what_replicas_cannot_serve(tmp_path: Any, capsys: Any) -> None:
    from superslm.cli import main

    # several models, or a config file with a wrong key: a clear error, exit 2, before any Ray starts
    assert main(["serve", "--replicas", "2", "a.gguf", "b.gguf"]) == 2
    assert "one language model" in capsys.readouterr().err
    bad = tmp_path / "c.json"
    bad.write_text('{"model": "m.gguf", "replicaz": 2}')
    assert main(["ray-deploy", str(bad)]) == 2
    assert "unknown keys ['replicaz']" in capsys.readouterr().err
