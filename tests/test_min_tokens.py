"""min_tokens (vLLM's; transformers' min_new_tokens): no end before that many output tokens."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.errors import InvalidArgument
from superslm.grammar import Constraint
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[superslm.Model, object]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = build_hf_model("llama", folder)
    return superslm.load(folder, dtype="fp32"), hf


def _run(model: superslm.Model, prompt: list[int], n: int, sampling: Sampling) -> superslm.engine.Completion:
    return model.engine(slots=1, context=128).generate([Request(prompt, n, sampling)])[0]


def test_min_tokens_masks_eos_as_transformers(tiny) -> None:
    """EOS pushed up by a logit bias would come first; with min_tokens=5 it comes sixth: the same tokens as
    transformers' generate with min_new_tokens=5 and the same bias, greedy. The plain-greedy head shortcut and
    the sampled path both honour it."""
    model, hf = tiny
    eos = model.arch.eos_ids[0]
    for p in prompts(2, seed=3):
        free = _run(model, p, 10, Sampling(logit_bias={eos: 100.0}))
        assert free.tokens == [] and free.end == "stop"  # a stop token is not returned
        got = _run(model, p, 10, Sampling(logit_bias={eos: 100.0}, min_tokens=5))
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=5, do_sample=False,
                              sequence_bias={(eos,): 100.0}, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
        want = out[0, len(p):].tolist()
        assert got.tokens == want[:5] and want[5] == eos and got.end == "stop"
        # a plain greedy request (the certified head path) keeps going past min_tokens as before
        plain = _run(model, p, 8, Sampling(min_tokens=3, ignore_eos=True))
        assert plain.tokens == _run(model, p, 8, Sampling(ignore_eos=True)).tokens
        sampled = _run(model, p, 10, Sampling(temperature=0.7, seed=1, logit_bias={eos: 100.0}, min_tokens=4))
        assert len(sampled.tokens) == 4 and eos not in sampled.tokens and sampled.end == "stop"


def test_min_tokens_holds_back_stop_ids_and_strings(tiny) -> None:
    model, _ = tiny
    p = prompts(1, seed=10)[0]
    free = _run(model, p, 12, Sampling(ignore_eos=True))
    tid = free.tokens[0]
    c = _run(model, p, 12, Sampling(stop_token_ids=(tid,), logit_bias={tid: 100.0}, min_tokens=3, ignore_eos=True))
    assert c.end == "stop" and len(c.tokens) == 3 and tid not in c.tokens
    # a stop string in the first min_tokens tokens' text does not end the request (vLLM checks from there on)
    p = model.tokenizer.encode("def main():")
    text = _run(model, p, 12, Sampling(ignore_eos=True)).text
    assert text[:2] * 3 in text and text.isprintable()  # this tiny model repeats one printable character
    c = _run(model, p, 12, Sampling(stop=(text[:2],), ignore_eos=True))
    assert c.text == "" and c.end == "stop"
    c = _run(model, p, 12, Sampling(stop=(text[:2],), min_tokens=6, ignore_eos=True))
    # the stop string that straddles the 6th token counts (vLLM looks back len(stop) - 1 characters); the text
    # before the 6th token was emitted already and stays
    assert len(c.tokens) == 6 and c.text == text[:5] and c.end == "stop"


def test_min_tokens_leaves_a_finished_grammar_its_end(tiny) -> None:
    """A grammar that allows only its end: the grammar wins over min_tokens (an empty mask samples noise)."""
    model, _ = tiny
    c = _run(model, prompts(1, seed=4)[0], 20, Sampling(grammar=Constraint.choice(["yes", "no"]), min_tokens=15))
    assert c.text in ("yes", "no") and c.end == "stop"


def test_min_tokens_is_checked(tiny) -> None:
    model, _ = tiny
    engine = model.engine(slots=1, context=128)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgument, match="min_tokens"):
            engine.add(Request([5, 6], 4, Sampling(min_tokens=bad)))
    with pytest.raises(InvalidArgument, match="min_tokens"):
        engine.add(Request([5, 6], 4, Sampling(min_tokens=5)))
    assert Sampling.from_dict(Sampling(min_tokens=3).to_dict()).min_tokens == 3
