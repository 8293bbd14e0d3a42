"""`superslm ray-deploy CONFIG` on a Ray cluster started apart from it (`ray start --head`), as an operator runs
it: the command deploys and exits, the application keeps answering the openai client's chat and stream, the
anthropic client's Messages stream and the Responses stream through the ingress, and deleting it from another
process on the cluster removes its route."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def head() -> Any:
    """A one-node Ray cluster in its own process group (`--block`: ending the group ends every Ray process it
    started, and no other test's Ray)."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths live under it
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    # no drain on SIGTERM: the group's SIGTERM ends the GCS at once, so the head's drain request (a
    # Kubernetes-style grace period for Serve replicas) would wait out its whole 30 s timeout for a GCS that is
    # gone; the test has deleted its application by then, and 0 is Ray's own "immediate teardown" setting
    head_env = dict(env, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--object-store-memory=200000000", f"--temp-dir={temp}"],
        env=head_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_deploy_on_a_cluster_started_apart(head: Any, smollm2_gguf: Path, tmp_path: Path) -> None:
    import anthropic
    import openai

    address, env = head
    port = _free_port()
    config = tmp_path / "app.toml"
    config.write_text(
        f'model = "{smollm2_gguf}"\nreplicas = 2\nslots = 2\ncontext = 512\nnum_cpus = 1\nthreads = 1\n'
        f'port = {port}\nname = "superslm-cluster"\naddress = "{address}"\n'
    )
    deadline = time.time() + 120
    while True:  # the head takes a few seconds to take connections
        r = subprocess.run([str(BIN / "superslm"), "ray-deploy", str(config)], env=env, capture_output=True,
                           text=True, timeout=240)  # fmt: skip
        if r.returncode == 0 or time.time() > deadline:
            break
        time.sleep(2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "superslm-cluster (2 replicas" in r.stderr  # deployed, and the command has exited

    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Say hi."}]
    reply = client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    events = client.responses.create(model=model, input="Say hi.", max_output_tokens=8, temperature=0, stream=True)
    events = list(events)
    kinds = [e.type for e in events]
    # 8 tokens end it as max_output_tokens does: incomplete (completed if the model stops first)
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    messages = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
    with messages.messages.stream(model=model, max_tokens=8, messages=ask,
                                 extra_body={"temperature": 0}) as s:  # this client has no temperature argument
        said = "".join(s.text_stream)
        final = s.get_final_message()
    assert said == text and final.stop_reason in ("end_turn", "max_tokens")

    # removed as an operator would, from another process on the cluster: the route stops answering
    code = (f"import ray; from ray import serve; ray.init(address='{address}', configure_logging=False); "
            "serve.delete('superslm-cluster'); print(sorted(serve.status().applications))")
    gone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert gone.returncode == 0 and gone.stdout.strip().endswith("[]"), gone.stdout[-500:] + gone.stderr[-2000:]
    with pytest.raises((openai.NotFoundError, openai.APIConnectionError)):
        client.models.list()
