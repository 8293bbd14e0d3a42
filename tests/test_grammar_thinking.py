"""Grammars after a thinking block (Constraint.after_thinking): free text up to `</think>`, then what the
constraint describes. The regex of "no `</think>` inside" is checked against Python's `in` on random strings,
the compiled grammars against whole answers tokenized as a model would write them."""

from __future__ import annotations

import json
import random
import re

import pytest

import superslm
from superslm.grammar import Constraint, GrammarCompiler
from superslm.grammar.spec import never_containing
from tests.test_server_helpers import tiny_folder


@pytest.mark.parametrize("word", ["</think>", "<|end|>", "ab"])
def test_never_containing_is_not_in(word: str) -> None:
    pattern = re.compile(never_containing(word))
    alphabet = sorted(set(word)) + ["x", " ", "\n"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.2:  # plant the word, whole or cut
            cut = rng.randint(1, len(word))
            at = rng.randint(0, len(text))
            text = text[:at] + word[:cut] + text[at:]
        assert bool(pattern.fullmatch(text)) == (word not in text), text


def test_a_recurring_first_character_is_refused() -> None:
    with pytest.raises(ValueError):
        never_containing("abca")


@pytest.fixture(scope="module")
def compiler():
    folder, _ = tiny_folder("llama")
    model = superslm.load(folder)
    return model.tokenizer, GrammarCompiler(model.tokenizer)


def accepts(compiler, constraint: Constraint, text: str) -> bool:
    tok, c = compiler
    m = c.compile(constraint).new_matcher()
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and not m.is_error() and m.is_accepting()


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_open_thinking_then_the_schema(compiler) -> None:
    c = Constraint.json_schema(SCHEMA).after_thinking("open")
    assert accepts(compiler, c, 'the user wants a number </think>\n\n{"a": 1}')
    assert accepts(compiler, c, '</think>{"a": 2}')
    assert accepts(compiler, c, 'a < b, </thin is no tag </think>{"a": 3}')
    assert not accepts(compiler, c, '{"a": 1}')  # the block must close first
    assert not accepts(compiler, c, 'x </think>{"a": "one"}')  # the schema holds after it
    assert not accepts(compiler, c, 'x </think> y </think>{"a": 1}')  # text after the tag is the answer's
    assert not accepts(compiler, c, 'x </think>\n\n\n\n\n\n{"a": 1}')  # a few newlines, not a run


def test_optional_thinking_and_other_kinds(compiler) -> None:
    for c in (Constraint.regex("[0-9]{2}"), Constraint.choice(["yes", "no"]), Constraint.lark('start: "ok"')):
        text = {"regex": "42", "choice": "no", "lark": "ok"}[c.kind]
        opt = c.after_thinking("optional")
        assert accepts(compiler, opt, text) and accepts(compiler, opt, f"<think>hmm</think>\n{text}")
        assert not accepts(compiler, opt, f"hmm</think>{text}")
        assert accepts(compiler, c.after_thinking("open"), f"hmm</think>{text}")
        assert not accepts(compiler, c, f"<think>hmm</think>{text}")


def test_thinking_is_part_of_the_key_and_round_trips() -> None:
    c = Constraint.json_schema(SCHEMA)
    t = c.after_thinking("open")
    assert c.key() != t.key() and Constraint.from_dict(json.loads(t.key())) == t
    with pytest.raises(superslm.errors.InvalidArgument):
        c.after_thinking("sometimes")
