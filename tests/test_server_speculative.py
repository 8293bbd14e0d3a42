"""The per-request opt-out of speculative decoding on a server that drafts (`disable_spec_decode`): no drafts for
that request, drafts for the others in the same steps, the same tokens; a bad value is a 400 naming the field."""

from __future__ import annotations

import threading

import httpx

from tests.test_server_helpers import LiveServer, assert_error, slow_steps, tiny_folder

#: a repeated text: prompt lookup finds drafts in it
PROMPT = "one two three four " * 6
FIXED = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def drafting_server():
    import superslm
    from superslm.serve import create_app

    folder, _ = tiny_folder("llama")
    app = create_app(superslm.load(folder), slots=2, context=256, served_model_name="tiny", speculative="ngram")
    engine = app.state.server.engine
    verified: list[str] = []  # each verification's request, by its prompt's end (which request drafted)
    record = engine.speculator.record

    def recording(seq, proposed, accepted):  # type: ignore[no-untyped-def]
        verified.append("off" if seq.request.speculative is False else "on")
        return record(seq, proposed, accepted)

    engine.speculator.record = recording
    return app, engine, verified


def test_disable_spec_decode_keeps_drafts_out_of_that_request_only() -> None:
    app, engine, verified = drafting_server()
    with LiveServer(app) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        drafted = http.post("/v1/completions", json=FIXED)
        assert drafted.status_code == 200, drafted.text
        before = engine.stats()
        assert before["drafts_proposed"] > 0 and verified and set(verified) == {"on"}
        verified.clear()
        plain = http.post("/v1/completions", json={**FIXED, "disable_spec_decode": True})
        assert plain.status_code == 200, plain.text
        after = engine.stats()
        assert (after["drafts_proposed"], after["draft_steps"]) == (before["drafts_proposed"], before["draft_steps"])
        assert verified == []
        assert plain.json()["choices"][0]["text"] == drafted.json()["choices"][0]["text"]
        # chat too; false is the default's value
        chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                "temperature": 0, "disable_spec_decode": False}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200

        # both in the same steps (slowed so that they overlap): the opt-out's sequence verifies nothing
        slow_steps(app, 0.01)
        verified.clear()
        out: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda k=k, b=b: out.__setitem__(k, http.post("/v1/completions", json=b)))
                   for k, b in (("on", FIXED), ("off", {**FIXED, "disable_spec_decode": True}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out["on"].status_code == out["off"].status_code == 200
        assert out["on"].json()["choices"][0]["text"] == out["off"].json()["choices"][0]["text"]
        assert "on" in verified and "off" not in verified

        for endpoint, body in (("/v1/completions", FIXED), ("/v1/chat/completions", chat)):
            for value in ("yes", 1, None, [True]):
                r = http.post(endpoint, json={**body, "disable_spec_decode": value})
                assert_error(r, 400, param="disable_spec_decode")
