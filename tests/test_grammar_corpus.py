"""The JSON schema corpus (tests/schemas/): every schema llguidance compiles is walked with random
valid tokens on SmolLM2's real vocabulary, and the text must validate with `jsonschema`.

Run as a script (`python tests/test_grammar_corpus.py`) to print the mask time per token.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from superslm.errors import GrammarError
from superslm.formats.gguf import GGUFFile
from superslm.grammar import Constraint, GrammarCompiler, GrammarState
from superslm.tokenizer import Tokenizer

SCHEMAS = Path(__file__).parent / "schemas"

#: the corpus schemas llguidance refuses, with a piece of the reason it gives
EXPECTED_UNSUPPORTED = {
    "unsupported_all_of_conflict": "Unsatisfiable schema: incompatible types",
    "unsupported_backreference": "backreferences are not supported",
    "unsupported_external_ref": "https://example.com/schemas/thing.json",
    "unsupported_if_then": 'Unimplemented keys: ["if", "then"]',
    "unsupported_lookahead_pattern": "look-around",
    "unsupported_min_properties_optional": "min/maxProperties only supported when all keys",
    "unsupported_not": 'Unimplemented keys: ["not"]',
    "unsupported_oneof_overlap": "oneOf constraints are not supported",
    "unsupported_unique_items": 'Unimplemented keys: ["uniqueItems"]',
    "unsupported_unknown_format": "Unknown format: credit-card",
}


def corpus() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(SCHEMAS.glob("*.json"))}


def compilable() -> list[str]:
    return [n for n in corpus() if n not in EXPECTED_UNSUPPORTED]


# --- an independent validator: jsonschema, with the formats it leaves to optional packages ------

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(\.{_LABEL})*")
_DURATION = re.compile(r"P(?!\Z)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?")
_TIME = re.compile(r"([01]\d|2[0-3]):([0-5]\d):([0-5]\d|60)(\.\d+)?([Zz]|([+-])([01]\d|2[0-3]):([0-5]\d))")


def valid_time(text: str) -> bool:
    """RFC 3339's full-time: a leap second (:60) only where the time less its offset is 23:59 UTC."""
    m = _TIME.fullmatch(text)
    if m is None:
        return False
    if m[3] != "60":
        return True
    offset = 0 if m[5] in "Zz" else (1 if m[6] == "+" else -1) * (int(m[7]) * 60 + int(m[8]))
    return (int(m[1]) * 60 + int(m[2]) - offset) % (24 * 60) == 23 * 60 + 59


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    extra = jsonschema.FormatChecker()
    extra.checkers.update(checker.checkers)

    @extra.checks("date-time")
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        date, sep, clock = value.partition("T") if "T" in value else value.partition("t")
        return bool(sep) and _valid_date(date) and valid_time(clock)

    @extra.checks("time")
    def _time(value: object) -> bool:
        return not isinstance(value, str) or valid_time(value)

    @extra.checks("uri")
    def _uri(value: object) -> bool:
        if not isinstance(value, str):
            return True
        parts = urllib.parse.urlsplit(value)
        return bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", parts.scheme)) and " " not in value

    @extra.checks("hostname")
    def _hostname(value: object) -> bool:
        return not isinstance(value, str) or bool(_HOSTNAME.fullmatch(value))

    @extra.checks("duration")
    def _duration(value: object) -> bool:
        return not isinstance(value, str) or bool(_DURATION.fullmatch(value))

    return extra


def _valid_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", text))


FORMATS = _format_checker()


# --- the random walk ---------------------------------------------------------------------------


