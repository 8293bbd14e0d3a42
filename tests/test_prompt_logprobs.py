"""prompt_logprobs (vLLM's): each prompt token's logprob given the tokens before it, against transformers."""

from __future__ import annotations

import pytest
import torch

from superslm import Request, Sampling
from superslm.errors import InvalidArgument
from tests.test_engine import prompts, tiny  # noqa: F401  (the module's fixture)


def _collect(engine, ids: list[int]) -> dict[int, list]:
    """Every Progress's prompt_logprobs per request until all end (each must come exactly once)."""
    got: dict[int, list] = {}
    while engine.busy():
        for p in engine.advance():
            if p.prompt_logprobs is not None:
                assert p.id not in got
                got[p.id] = p.prompt_logprobs
    assert set(got) == set(ids)
    return got


@pytest.mark.float_kv
def test_prompt_logprobs_match_transformers(tiny) -> None:  # noqa: F811
    """Chunked over pages (chunk 7, pages of 4), a warm prefix cache (the prompt is computed whole anyway), and
    the top 3: the logprob, rank and most likely ids of every prompt token as transformers' log_softmax gives."""
    model, hf = tiny
    p = prompts(1, seed=12, lo=20, hi=20)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)  # [len, vocab]
    engine = model.engine(slots=2, context=64, page_size=4, chunk=7)
    engine.generate([Request(p, 2, Sampling(ignore_eos=True))])  # warms the prefix cache with this prompt
    c = engine.generate([Request(p, 2, Sampling(ignore_eos=True, prompt_logprobs=3))])[0]
    assert c.cached == 0 and c.prompt_logprobs is not None and len(c.prompt_logprobs) == len(p)
    assert c.prompt_logprobs[0] is None
    for q in range(len(p) - 1):
        lp = c.prompt_logprobs[q + 1]
        row = ref[q]
        assert lp.token == p[q + 1] and abs(lp.logprob - row[p[q + 1]].item()) <= 1e-4
        assert lp.rank == int((row > row[p[q + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    zero = engine.generate([Request(p, 1, Sampling(prompt_logprobs=0))])[0].prompt_logprobs
    assert zero is not None and all(lp.top == () for lp in zero[1:])


def test_prompt_logprobs_are_delivered_once_and_saved(tiny) -> None:  # noqa: F811
    """Batched with other requests, deterministic mode gives the same bits as alone; a request saved half way
    through its prompt and restored delivers the whole list once."""
    model, _ = tiny
    ps = prompts(3, seed=13, lo=18, hi=30)
    s = Sampling(ignore_eos=True, prompt_logprobs=2)
    alone = []
    for p in ps:
        e = model.engine(slots=1, context=64, deterministic=True)
        alone.append(_collect(e, [e.add(Request(p, 2, s))]))
    e = model.engine(slots=4, context=64, deterministic=True, chunk=5)
    ids = [e.add(Request(p, 2, s if i != 1 else Sampling(ignore_eos=True))) for i, p in enumerate(ps)]
    got = _collect(e, [ids[0], ids[2]])
    assert got[ids[0]] == next(iter(alone[0].values())) and got[ids[2]] == next(iter(alone[2].values()))
    e = model.engine(slots=1, context=64, deterministic=True, chunk=8)
    rid = e.add(Request(ps[2], 2, s))
    e.advance()
    blob = e.save(rid)
    e.cancel(rid)
    e.advance()
    restored = _collect(e, [e.restore(blob)])
    assert next(iter(restored.values())) == next(iter(alone[2].values()))


def test_prompt_logprobs_with_a_grammar_that_forces_the_answer(tiny) -> None:  # noqa: F811
    """Jump-forward at add() could end the request before its prompt ran: no prompt logprobs ever came."""
    from superslm.grammar import Constraint

    model, _ = tiny
    p = model.tokenizer.encode("Pack my box")
    s = Sampling(grammar=Constraint.choice(["hello world"]), prompt_logprobs=1)
    c = model.engine(slots=1, context=64).generate([Request(p, 2, s)])[0]
    assert c.end == "length" and c.prompt_logprobs is not None and len(c.prompt_logprobs) == len(p)


def test_prompt_logprobs_are_checked(tiny) -> None:  # noqa: F811
    model, _ = tiny
    e = model.engine(slots=1, context=64)
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidArgument, match="prompt_logprobs"):
            e.add(Request([5, 6, 7], 2, Sampling(prompt_logprobs=bad)))
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        e.add(Request([8, 9], 2, Sampling(prompt_logprobs=1), prefix=e.prefix([5, 6, 7])))
