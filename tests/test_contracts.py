"""Runtime contracts: prefix handles, hidden states, damped greedy, stats, layer budgets."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.errors import InvalidArgument, PrefixInUse
from superslm.sampling.damped import AntiLM, damped_choice, repeated_ngrams
from superslm.sampling.params import DampedGreedy
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contracts")
    hf = build_hf_model("gemma3", folder)
    return superslm.load(folder), hf


def test_prefix_handle_is_shared_and_never_recomputed(tiny) -> None:
    model, _ = tiny
    shared, a, b = prompts(3, seed=50, lo=10, hi=40)
    shared = shared[:37]  # not a whole number of pages: the partial page is copied
    engine = model.engine(slots=4, context=128, page_size=8, deterministic=True)
    pre = engine.prefix(shared)
    used = engine.pool.num_used
    outs = engine.generate([Request(a, 8, Sampling(ignore_eos=True), prefix=pre),
                            Request(b, 8, Sampling(ignore_eos=True), prefix=pre)])
    assert all(c.cached == len(shared) for c in outs)
    plain = model.engine(slots=4, context=128, page_size=8, deterministic=True, prefix_caching=False)
    assert [c.tokens for c in outs] == [c.tokens for c in plain.generate(
        [Request(shared + a, 8, Sampling(ignore_eos=True)), Request(shared + b, 8, Sampling(ignore_eos=True))])]
    rid = engine.add(Request(a, 8, Sampling(), prefix=pre))
    with pytest.raises(PrefixInUse):
        engine.release(pre)
    engine.cancel(rid)
    engine.release(pre)
    assert engine.pool.num_used == 0 and used > 0
    with pytest.raises(InvalidArgument):
        engine.add(Request(a, 8, prefix=pre))


@pytest.mark.float_kv
def test_hidden_states_equal_transformers(tiny) -> None:
    model, hf = tiny
    p = prompts(1, seed=51, lo=20, hi=20)[0]
    engine = model.engine(slots=1, context=64)
    layers = list(range(model.arch.layers + 1))
    got = engine.hidden(p, [0] * len(p), layers)
    with torch.no_grad():
        want = hf(torch.tensor([p]), output_hidden_states=True).hidden_states
    assert len(want) == len(layers)
    for i in layers:
        assert (got[i] - want[i][0]).abs().max() <= 1e-4, f"layer {i}"


@pytest.mark.float_kv
def test_prefill_hidden_and_stats(tiny) -> None:
    model, hf = tiny
    p = prompts(1, seed=52, lo=12, hi=12)[0]
    engine = model.engine(slots=1, context=64)
    rid = engine.add(Request(p, 5, Sampling(ignore_eos=True)))
    assert engine.prefill_hidden(rid) is None
    engine.advance()
    with torch.no_grad():
        want = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert (engine.prefill_hidden(rid) - want).abs().max() <= 1e-4
    st = engine.stats(rid)
    assert st["layers_run"] == model.arch.layers and st["kv_pages"] == 1 and st["output_tokens"] == 1
    assert st["grammar_accepting"] is None


def test_damped_choice_is_exact_fixed_point() -> None:
    anti = AntiLM(2)
    for t in [5, 6, 5, 6, 5]:
        anti.append(t)
    lp = torch.full((20,), -20.0)
    lp[6], lp[7] = -0.5, -0.6  # 6 most likely, but it repeats "5 6"
    assert damped_choice(lp.log_softmax(-1), anti, DampedGreedy(alpha=1.0, order=2, top_k=3)) == 7
    assert damped_choice(lp.log_softmax(-1), anti, DampedGreedy(alpha=0.0, order=2, top_k=3)) == 6
    assert AntiLM.from_state(anti.state()).logprob_q(6, 20) == anti.logprob_q(6, 20)
    with pytest.raises(InvalidArgument):
        Sampling(damped=DampedGreedy(top_k=0)).validate(20)


def test_damped_greedy_reduces_repetition_on_default_model(smollm2_gguf) -> None:
    model = superslm.load(smollm2_gguf)
    engine = model.engine(slots=2, context=256, deterministic=True)
    p = model.tokenizer.encode("The list of the best things in the world: the best things, the best")
    greedy, damped = engine.generate([Request(p, 48, Sampling(ignore_eos=True)),
                                      Request(p, 48, Sampling(damped=DampedGreedy(), ignore_eos=True))])
    assert repeated_ngrams(damped.tokens) < repeated_ngrams(greedy.tokens)
    # exact for the same logits: deterministic mode gives the same logits alone as in a batch
    alone = model.engine(slots=1, context=256, deterministic=True)
    again = alone.generate([Request(p, 48, Sampling(damped=DampedGreedy(), ignore_eos=True))])[0]
    assert again.tokens == damped.tokens


def test_model_tool_calls_parser(tiny) -> None:
    model, _ = tiny
    content, calls = model.tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert calls == [{"name": "f", "arguments": '{"x": 1}'}] and not (content or "").strip()
