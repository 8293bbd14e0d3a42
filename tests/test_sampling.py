"""superslm.sampling: parameters, batched shaping, seeded batch-invariant sampling, logprobs.

References are direct per-token Python loops (float64) or torch.log_softmax of the raw logits;
sampled frequencies are checked with a chi-square goodness-of-fit test whose critical value comes
from torch.special.gammaincc (alpha = 1e-4, df = number of tokens with nonzero probability - 1).
All randomness is seeded, so every test is deterministic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.sampling import (
    PenaltyState,
    SamplerState,
    Sampling,
    apply_token_bitmask,
    apply_top_p,
    build_penalty_tensors,
    gumbel_noise,
    sample,
    shaping,
)
from superslm.sampling.noise import keys_tensor, random_bits, stream_key
from superslm.sampling.sampler import _apply_bias_and_penalties

ALPHA = 1e-4
LOGITS8 = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]


# --- independent references ------------------------------------------------------------------------


def ref_penalised(logits: list[float], p: Sampling, prompt: list[int], output: list[int]) -> list[float]:
    """logit_bias then repetition/frequency/presence, one token at a time."""
    out = list(logits)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        n = output.count(t)
        if t in prompt or n > 0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * n
        if n > 0:
            out[t] -= p.presence_penalty
    return out


def ref_probs(
    logits: list[float], p: Sampling, prompt: list[int] = (), output: list[int] = ()
) -> list[float]:
    """The distribution the sampler should draw from, computed directly in float64."""
    x = ref_penalised(logits, p, list(prompt), list(output))
    v = len(x)
    if p.greedy:
        best = max(range(v), key=lambda i: (x[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    x = [xi / p.temperature for xi in x]
    keep = [True] * v
    m = max(x)
    for i in range(v):  # min_p on the temperature-scaled distribution
        if math.exp(x[i] - m) < p.min_p:
            keep[i] = False
    if p.top_k:
        kth = sorted(x, reverse=True)[min(p.top_k, v) - 1]
        keep = [keep[i] and x[i] >= kth for i in range(v)]
    if p.top_p < 1:
        w = [math.exp(x[i] - m) if keep[i] else 0.0 for i in range(v)]
        total = sum(w)
        mass = 0.0
        for i in sorted(range(v), key=lambda i: (-x[i], i)):
            if mass >= p.top_p * total:
                keep[i] = False
            mass += w[i]
    w = [math.exp(x[i] - m) if keep[i] else 0.0 for i in range(v)]
    return [wi / sum(w) for wi in w]


def chi2_critical(df: int, alpha: float) -> float:
    """x with P(chi2_df > x) = alpha, by bisection on the regularised upper gamma function."""
    lo, hi = 0.0, 10.0 * df + 100.0
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        sf = torch.special.gammaincc(a, torch.tensor(mid / 2.0, dtype=torch.float64)).item()
        lo, hi = (mid, hi) if sf > alpha else (lo, mid)
    return hi


def assert_fits(tokens: list[int], probs: list[float]) -> None:
    """Chi-square goodness of fit of sampled tokens against `probs`; zero-probability never drawn.

    Tokens expected fewer than 5 times are pooled into one bin (the usual validity rule).
    """
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(probs))]
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), (counts, probs)
    bins = [(counts[i], n * q) for i, q in enumerate(probs) if n * q >= 5]
    small = [(counts[i], n * q) for i, q in enumerate(probs) if 0 < n * q < 5]
    if small:
        pooled = (sum(c for c, _ in small), sum(e for _, e in small))
        if pooled[1] < 5:  # still too small: merge with the least likely big bin
            bins.sort(key=lambda b: b[1])
            pooled = (pooled[0] + bins[0][0], pooled[1] + bins[0][1])
            bins = bins[1:]
        bins.append(pooled)
    if len(bins) < 2:
        return
    stat = sum((c - e) ** 2 / e for c, e in bins)
    crit = chi2_critical(len(bins) - 1, ALPHA)
    assert stat < crit, (stat, crit, bins)


def test_chi2_critical_matches_table() -> None:
    # tabulated chi-square quantiles (alpha = 0.05: df 1 -> 3.841, df 5 -> 11.070)
    assert chi2_critical(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert chi2_critical(5, 0.05) == pytest.approx(11.070, abs=1e-3)


# --- parameters ---------------------------------------------------------------------------------------


def test_default_is_greedy_and_valid() -> None:
    p = Sampling()
    assert p.greedy and not p.uses_penalties
    assert p.validate(10) is p
    assert Sampling.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_normalisation_and_round_trip() -> None:
    p = Sampling(temperature=0.7, stop="END", stop_token_ids=[3], logit_bias={"5": -100, 2: 1.5}, seed=-3)
    assert p.stop == ("END",) and p.stop_token_ids == (3,) and dict(p.logit_bias) == {5: -100, 2: 1.5}
    assert Sampling.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    hash(p)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {1: 100.5}}, "logit_bias[1]"),
        ({"stop": ("ok", "")}, "stop[1]"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
        Sampling(**kwargs).validate(100)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop_token_ids": (5, 100)}, "stop_token_ids"),
    ],
)
def test_token_out_of_range(kwargs: dict, field: str) -> None:
    with pytest.raises(TokenOutOfRange, match=field):
        Sampling(**kwargs).validate(100)


def test_bad_logit_bias_key() -> None:
    with pytest.raises(InvalidArgument, match="logit_bias"):
        Sampling(logit_bias={"abc": 1.0})


def test_edge_values_accepted() -> None:
    Sampling(
        temperature=2.0,
        top_k=1000,
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        logprobs=20,
        logit_bias={0: -100, 99: 100},
        stop_token_ids=(99,),
        seed=2**70,
    ).validate(100)


# --- greedy, bias, penalties ---------------------------------------------------------------------------


def test_greedy_equals_argmax_lowest_index_on_ties() -> None:
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the lower index must win
    states = [SamplerState.create(Sampling(seed=i)) for i in range(6)]
    tokens = sample(logits, states).token_list()
    for row, tok in zip(logits.tolist(), tokens, strict=True):
        assert tok == row.index(max(row))
    assert tokens[2] == 7


def _penalty_case(seed: int) -> tuple[torch.Tensor, list[Sampling], list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    v = 40
    logits = torch.randn(5, v, generator=g) * 3
    rnd = random.Random(seed)
    params, prompts, outputs = [], [], []
    for i in range(5):
        params.append(
            Sampling(
                presence_penalty=rnd.uniform(-2, 2) if i != 1 else 0.0,
                frequency_penalty=rnd.uniform(-2, 2) if i != 1 else 0.0,
                repetition_penalty=rnd.uniform(0.5, 2.0) if i != 1 else 1.0,
                logit_bias={rnd.randrange(v): rnd.uniform(-100, 100) for _ in range(3)} if i != 3 else None,
            )
        )
        prompts.append([rnd.randrange(v) for _ in range(8)])
        outputs.append([rnd.randrange(v) for _ in range(12)])
    return logits, params, prompts, outputs


def test_penalties_and_bias_equal_direct_loop() -> None:
    logits, params, prompts, outputs = _penalty_case(1)
    states = []
    for p, prompt, out in zip(params, prompts, outputs, strict=True):
        st = SamplerState.create(p, prompt)
        for t in out:
            st.append_token(t)
        states.append(st)
    x = _apply_bias_and_penalties(logits.clone(), states)
    for b in range(5):
        ref = ref_penalised(logits[b].tolist(), params[b], prompts[b], outputs[b])
        torch.testing.assert_close(x[b], torch.tensor(ref, dtype=torch.float32), rtol=1e-5, atol=1e-4)
    # greedy decisions see the same shaped logits
    tokens = sample(logits, states).token_list()
    for b in range(5):
        ref = ref_penalised(logits[b].tolist(), params[b], prompts[b], outputs[b])
        assert tokens[b] == ref.index(max(ref))


def test_penalty_tensors_equal_dense_loop() -> None:
    states = [PenaltyState.from_prompt([1, 4, 4, 9]), PenaltyState.from_prompt([])]
    for t in [2, 2, 4, 7]:
        states[0].append(t)
    states[1].append(0)
    counts, mask = build_penalty_tensors(states, 10, "cpu")
    for b, st in enumerate(states):
        for t in range(10):
            assert counts[b, t].item() == st.output_counts.get(t, 0)
            assert mask[b, t].item() == (t in st.prompt_token_ids)
    assert PenaltyState.from_state(json.loads(json.dumps(states[0].state()))) == states[0]


# --- bitmask ------------------------------------------------------------------------------------------


def test_bitmask_equals_direct_loop() -> None:
    g = torch.Generator().manual_seed(3)
    b, v = 3, 75  # not a multiple of 32: the last word's high bits are ignored
    words = (v + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (b, words), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(b, v, generator=g)
    out = apply_token_bitmask(logits.clone(), bitmask)
    for r in range(b):
        for t in range(v):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert out[r, t].item() == (logits[r, t].item() if allowed else -math.inf)
    # the same through `indices` on a wider batch
    big = torch.randn(5, v, generator=g)
    idx = torch.tensor([4, 0, 2])
    out2 = apply_token_bitmask(big.clone(), bitmask, idx)
    for j, r in enumerate(idx.tolist()):
        one = apply_token_bitmask(big[r : r + 1].clone(), bitmask[j : j + 1])
        assert torch.equal(out2[r], one[0])
    for r in (1, 3):
        assert torch.equal(out2[r], big[r])


def test_sample_respects_bitmask() -> None:
    v = 64
    logits = torch.zeros(200, v)
    bitmask = torch.zeros(200, 2, dtype=torch.int32)
    bitmask[:, 1] = 0b1010  # only tokens 33 and 35 allowed
    states = [SamplerState.create(Sampling(temperature=1.0, seed=i)) for i in range(200)]
    tokens = sample(logits, states, bitmask=bitmask).token_list()
    assert set(tokens) == {33, 35}


# --- the random stream -------------------------------------------------------------------------------


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_random_bits_equal_python_reference() -> None:
    pairs = [(0, 0), (123, 7), (-5, 2**40), (2**63 - 1, 1)]
    bits = random_bits(keys_tensor(pairs, "cpu"), 300)
    for row, (seed, step) in enumerate(pairs):
        k0, k1 = stream_key(seed, step)
        for t in (0, 1, 31, 299):
            assert bits[row, t].item() == _fmix32(_fmix32(t ^ k0) ^ k1)


def test_noise_is_row_local() -> None:
    keys = keys_tensor([(s, s * 3) for s in range(23)], "cpu")
    noise = gumbel_noise(keys, 999)
    assert torch.isfinite(noise).all()
    for i in (0, 7, 22):
        assert torch.equal(noise[i], gumbel_noise(keys[i : i + 1], 999)[0])


# --- distributions -------------------------------------------------------------------------------------

CONFIGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.6),
    Sampling(temperature=1.8),
    Sampling(temperature=1.0, top_k=3),
    Sampling(temperature=1.0, top_p=0.8),
    Sampling(temperature=1.0, min_p=0.2),
    Sampling(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
    Sampling(temperature=0.8, top_p=0.7, min_p=0.3),
    # vLLM v1 order: top_p sees the mass min_p left ({0,1,2} here; min_p after top_p keeps {0,1,2,3})
    Sampling(temperature=1.0, top_p=0.85, min_p=0.2),
    Sampling(
        temperature=1.2,
        top_k=5,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={7: 4.0},
    ),
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: repr(p)[9:70])
def test_sampled_frequencies_fit_shaped_distribution(params: Sampling) -> None:
    n = 12000
    prompt, output = [0, 2], [1, 1, 5]
    states = []
    for i in range(n):
        st = SamplerState.create(dataclasses.replace(params, seed=1000 + i), prompt)
        for t in output:
            st.append_token(t)
        states.append(st)
    logits = torch.tensor([LOGITS8] * n)
    tokens = sample(logits, states).token_list()
    assert_fits(tokens, ref_probs(LOGITS8, params, prompt, output))


def test_one_seed_across_steps_fits_and_pairs_are_independent() -> None:
    # one request's stream over many steps: marginal fit, and consecutive tokens independent
    n, v = 16000, 4
    logits4 = [1.0, 0.5, 0.0, -0.5]
    params = Sampling(temperature=1.0, seed=77)
    states = [SamplerState(params=params, seed=77, step=s) for s in range(n)]
    tokens = sample(torch.tensor([logits4] * n), states).token_list()
    probs = ref_probs(logits4, params)
    assert_fits(tokens, probs)
    pairs = [tokens[i] * v + tokens[i + 1] for i in range(0, n - 1, 2)]
    assert_fits(pairs, [probs[a] * probs[b] for a in range(v) for b in range(v)])


def test_top_p_candidate_path_equals_full_sort() -> None:
    g = torch.Generator().manual_seed(4)
    v = 8192  # > 4 * TOP_P_CANDIDATES: the CPU candidate path runs
    logits = torch.randn(6, v, generator=g) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.5], [8.0]])
    logits[5, 100:140] = logits[5].max() + 10  # a block of 40 ties holding nearly all the mass
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.99, 0.49])
    fast = apply_top_p(logits.clone(), top_p)
    probs = (logits - logits.amax(-1, keepdim=True)).exp().double()
    limit = top_p.double()[:, None] * probs.sum(-1, keepdim=True)
    full = logits.clone().masked_fill_(shaping._top_p_sorted(logits, probs, limit), -math.inf)
    assert torch.equal(fast, full)
    kept = torch.isfinite(fast).sum(-1)
    assert (kept[:5] > 1).all()
    # ties rank by token id: the nucleus is the first 20 of the 40 tied tokens
    assert torch.isfinite(fast[5]).nonzero().squeeze(1).tolist() == list(range(100, 120))


# --- reproducibility ------------------------------------------------------------------------------------


def _other_params(rnd: random.Random) -> Sampling:
    return rnd.choice(
        [
            Sampling(),
            Sampling(temperature=0.9, top_p=0.8),
            Sampling(temperature=1.3, top_k=20, logprobs=3),
            Sampling(temperature=0.7, min_p=0.1, presence_penalty=1.0),
            Sampling(repetition_penalty=1.2, logit_bias={3: 5.0}),
            Sampling(temperature=1.0, top_k=5, top_p=0.95, min_p=0.02, frequency_penalty=0.5, logprobs=0),
        ]
    )


@pytest.mark.parametrize("vocab", [300, 6000])
def test_seeded_row_is_batch_invariant(vocab: int) -> None:
    target = Sampling(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        frequency_penalty=0.4,
        logit_bias={5: 2.0},
        seed=4242,
        logprobs=2,
    )
    prompt = [1, 2, 3]
    steps = 10
    g = torch.Generator().manual_seed(5)
    target_logits = [torch.randn(vocab, generator=g) * 2 for _ in range(steps)]

    alone = SamplerState.create(target, prompt)
    alone_tokens, alone_lp = [], []
    for t in range(steps):
        res = sample(target_logits[t][None], [alone])
        tok = res.token_list()[0]
        alone_tokens.append(tok)
        alone_lp.append(res.logprobs()[0])
        alone.append_token(tok)

    rnd = random.Random(6)
    for trial in range(4):
        mine = SamplerState.create(target, prompt)
        others = [SamplerState.create(_other_params(rnd), prompt, rng=rnd) for _ in range(rnd.randint(1, 9))]
        for t in range(steps):
            pos = rnd.randint(0, len(others))  # a different slot every step
            rows = others[:pos] + [mine] + others[pos:]
            logits = torch.randn(len(rows), vocab, generator=g) * 2
            logits[pos] = target_logits[t]
            res = sample(logits, rows)
            tokens = res.token_list()
            assert tokens[pos] == alone_tokens[t], (trial, t)
            assert res.logprobs()[pos] == alone_lp[t]
            for st, tok in zip(rows, tokens, strict=True):
                st.append_token(tok)


def test_save_restore_continues_the_stream() -> None:
    g = torch.Generator().manual_seed(8)
    logits = [torch.randn(1, 500, generator=g) for _ in range(12)]
    params = Sampling(temperature=1.0, top_p=0.95, presence_penalty=0.5)  # no seed: one is drawn
    a = SamplerState.create(params, [4, 5], rng=random.Random(9))
    tokens_a = []
    for t in range(12):
        tok = sample(logits[t], [a]).token_list()[0]
        tokens_a.append(tok)
        a.append_token(tok)
        if t == 5:
            saved = json.dumps(a.state())
    b = SamplerState.from_state(json.loads(saved))
    for t in range(6, 12):
        tok = sample(logits[t], [b]).token_list()[0]
        assert tok == tokens_a[t]
        b.append_token(tok)
    assert b.state() == a.state()


def test_unseeded_requests_draw_seeds() -> None:
    a = SamplerState.create(Sampling(temperature=1.0), rng=random.Random(1))
    b = SamplerState.create(Sampling(temperature=1.0), rng=random.Random(1))
    c = SamplerState.create(Sampling(temperature=1.0))
    d = SamplerState.create(Sampling(temperature=1.0))
    assert a.seed == b.seed and c.seed != d.seed
    assert SamplerState.create(Sampling(seed=5)).seed == 5


# --- logprobs -------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 100, generator=g) * 3
    params = [
        Sampling(temperature=1.0, top_k=3, logprobs=5, seed=1),
        Sampling(),
        Sampling(logprobs=0, presence_penalty=2.0),
        Sampling(temperature=0.5, logprobs=20, seed=2),
    ]
    states = [SamplerState.create(p, [0, 1]) for p in params]
    res = sample(logits, states)
    lps = res.logprobs()
    tokens = res.token_list()
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None and res.logprob_rows == (0, 2, 3)
    for b in (0, 2, 3):
        lp = lps[b]
        assert lp.token == tokens[b]
        assert lp.logprob == pytest.approx(ref[b, tokens[b]].item(), abs=1e-6)
        assert lp.rank == 1 + int((ref[b] > ref[b, tokens[b]]).sum())
        n = params[b].logprobs
        assert len(lp.top) == n
        order = sorted(range(100), key=lambda t: -ref[b, t].item())[:n]
        assert [t for t, _ in lp.top] == order
        for t, value in lp.top:
            assert value == pytest.approx(ref[b, t].item(), abs=1e-6)


def test_ranked_top_orders_ties_by_token_id() -> None:
    """Value descending, ties to the lowest id, whatever k: the independent reference is Python's stable sort."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16).float()  # bf16 values: many ties
    x[1] = 0.5  # a row of one value
    x[2, ::3] = float("-inf")
    x[3, :40] = -0.0
    x[3, 40:80] = 0.0
    for k in (1, 2, 7, 64, 300):
        values, ids = shaping.ranked_top(x, k)
        for r in range(len(x)):
            want = sorted(range(300), key=lambda t: (-x[r, t].item(), t))[:k]
            assert ids[r].tolist() == want, (k, r)
            assert torch.equal(values[r], x[r, want])