@dataclass
class Walk:
    tokens: list[int] = field(default_factory=list)
    forced: int = 0
    steps: int = 0
    mask_s: list[float] = field(default_factory=list)
    finished: bool = False


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in an int32 bitmask row (bit j of word w = token 32w + j)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def random_walk(
    state: GrammarState, tok_bytes: list[bytes], rng: random.Random, *, explore: int = 12, max_steps: int = 1500
) -> Walk:
    """Sample uniformly among allowed tokens for `explore` steps, then steer to an end (closing
    characters first, single bytes after) and stop as soon as the grammar accepts; forced tokens
    are taken as they come. Checks at every step that stop tokens are allowed iff accepting."""
    compiler = state.grammar.compiler
    stops = set(compiler.eos_ids) | set(state.extra_stop_ids)
    row = np.zeros(compiler.bitmask_words, dtype=np.int32)
    walk = Walk()
    closers = {b'"', b"}", b"]"}
    for step in range(max_steps):
        walk.steps = step
        # the grammar's time per sampled token: jump-forward (computes the mask) and the fill
        t0 = time.perf_counter()
        forced = state.take_forced()
        state.fill_bitmask(row)
        walk.mask_s.append(time.perf_counter() - t0)
        walk.tokens += forced
        walk.forced += len(forced)
        assert not state.is_dead, f"dead end after {len(walk.tokens)} tokens: {state.dead_reason}"
        allowed = allowed_ids(row)
        stop_allowed = any(int(t) in stops for t in allowed)
        assert stop_allowed == state.is_accepting, "a stop token must be allowed exactly where the grammar accepts"
        choices = [int(t) for t in allowed if int(t) not in stops]
        if stop_allowed and (not choices or step >= explore or rng.random() < 0.05):
            walk.finished = True
            return walk
        if step >= explore:
            single = [t for t in choices if len(tok_bytes[t]) == 1]
            if single:
                weights = [30.0 if tok_bytes[t] in closers else 1.0 for t in single]
                choices = rng.choices(single, weights)
        token = rng.choice(choices)
        assert state.accept(token), state.dead_reason
        walk.tokens.append(token)
    return walk


@pytest.fixture(scope="module")
def compiler(smollm2_gguf: Path) -> GrammarCompiler:
    tokenizer = Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)
    return GrammarCompiler(tokenizer)


def test_corpus_has_60_compilable_schemas() -> None:
    assert len(compilable()) >= 60
    assert set(EXPECTED_UNSUPPORTED) <= set(corpus())


def test_unsupported_schemas_are_exactly_the_listed_ones(compiler: GrammarCompiler) -> None:
    refused: dict[str, str] = {}
    for name, schema in corpus().items():
        try:
            compiler.compile(Constraint.json_schema(schema))
        except GrammarError as e:
            refused[name] = str(e)
    assert sorted(refused) == sorted(EXPECTED_UNSUPPORTED)
    for name, reason in EXPECTED_UNSUPPORTED.items():
        assert reason in refused[name], (name, refused[name])


MASK_TIMES: list[float] = []


@pytest.mark.parametrize("name", compilable())
def test_random_walk_validates(name: str, compiler: GrammarCompiler) -> None:
    schema = corpus()[name]
    grammar = compiler.compile(Constraint.json_schema(schema))
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    tok_bytes = compiler.tokenizer.all_token_bytes()
    for seed in range(2):
        state = GrammarState(grammar)
        walk = random_walk(state, tok_bytes, random.Random(f"{name}/{seed}"))
        MASK_TIMES.extend(walk.mask_s)
        assert walk.finished, f"no accepting state within {walk.steps} steps"
        text = b"".join(tok_bytes[t] for t in walk.tokens).decode("utf-8")
        value = json.loads(text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, (text, errors)


def test_mask_time_per_token() -> None:
    if len(MASK_TIMES) < 100:
        pytest.skip("runs after the corpus walks (run the whole file)")
    times = np.array(MASK_TIMES) * 1e3
    mean, p99 = float(times.mean()), float(np.percentile(times, 99))
    print(f"mask time per token over {len(times)} masks: mean {mean:.3f} ms, p99 {p99:.3f} ms")
    # loose bounds (a shared 2-core machine); the measured numbers go to docs/structured-output.md
    assert mean < 5.0 and p99 < 50.0


if __name__ == "__main__":
    import sys

    from superslm import hub

    tokenizer = Tokenizer.from_gguf(GGUFFile(hub.fetch("smollm2-135m-instruct", progress=False)).metadata)
    comp = GrammarCompiler(tokenizer)
    tok_bytes = tokenizer.all_token_bytes()
    times: list[float] = []
    steps = forced = 0
    for name in compilable():
        grammar = comp.compile(Constraint.json_schema(corpus()[name]))
        for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
            w = random_walk(GrammarState(grammar), tok_bytes, random.Random(f"{name}/{seed}"))
            times += w.mask_s
            steps += len(w.tokens)
            forced += w.forced
    ms = np.array(times) * 1e3
    print(f"{len(compilable())} schemas, {len(ms)} masks, {steps} tokens ({forced} forced)")
    print(f"mask time per token: mean {ms.mean():.3f} ms, p50 {np.percentile(ms, 50):.3f} ms, "
          f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms")
