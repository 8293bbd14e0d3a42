"""Speculative decoding under a grammar: the n-gram guess cut where the grammar refuses it, the bytes it forces
drafted where jump-forward cannot take them, each draft row masked as the grammar will stand after the drafts before
it; the same tokens and logprobs as plain decoding (tiny random models, and one slow test on SmolLM2)."""

from __future__ import annotations

import pytest

import superslm
from superslm import Request, Sampling
from superslm.engine.speculative import Speculative
from tests.test_speculative import copy_prompts, generate, model_zoo, same_ends


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return model_zoo(tmp_path_factory)


GRAMMAR_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                 "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}}},
                  "required": ["name", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_grammar_rows_draft_exactly(zoo, family) -> None:
    """Rows with a grammar draft (the lookup's guess cut where the grammar refuses it, or the bytes it forces) and
    give plain decoding's tokens: greedy, seeded, with logprobs (no jump-forward there), with penalties."""
    from superslm.grammar import Constraint

    model = zoo(family)
    ps = copy_prompts(6, seed=9)
    constraints = [Constraint.regex(r"[a-z ]{1,60}"), Constraint.json_schema(GRAMMAR_SCHEMA),
                   Constraint.regex(r"(ab|abc|[a-c ])+")]
    samplings = [dict(), dict(temperature=0.8, seed=3), dict(logprobs=2), dict(repetition_penalty=1.1)]

    def reqs():
        return [Request(p, 40, Sampling(grammar=constraints[i % 3], **samplings[i % 4])) for i, p in enumerate(ps)]

    plain, e0 = generate(model, reqs())
    spec, e1 = generate(model, reqs(), speculative=Speculative(k=6, min_n=1))
    same_ends(spec, plain)
    st = e1.stats()
    assert st["drafts_accepted"] > 0 and st["steps"] < e0.stats()["steps"]
    for a, b in zip(spec, plain, strict=True):
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert (x.token, x.rank) == (y.token, y.rank) and abs(x.logprob - y.logprob) <= 1e-3


def test_grammar_rows_draft_bit_identically_in_deterministic_mode(zoo) -> None:
    from superslm.grammar import Constraint

    model = zoo("qwen3")
    ps = copy_prompts(4, seed=10)

    def reqs():
        return [Request(p, 40, Sampling(grammar=Constraint.json_schema(GRAMMAR_SCHEMA), logprobs=1,
                                        temperature=0.0 if i % 2 else 0.9, seed=i)) for i, p in enumerate(ps)]

    plain, _ = generate(model, reqs(), deterministic=True)
    spec, e = generate(model, reqs(), deterministic=True, speculative=Speculative(k=6, min_n=1))
    same_ends(spec, plain)
    assert [c.logprobs for c in spec] == [c.logprobs for c in plain]
    assert e.stats()["drafts_proposed"] > 0


def test_forced_bytes_are_drafted_where_jump_forward_cannot_take_them(zoo) -> None:
    """Where the grammar forces text but leaves its spelling in tokens open (a key's closing quote and the colon
    after it: one token or two), jump-forward takes nothing and the forced bytes are drafted, verified. The lookup
    is kept out (12-grams of a prompt without repeats) so every draft here is a forced one."""
    from superslm.grammar import Constraint

    model = zoo("llama")
    schema = {"type": "object", "properties": {"first": {"type": "boolean"}, "second": {"enum": ["yes", "no"]},
                                               "third": {"type": "array", "items": {"type": "boolean"}, "maxItems": 6}},
              "required": ["first", "second", "third"], "additionalProperties": False}
    prompt = copy_prompts(2, seed=11)[1]

    def reqs():
        return [Request(prompt, 100, Sampling(grammar=Constraint.json_schema(schema, max_whitespace=0)))]

    plain, e0 = generate(model, reqs())
    # prior 1: the forced bytes drafted from the first step (a lower prior drafts fewer until they are kept)
    spec, e1 = generate(model, reqs(), speculative=Speculative(k=8, min_n=12, max_n=12, prior=1.0))
    same_ends(spec, plain)
    assert spec[0].end == "stop"
    assert e1.stats()["drafts_accepted"] > 0 and e1.stats()["steps"] < e0.stats()["steps"]


@pytest.mark.slow
def test_smollm2_json_extraction_drafts_exactly(smollm2_gguf) -> None:
    """The real model filling a JSON schema from a document it quotes: drafts kept (values copied from the prompt,
    keys the schema forces), the same tokens and logprobs as without drafts in deterministic mode, valid JSON."""
    import json

    import jsonschema

    from superslm.grammar import Constraint

    model = superslm.load(smollm2_gguf)
    doc = ("Margaret Ellison, property manager at Harbor View Apartments LLC, 1820 Shoreline Drive, Portland, "
           "Oregon, signed the maintenance contract with Northwind Mechanical Services Inc. on 14 March 2024.")
    keys = ("person_name", "job_title", "company_name", "street_address", "city", "contractor_name", "date")
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 60} for k in keys},
              "required": list(keys), "additionalProperties": False}
    chat = [{"role": "user", "content": f"{doc}\n\nExtract {', '.join(keys)} from the text above as JSON."}]
    prompt = model.chat_tokens(chat)

    def reqs():
        return [Request(prompt, 200, Sampling(logprobs=1, grammar=Constraint.json_schema(schema, max_whitespace=0)))]

    exact = dict(slots=1, context=512, page_size=16, deterministic=True)
    plain, e0 = generate(model, reqs(), **exact)
    spec, e1 = generate(model, reqs(), **exact, speculative="ngram")
    same_ends(spec, plain)
    assert spec[0].logprobs == plain[0].logprobs
    jsonschema.validate(json.loads(spec[0].text), schema)
    assert e1.stats()["drafts_accepted"] > 10 and e1.stats()["steps"] < e0.stats()["steps"]

