"""The chat page at / in a real browser: Debian's headless Chromium driven by Playwright.

A reply streams in and equals the openai client's answer to the same request; Stop cancels the request on
the server (counted as cancelled, no sequence left running); a reasoning template's thinking shows folded;
conversations survive a reload; the model's text is never run as HTML; a screenshot is saved.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import openai
import pytest

from tests.test_server_helpers import LiveServer, metrics, slow_steps, tiny_folder

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="the chat page test needs playwright")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="the chat page test needs Chromium (apt install chromium)")

THINKING_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n<think>\n{% endif %}{# </think> closes it #}"
)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_page(browser, url: str):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    # selectors and polling from here: the page's Content-Security-Policy forbids the eval wait_for_function uses
    page.wait_for_selector("#model option", state="attached")
    return page, errors


def settings(page, **values: str) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", value)
        page.dispatch_event(f"#{name}", "change")


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_reply_streams_stops_and_persists(browser, tmp_path: Path) -> None:
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    app = create_app(superslm.load(folder), slots=2, context=512, served_model_name="tiny")
    slow_steps(app, 0.03)  # a reply streams long enough to be stopped
    with LiveServer(app) as s:
        page, errors = open_page(browser, s.url)
        assert page.eval_on_selector("#model", "e => e.value") == "tiny"
        settings(page, temperature="0", **{"max-tokens": "24"})
        ask(page, "Hello there")
        page.wait_for_selector(".message.assistant .stats", timeout=60_000)
        shown = page.inner_text(".message.assistant .content")
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        ref = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                             max_tokens=24, temperature=0, top_p=1)
        # innerText drops a trailing newline the way a browser lays it out: compare the text itself
        assert shown.strip("\n") == (ref.choices[0].message.content or "").strip("\n")
        assert f"{ref.usage.completion_tokens} tokens" in page.inner_text(".message.assistant .stats")
        assert "tok/s" in page.inner_text(".message.assistant .stats")

        # a long reply, stopped while it streams: the server cancels it
        before = metrics(s.url).get('superslm_requests_total{endpoint="chat_completions",outcome="cancelled"}', 0)
        settings(page, **{"max-tokens": "400"})  # greedy still: a sampled reply could end at its first token
        ask(page, "Tell me more")
        second = page.locator(".message.assistant .content").nth(1)
        deadline = time.monotonic() + 60
        while not (second.count() and second.text_content()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert second.text_content(), page.eval_on_selector_all(".message", "es => es.map(e => e.outerHTML)")
        page.click("#stop")
        page.wait_for_selector(".message.assistant:nth-of-type(4) .stats", timeout=30_000)
        assert "stopped" in page.inner_text(".message.assistant:nth-of-type(4) .stats")
        deadline = time.monotonic() + 10
        key = 'superslm_requests_total{endpoint="chat_completions",outcome="cancelled"}'
        while metrics(s.url)[key] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        m = metrics(s.url)
        assert m[key] == before + 1
        assert m["superslm_requests_running"] == 0 and m["superslm_kv_pages_used"] == 0
        assert page.is_enabled("#send") and not page.is_enabled("#stop")

        shot = Path(os.environ.get("SUPERSLM_SCREENSHOTS", tmp_path)) / "chat_page.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 1000

        # the conversation is kept in the browser: a reload shows it again
        texts = page.eval_on_selector_all(".message .content", "es => es.map(e => e.textContent)")
        page.reload()
        page.wait_for_selector(".message.assistant")
        assert page.eval_on_selector_all(".message .content", "es => es.map(e => e.textContent)") == texts
        assert page.inner_text("#conversations li.current span") == "Hello there"
        page.click("#new-chat")
        assert page.eval_on_selector_all(".message", "es => es.length") == 0
        assert page.eval_on_selector_all("#conversations li", "es => es.length") == 2
        assert errors == []


def test_thinking_shows_folded_and_html_stays_text(browser) -> None:
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    model.use_chat_template(THINKING_TEMPLATE)
    with LiveServer(create_app(model, slots=1, context=512, served_model_name="thinker")) as s:
        page, errors = open_page(browser, s.url)
        settings(page, temperature="0", **{"max-tokens": "12"})
        marker = "<img src=x onerror=window.pwned=1>"
        ask(page, marker)
        page.wait_for_selector(".message.assistant .stats", timeout=60_000)
        # the prompt opened the thinking block and the answer never closed it: all of it is thinking
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        ref = client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": marker}],
                                             max_tokens=12, temperature=0, top_p=1).choices[0].message
        assert ref.reasoning_content
        details = page.query_selector(".message.assistant details.reasoning")
        assert details is not None and details.get_attribute("open") is None  # folded
        assert page.eval_on_selector(".message.assistant details.reasoning pre", "e => e.textContent") == \
            ref.reasoning_content
        # the user's text is shown as text, never parsed as HTML
        assert page.inner_text(".message.user .content") == marker
        assert page.evaluate("window.pwned") is None and page.query_selector(".message img") is None
        assert errors == []
