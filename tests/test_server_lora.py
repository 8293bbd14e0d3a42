"""LoRA adapters over HTTP: served by name from the start (--lora) and loaded or unloaded at run time in vLLM's
shapes (/v1/load_lora_adapter, /v1/unload_lora_adapter), driven by the official openai client. An adapter's
greedy answer is transformers + peft's own; refused with a clear error: a folder that is not one, a name in use,
an adapter in use, run-time loading where the server does not allow it."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

import superslm
from tests.test_lora import make_adapter
from tests.test_server_helpers import LiveServer, metrics, slow_steps, wait_for
from tests.tiny_models import build_hf_model, hf_greedy

PROMPT = "The quick brown fox"
N = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-base")
    hf = build_hf_model("llama", folder)
    peft_a = make_adapter(hf, folder / "a1", 1, rslora=False)
    hf2 = build_hf_model("llama", tmp_path_factory.mktemp("lora-again"))
    peft_b = make_adapter(hf2, folder / "a2", 2, rslora=True, targets=["q_proj", "v_proj", "down_proj"])
    return folder, peft_a, peft_b


def greedy(client: openai.OpenAI, model: str) -> list[str]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens


def test_adapters_by_name_answer_as_peft(base) -> None:
    from superslm.serve import create_app

    folder, peft_a, peft_b = base
    model = superslm.load(folder)
    ids = model.tokenizer.encode(PROMPT)
    app = create_app(model, slots=2, context=128, served_model_name="base", lora={"a1": str(folder / "a1")},
                     allow_lora_loading=True)
    slow_steps(app, 0.01)
    with LiveServer(app) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=60)
        cards = {m.id: m for m in c.models.list().data}
        assert set(cards) == {"base", "a1"} and cards["a1"].parent == "base"

        def legacy(t: int) -> str:  # a token as /v1/completions logprobs spell it (OpenAI's "bytes:\\xNN")
            raw = model.tokenizer.token_bytes(t)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

        def tokens_of(hf) -> list[str]:
            return [legacy(t) for t in hf_greedy(hf, ids, N)]

        want_a = tokens_of(peft_a)
        assert greedy(c, "a1") == want_a
        with peft_a.disable_adapter():
            assert greedy(c, "base") == tokens_of(peft_a)
        assert greedy(c, "base") != want_a  # the adapter matters

        # loaded at run time, in vLLM's shape
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(folder / "a2")})
        assert r.status_code == 200 and "added" in r.text
        assert greedy(c, "a2") == tokens_of(peft_b)
        assert {m.id for m in c.models.list().data} == {"base", "a1", "a2"}
        for body, status in [({"lora_name": "a2", "lora_path": str(folder / "a2")}, 400),  # the name is in use
                             ({"lora_name": "x", "lora_path": str(folder / "nope")}, 400),
                             ({"lora_name": "x", "lora_path": str(folder)}, 400),  # a folder, not an adapter
                             ({"lora_path": str(folder / "a2")}, 400)]:
            r = httpx.post(f"{s.url}/v1/load_lora_adapter", json=body)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["message"]

        # in use: not unloaded; the gauge names it
        done = threading.Event()

        def stream() -> None:
            body = {"model": "a2", "prompt": PROMPT, "max_tokens": 80, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: metrics(s.url)["superslm_requests_running"] == 1, timeout=30)
        scrape = httpx.get(f"{s.url}/metrics").text
        assert 'running_lora_adapters="a2"' in scrape and 'max_lora="2"' in scrape
        r = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 409 and not done.is_set()
        t.join(60)
        r = httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200 and "removed" in r.text
        with pytest.raises(openai.NotFoundError):
            greedy(c, "a2")
        assert httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
        assert greedy(c, "a1") == want_a  # the other adapter is untouched


def test_run_time_loading_is_off_unless_allowed(base) -> None:
    from superslm.serve import create_app

    folder, _, _ = base
    with LiveServer(create_app(superslm.load(folder), slots=1, context=64, served_model_name="base")) as s:
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folder / "a1")})
        assert r.status_code == 403 and "--allow-lora-loading" in r.json()["error"]["message"]
        assert httpx.post(f"{s.url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 403
