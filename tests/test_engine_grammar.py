"""Grammar constraints through the engine: masks, jump-forward, dead ends, save/restore."""

from __future__ import annotations

import json

import jsonschema
import pytest

import superslm
from superslm import Request, Sampling
from superslm.grammar import Constraint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model(smollm2_gguf) -> superslm.Model:
    return superslm.load(smollm2_gguf)


def run(model, sampling: Sampling, prompt: str = "Give me a person as JSON:", n: int = 60, **kw):
    engine = model.engine(**{"slots": 2, "context": 256, **kw})
    return engine.generate([Request(model.chat_tokens([{"role": "user", "content": prompt}]), n, sampling)])[0]


def test_schema_output_validates_and_jump_forward_counts(model) -> None:
    c = run(model, Sampling(grammar=Constraint.json_schema(SCHEMA)))
    assert c.end == "stop"
    jsonschema.validate(json.loads(c.text), SCHEMA)
    engine = model.engine(slots=1, context=256)
    engine.add(Request(model.chat_tokens([{"role": "user", "content": "A person"}]), 60,
                       Sampling(grammar=Constraint.json_schema(SCHEMA))))
    forced = 0
    while engine.busy():
        for p in engine.advance():
            if p.end:
                forced = p.forced_tokens
    assert forced > 0  # the fixed keys are forced, not sampled


def test_choice_regex_and_sampling_stay_inside(model) -> None:
    c = run(model, Sampling(grammar=Constraint.choice(["yes", "no", "maybe"])), "Is the sky blue?")
    assert c.text in ("yes", "no", "maybe") and c.end == "stop"
    for seed in range(3):
        c = run(model, Sampling(grammar=Constraint.regex(r"[0-9]{3}-[a-z]{2}"), temperature=1.0, seed=seed))
        assert len(c.text) == 6 and c.text[3] == "-" and c.text[:3].isdigit()


def test_eos_only_where_accepting_and_max_tokens(model) -> None:
    # a 30-digit number cannot be finished in 5 tokens: the request ends by length, never by EOS
    c = run(model, Sampling(grammar=Constraint.regex(r"[0-9]{30}")), n=5)
    assert c.end == "length" and c.text.isdigit()


def test_dead_end_ends_with_grammar(model) -> None:
    # a token the mask can never allow: "after" activates on a token, then a choice no token starts
    engine = model.engine(slots=1, context=64)
    c = engine.generate([Request([1, 2, 3], 8, Sampling(grammar=Constraint.regex("\u00e9\u00e9\u00e9\u00e9")))])[0]
    assert c.end in ("stop", "grammar", "length")
    assert c.text in ("", "\u00e9\u00e9\u00e9\u00e9"[: len(c.text)])


def test_bounded_whitespace(model) -> None:
    c = run(model, Sampling(grammar=Constraint.json_schema(SCHEMA, max_whitespace=2), temperature=1.5, seed=3,
                            logit_bias={model.tokenizer.encode(" ", add_special_tokens=False)[0]: 20.0}), n=120)
    import re

    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)
    assert "   " not in outside_strings and "  " in outside_strings  # the bias pushed spaces up to the bound


def test_grammar_state_survives_save_restore(model) -> None:
    s = Sampling(grammar=Constraint.json_schema(SCHEMA), temperature=0.7, seed=5)
    prompt = model.chat_tokens([{"role": "user", "content": "A person"}])
    want = model.engine(slots=1, context=256, deterministic=True).generate([Request(prompt, 60, s)])[0]
    engine = model.engine(slots=1, context=256, deterministic=True)
    rid = engine.add(Request(prompt, 60, s))
    text = ""
    for _ in range(4):
        for p in engine.advance():
            text += p.text
    blob = engine.save(rid)
    fresh = model.engine(slots=1, context=256, deterministic=True)
    new = fresh.restore(blob)
    assert fresh.stats(new)["grammar_accepting"] is False
    while fresh.busy():
        for p in fresh.advance():
            text += p.text
    assert text == want.text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_cover_every_token_of_a_constrained_answer(model) -> None:
    """Jump-forward skips the model for forced tokens, so they would have no logprob: requests asking for logprobs
    compute every token (the same tokens: a forced token is the mask's only one)."""
    prompt = model.chat_tokens([{"role": "user", "content": "A person"}])
    grammar = Constraint.json_schema(SCHEMA)
    engine = model.engine(slots=2, context=256, deterministic=True)  # the default mode may flip a near tie
    plain, scored = engine.generate([Request(prompt, 40, Sampling(grammar=grammar)),
                                     Request(prompt, 40, Sampling(grammar=grammar, logprobs=2))])  # fmt: skip
    assert plain.tokens == scored.tokens
    covered = [lp.token for lp in scored.logprobs]
    assert covered[: len(scored.tokens)] == scored.tokens
    # an answer that ends at a stop token carries that token's logprob too (the token itself is not returned)
    extra = covered[len(scored.tokens) :]
    assert extra == [] or (scored.end == "stop" and len(extra) == 1 and extra[0] in model.stop_ids), (scored.end, extra)


def test_found_in_review_forced_past_max_tokens_and_dead_first_mask(model) -> None:
    """Tokens a grammar forces at add() that reach max_tokens end the request with a report (it was lost, and
    generate() raised KeyError); a constraint that admits no first token is refused at add()."""
    from superslm.errors import GrammarError

    engine = model.engine(slots=2, context=256)
    done = engine.generate([Request([1, 2, 3], 1, Sampling(grammar=Constraint.choice(["hello world"])))])[0]
    assert done.end == "length" and len(done.tokens) == 1 and "hello".startswith(done.text)
    rid = engine.add(Request([1, 2, 3], 1, Sampling(grammar=Constraint.choice(["hello world"]))))
    got = engine.advance()
    assert [p.id for p in got] == [rid] and got[0].end == "length" and not engine.busy()
    with pytest.raises(GrammarError):
        engine.add(Request([1, 2, 3], 4, Sampling(grammar=Constraint.regex(r"[^\s\S]"))))
    # a refused request in generate() leaves none of the others running
    with pytest.raises(GrammarError):
        engine.generate([Request([1, 2, 3], 4), Request([1, 2, 3], 4, Sampling(grammar=Constraint.regex(r"[^\s\S]")))])
    assert not engine.busy() and not engine.advance()
    with pytest.raises(superslm.errors.InvalidArgument):
        engine.add(Request([1, 2, 3], 4, {"temperature": 1.0}))  # type: ignore[arg-type]
    for prompt in ([1.7], b"abc", [True], 5):  # not token ids: refused, not read as ints
        with pytest.raises(superslm.errors.InvalidArgument):
            engine.add(Request(prompt, 4))  # type: ignore[arg-type]