def test_top_logprobs_do_not_depend_on_other_rows() -> None:
    """A row's top list is the same alone and next to a row asking for more (topk orders ties by k)."""
    logits = torch.zeros(2, 4096)
    logits[:, 100:140] = 3.0  # 40 tied maxima
    alone = sample(logits[:1], [SamplerState.create(Sampling(logprobs=2))]).logprobs()[0]
    both = sample(logits, [SamplerState.create(Sampling(logprobs=n)) for n in (2, 20)]).logprobs()
    assert [t for t, _ in alone.top] == [t for t, _ in both[0].top] == [100, 101]
    assert [t for t, _ in both[1].top] == list(range(100, 120))


def test_no_logprobs_no_tensors() -> None:
    res = sample(torch.randn(2, 10), [SamplerState.create(Sampling()) for _ in range(2)])
    assert res.logprobs() == [None, None] and res.chosen_logprobs is None


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(InvalidArgument):
        sample(torch.randn(3, 10), [SamplerState.create(Sampling())])
    with pytest.raises(InvalidArgument):
        narrow = torch.zeros(1, 2, dtype=torch.int32)  # covers 64 of 70 tokens
        sample(torch.randn(1, 70), [SamplerState.create(Sampling())], bitmask=narrow)


def test_triton_requested_on_a_cpu_without_the_interpreter_samples_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """SUPERSLM_KERNELS=triton cannot run on CPU tensors without TRITON_INTERPRET=1: sample() keeps its
    staged path instead of raising."""
    from superslm.sampling import SamplerState, Sampling, sample

    monkeypatch.setenv("SUPERSLM_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplerState(Sampling(), seed=0), SamplerState(Sampling(temperature=0.7, seed=3), seed=3)]
    rows.append(SamplerState(Sampling(top_k=5, temperature=1.0, seed=4), seed=4))
    got = sample(logits, rows).tokens
    monkeypatch.setenv("SUPERSLM_KERNELS", "torch")
    assert torch.equal(got, sample(logits, rows).tokens)
