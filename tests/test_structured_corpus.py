"""The JSON schema corpus (tests/schemas/) through the engine with the default model (SmolLM2).

Every schema llguidance compiles is decoded greedily, all requests batched through one engine with
16 slots, and the text must parse and validate with `jsonschema` (formats checked); the schemas it
refuses are refused by the engine too, with the listed reason. Jump-forward on and off must give
the same tokens, and jump-forward must force tokens wherever a schema fixes its first key.

Decoding settings that keep a 135M model's greedy answers short, without touching the grammar:
compact JSON (`max_whitespace=0`: fewer tokens, and the whitespace bound is tested elsewhere), a
frequency penalty (JSON numbers have no length bound, and greedy decoding repeats digits) and a
bias towards EOS (it is allowed only where the grammar accepts, so it ends a complete value rather
than extending it). A schema whose answer still runs to max_tokens is asked again with the next
prompt; every schema must finish with one of them. The engine runs in deterministic mode so that
a token does not depend on which rows share a step (jump-forward changes that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema
import pytest

import superslm
from superslm import Request, Sampling
from superslm.errors import GrammarError
from superslm.grammar import Constraint
from tests.test_grammar_corpus import EXPECTED_UNSUPPORTED, FORMATS, compilable, corpus

PROMPTS = (
    "Give an example of {} as compact JSON.",
    "Reply with a small {} JSON value.",
    "Write a minimal JSON for: {}.",
)
MAX_TOKENS = 128
SLOTS = 16
CONTEXT = 256
#: the prompts share their chat template's first ~28 tokens (the default system prompt, the user's header):
#: pages of 4 let the prefix cache hold nearly all of them (pages of 16: one page), and in deterministic mode a
#: prompt row costs what a decode row does (the same tokens either way)
PAGE = 4


@dataclass
class Answer:
    prompt: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: str = ""
    forced: int = 0


@pytest.fixture(scope="module")
def model(smollm2_gguf) -> superslm.Model:
    return superslm.load(smollm2_gguf)


def request(model: superslm.Model, name: str, prompt: int) -> Request:
    question = PROMPTS[prompt].format(name.replace("_", " "))
    sampling = Sampling(grammar=Constraint.json_schema(corpus()[name], max_whitespace=0), frequency_penalty=1.0,
                        logit_bias={model.tokenizer.eos_id: 5.0})
    return Request(model.chat_tokens([{"role": "user", "content": question}]), MAX_TOKENS, sampling)


def decode(model: superslm.Model, asks: dict[str, int], jump_forward: bool = True) -> dict[str, Answer]:
    """Run {schema name: prompt index} together through one engine; the answers by name."""
    engine = model.engine(slots=SLOTS, context=CONTEXT, page_size=PAGE, jump_forward=jump_forward,
                          deterministic=True)
    ids = {engine.add(request(model, name, p)): name for name, p in asks.items()}
    out = {name: Answer(p) for name, p in asks.items()}
    while engine.busy():
        for p in engine.advance():
            a = out[ids[p.id]]
            a.tokens += p.tokens
            a.text += p.text
            if p.end:
                a.end, a.forced = p.end, p.forced_tokens
    return out


@pytest.fixture(scope="module")
def first(model) -> dict[str, Answer]:
    """Each schema with one prompt (they rotate through PROMPTS), jump-forward on."""
    return decode(model, {name: i % len(PROMPTS) for i, name in enumerate(compilable())})


@pytest.fixture(scope="module")
def answers(model, first) -> dict[str, Answer]:
    """`first`, where an answer ran to max_tokens asked again with the next prompt (twice at most)."""
    out = dict(first)
    for _ in range(len(PROMPTS) - 1):
        again = {n: (a.prompt + 1) % len(PROMPTS) for n, a in out.items() if a.end == "length"}
        if not again:
            break
        out.update(decode(model, again))
    return out


def test_unsupported_schemas_are_refused_with_their_reason(model) -> None:
    engine = model.engine(slots=1, context=64, jump_forward=False)  # off: nothing ends inside add()
    refused: dict[str, str] = {}
    for name, schema in corpus().items():
        try:
            rid = engine.add(Request([1, 2, 3], 4, Sampling(grammar=Constraint.json_schema(schema))))
        except GrammarError as e:
            refused[name] = str(e)
            continue
        engine.cancel(rid)
    assert sorted(refused) == sorted(EXPECTED_UNSUPPORTED)
    for name, reason in EXPECTED_UNSUPPORTED.items():
        assert reason in refused[name], (name, refused[name])
    ended = engine.advance()
    assert len(ended) == len(corpus()) - len(refused) and all(p.end == "cancelled" for p in ended)


def test_every_answer_parses_and_validates(model, answers) -> None:
    assert len(answers) == len(compilable()) >= 60
    unfinished = {n: a.text[-60:] for n, a in answers.items() if a.end != "stop"}
    assert not unfinished, f"ran to max_tokens with every prompt: {unfinished}"
    for name, a in answers.items():
        schema = corpus()[name]
        value = json.loads(a.text)
        errors = [e.message for e in jsonschema.Draft202012Validator(schema, format_checker=FORMATS).iter_errors(value)]
        assert not errors, (name, a.text, errors)
        assert a.text == model.tokenizer.decode(a.tokens)  # the streamed text is the tokens' text


@pytest.mark.slow
def test_jump_forward_off_gives_identical_tokens(model, first) -> None:
    off = decode(model, {n: a.prompt for n, a in first.items()}, jump_forward=False)
    differ = [n for n in first if off[n].tokens != first[n].tokens or off[n].end != first[n].end]
    assert not differ, differ
    assert all(a.forced == 0 for a in off.values())  # without jump-forward every token is sampled
    assert sum(a.forced for a in first.values()) > 0


def fixes_first_key(schema: object) -> bool:
    """An object schema whose first listed property is required (its key must come first), or a
    top-level const: the grammar leaves one continuation for a whole key or value."""
    if not isinstance(schema, dict):
        return False
    if "const" in schema:
        return True
    props = list(schema.get("properties", {}))
    return schema.get("type") == "object" and bool(props) and props[0] in schema.get("required", [])


def test_forced_tokens_where_keys_are_fixed(first) -> None:
    fixed = [n for n in first if fixes_first_key(corpus()[n])]
    assert len(fixed) >= 30
    unforced = [n for n in fixed if first[n].forced == 0]
    assert not unforced, unforced
    for a in first.values():
        assert a.forced <= len(a.tokens)
