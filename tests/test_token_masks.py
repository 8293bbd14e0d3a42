"""vLLM's allowed_token_ids and bad_words through the engine's bitmask. transformers' bad_words_ids is the oracle where
a word lies inside the answer (vLLM checks the answer's tokens only; transformers the prompt's too)."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.engine.masks import allowed_row, apply_row, bad_word_ids, banned_tokens
from superslm.errors import InvalidArgument
from superslm.grammar import Constraint
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[superslm.Model, object]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = build_hf_model("llama", folder)
    return superslm.load(folder, dtype="fp32"), hf


def _run(model: superslm.Model, prompt: list[int], n: int, sampling: Sampling) -> list[int]:
    return model.engine(slots=1, context=128).generate([Request(prompt, n, sampling)])[0].tokens


def test_allowed_token_ids(tiny) -> None:
    """Greedy over the allowed ids is the argmax of transformers' logits restricted to them, step by step;
    sampled tokens stay inside the set; with a grammar, both apply."""
    model, hf = tiny
    allowed = (5, 17, 40, 41, 200, 255)
    for p in prompts(2, seed=21):
        got = _run(model, p, 6, Sampling(allowed_token_ids=allowed, ignore_eos=True))
        ids = list(p)
        with torch.no_grad():
            for _ in range(6):
                row = hf(torch.tensor([ids])).logits[0, -1]
                ids.append(allowed[int(row[list(allowed)].argmax())])
        assert got == ids[len(p):]
        sampled = _run(model, p, 12, Sampling(temperature=1.0, seed=3, allowed_token_ids=allowed, ignore_eos=True))
        assert set(sampled) <= set(allowed)


def test_bad_words_as_transformers(tiny) -> None:
    """Each bad word's token sequence never appears in the output: transformers' generate with bad_words_ids of the
    same sequences gives the same greedy tokens (a one-token word, and a two-token word whose first token stays
    allowed)."""
    model, hf = tiny
    text = model.tokenizer.encode("def main():")
    free = _run(model, text, 8, Sampling(ignore_eos=True))
    one = model.tokenizer.decode([free[0]])
    words = (one,)
    seqs = bad_word_ids(words, model.tokenizer)
    assert (free[0],) in seqs
    got = _run(model, text, 8, Sampling(bad_words=words, ignore_eos=True))
    with torch.no_grad():
        want = hf.generate(torch.tensor([text]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           bad_words_ids=[list(s) for s in seqs], pad_token_id=0)[0, len(text):].tolist()
    assert got == want and free[0] not in got
    # a two-token word: its last token is masked only right after its first
    pair = (got[0], got[1])
    assert banned_tokens([7, got[0]], Sampling(), (), (pair,)) == (got[1],)
    assert banned_tokens([got[0], 7], Sampling(), (), (pair,)) == ()
    assert banned_tokens([], Sampling(min_tokens=2, stop_token_ids=(9,)), (1,), ()) == (9, 1)


def test_mask_rows() -> None:
    row = torch.full((4,), -1, dtype=torch.int32)
    apply_row(row, allowed_row([0, 31, 32, 127], 4), [32])
    bits = [(int(w) >> b) & 1 for w in row for b in range(32)]
    assert [i for i, v in enumerate(bits) if v] == [0, 31, 127]
    only = allowed_row([5], 4)
    apply_row(only, None, [5])  # nothing left: the row stays
    assert int(only[0]) == 1 << 5


def test_masks_are_checked(tiny) -> None:
    model, _ = tiny
    e = model.engine(slots=1, context=64)
    for bad in ((), (10**9,), ("a",)):
        with pytest.raises(InvalidArgument, match="allowed_token_ids"):
            e.add(Request([5, 6], 2, Sampling(allowed_token_ids=bad)))
    with pytest.raises(InvalidArgument, match="bad_words"):
        e.add(Request([5, 6], 2, Sampling(bad_words=(" ",))))
    # a grammar and an allowed set: the answer is one of the choices
    c = model.engine(slots=1, context=64).generate([Request([5, 6], 10, Sampling(
        grammar=Constraint.choice(["yes", "no"]), allowed_token_ids=tuple(range(300))))])[0]
    assert c.text in ("yes", "no")
    assert Sampling.from_dict(Sampling(allowed_token_ids=(3, 4), bad_words=("x",)).to_dict()) == Sampling(
        allowed_token_ids=(3, 4), bad_words=("x",))


def test_conflicting_masks_give_way_in_order(tiny) -> None:
    """allowed_token_ids narrows first; bans (bad words, min_tokens' stop tokens) give way only to what is left of
    it (they used to drop the allowed set as well, letting any token out)."""
    model, _ = tiny
    p = model.tokenizer.encode("The quick brown")
    free = _run(model, p, 4, Sampling(ignore_eos=True))
    word = model.tokenizer.decode([free[0]])
    other = next(t for t in range(3, 300) if t != free[0] and (t,) not in bad_word_ids([word], model.tokenizer))
    got = _run(model, p, 4, Sampling(allowed_token_ids=(free[0], other), bad_words=(word,), ignore_eos=True))
    assert got == [other] * 4
    eos = model.arch.eos_ids[0]
    assert _run(model, p, 4, Sampling(allowed_token_ids=(eos,), min_tokens=2)) == []  # only a stop token is left
    row = allowed_row([3], 1)
    apply_row(row, allowed_row([4], 1), [])  # nothing in common with the grammar's row: the grammar's stays
    assert int(row[0]) == 1 << 3
