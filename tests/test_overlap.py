"""Decode steps launched ahead (engine/overlap.py): the step after a graph step starts from its tokens on the
device before the host accepts it. Tokens, Progress, KV and pages are those of steps run one at a time;
sequences that end drop their row of the step ahead; cancel, save/restore and new requests meet a step in
flight. On a CPU the static steps run eagerly under TRITON_INTERPRET=1 (no overlap in time, the same logic).
"""

from __future__ import annotations

import random

import pytest

from tests.triton_interpret import ON_GPU, import_kernels

tk = import_kernels()
# the Triton interpreter over a whole engine: slow
pytestmark = [pytest.mark.usefixtures("triton_interpret"), pytest.mark.slow]

import superslm  # noqa: E402
from superslm import Request, Sampling  # noqa: E402
from superslm.engine import overlap as overlap_mod  # noqa: E402
from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from tests.tiny_models import CONFIGS, build_hf_model, hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[superslm.Model, object]:
    folder = tmp_path_factory.mktemp("tiny-qwen3-overlap")
    # two layers: what a step launched ahead does with its rows, KV and pages does not depend on the depth
    cls, kw = CONFIGS["qwen3"]
    hf = build_hf_model("qwen3", folder, spec=(cls, dict(kw, num_hidden_layers=2)))
    return superslm.load(folder, device="cuda" if ON_GPU else "cpu", dtype="fp32"), hf


@pytest.fixture()
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")


class Launches(list):
    """How many sequences each step launched ahead had; `waiting`: requests queued at each launch."""

    waiting: list[int]


@pytest.fixture()
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    seen = Launches()
    seen.waiting = []
    real = overlap_mod.GraphSteps._launch_ahead

    def spy(self, step) -> None:  # noqa: ANN001
        before = self.in_flight
        real(self, step)
        if self.in_flight is not None and self.in_flight is not before:
            seen.append(len(self.in_flight.work.chunks))
            seen.waiting.append(len(self.scheduler.waiting))

    monkeypatch.setattr(overlap_mod.GraphSteps, "_launch_ahead", spy)
    return seen


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def engine(model: superslm.Model, overlap: bool, **kw) -> superslm.Engine:
    return model.engine(slots=4, context=64, page_size=4, graphs=True, overlap=overlap, **kw)


def test_greedy_equals_steps_one_at_a_time(tiny, kernels, launches) -> None:
    model, hf = tiny
    ps = prompts(3, seed=1)
    reqs = [Request(p, n, Sampling(ignore_eos=True)) for p, n in zip(ps, (9, 4, 6))]
    on = engine(model, True)
    got = on.generate(reqs)
    want = engine(model, False).generate(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert got[0].tokens == hf_greedy(hf, ps[0], 9)
    assert launches and max(launches) == 3  # steps went ahead, also for the whole batch
    # every page is back (prefix caching keeps full prompt pages, but nothing is held by a sequence)
    assert not on.busy() and on.runner.in_flight is False
    assert on.pool.num_used == 0


def test_seeded_sampling_equals_steps_one_at_a_time(tiny, kernels, launches) -> None:
    model, _ = tiny
    ps = prompts(2, seed=5)
    reqs = [Request(p, 7, Sampling(temperature=0.8, top_k=20, seed=11 + i, ignore_eos=True))
            for i, p in enumerate(ps)]  # fmt: skip
    got = engine(model, True).generate(reqs)
    want = engine(model, False).generate(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert launches


def test_stops_end_where_they_would(tiny, kernels, launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop token met by a step whose successor is in flight: the successor's row is dropped."""
    model, _ = tiny
    ended_rows: list[int] = []  # at each step in flight accepted: its rows of sequences already ended
    real = overlap_mod.GraphSteps.settle

    def settle(self, out, go_on=False) -> int:  # noqa: ANN001
        if self.in_flight is not None:
            ended_rows.append(sum(seq.id not in self.output.seqs for seq, _ in self.in_flight.work.chunks))
        return real(self, out, go_on)

    monkeypatch.setattr(overlap_mod.GraphSteps, "settle", settle)
    ps = prompts(3, seed=7)
    free = engine(model, False).generate([Request(p, 10, Sampling(ignore_eos=True)) for p in ps])
    # stop the first at a token that a decode step four or more steps in samples first (a token met earlier,
    # say the prefill's, would end it before any step went ahead), the others run on
    first = next(i for i, t in enumerate(free[0].tokens) if i >= 3 and t not in free[0].tokens[:i])
    stop = free[0].tokens[first]
    reqs = [Request(ps[0], 10, Sampling(ignore_eos=True, stop_token_ids=[stop]))] + [
        Request(p, 10, Sampling(ignore_eos=True)) for p in ps[1:]
    ]
    on = engine(model, True, prefix_caching=False)
    ids = [on.add(r) for r in reqs]
    got: dict[int, list[int]] = {i: [] for i in ids}
    reports: list[tuple[int, str | None]] = []
    while on.busy():
        for q in on.advance():
            got[q.id] += q.tokens
            reports.append((q.id, q.end))
    want = engine(model, False, prefix_caching=False).generate(reqs)
    assert [got[i] for i in ids] == [c.tokens for c in want]
    assert want[0].end == "stop" and want[0].tokens == free[0].tokens[:first]  # the stop token is not output
    # one end for each, reported last: nothing for a sequence after its end (its row of the step in flight
    # is dropped)
    for rid in ids:
        mine = [end for i, end in reports if i == rid]
        assert mine[-1] and not any(mine[:-1]), mine
    assert launches and 1 in ended_rows  # the stop met a step in flight, which dropped that row
    assert on.pool.num_used == 0
    on.pool.check()
    # a lone request that stops: the step launched after its last leaves nothing in flight
    lone = engine(model, True, prefix_caching=False)
    (c,) = lone.generate([reqs[0]])
    assert c.end == "stop" and not lone.busy() and lone.runner.in_flight is False
    steps = lone.steps
    assert lone.advance() == [] and lone.steps == steps


def test_cancel_and_new_requests_meet_a_step_in_flight(tiny, kernels, launches) -> None:
    model, _ = tiny
    ps = prompts(3, seed=9)

    def drive(overlap: bool) -> tuple[dict[int, list[int]], dict[int, str], superslm.Engine]:
        e = engine(model, overlap, prefix_caching=False)
        ids = [e.add(Request(p, 12, Sampling(ignore_eos=True))) for p in ps[:2]]
        toks: dict[int, list[int]] = {}
        ends: dict[int, str] = {}
        calls = 0
        while e.busy():
            for p in e.advance():
                toks.setdefault(p.id, []).extend(p.tokens)
                if p.end:
                    assert p.id not in ends  # one end each, reported once
                    ends[p.id] = p.end
            calls += 1
            if calls == 4:
                e.cancel(ids[1])
                ids.append(e.add(Request(ps[2], 5, Sampling(ignore_eos=True))))
        return toks, ends, e

    got, got_ends, on = drive(True)
    want, want_ends, _ = drive(False)
    assert got_ends == want_ends and got_ends[1] == "cancelled"
    assert got[0] == want[0] and got[2] == want[2]  # the others' tokens do not move
    assert len(got[1]) == len(want[1])  # tokens reported before the cancel: the same steps
    assert launches
    assert on.pool.num_used == 0


def test_save_restore_with_a_step_in_flight(tiny, kernels, launches) -> None:
    model, _ = tiny
    (p,) = prompts(1, seed=11)
    full = engine(model, False).generate([Request(p, 10, Sampling(ignore_eos=True))])[0].tokens
    on = engine(model, True)
    rid = on.add(Request(p, 10, Sampling(ignore_eos=True)))
    seen: list[int] = []
    while len(seen) < 4:
        seen += [t for q in on.advance() for t in q.tokens]
    assert on.runner.in_flight  # the next step is running
    blob = on.save(rid)  # accepts it first: its token comes with the next advance
    assert on.runner.in_flight is False
    settled = [t for q in on.output.pending for t in q.tokens]  # what the next advance reports first
    assert len(settled) == 1
    other = engine(model, True)
    rid2 = other.restore(blob)
    rest: list[int] = []
    while other.busy():
        rest += [t for q in other.advance() if q.id == rid2 for t in q.tokens]
    assert seen + settled + rest == full
    # and the saved engine goes on as if nothing happened
    while on.busy():
        seen += [t for q in on.advance() for t in q.tokens]
    assert seen == full


def test_host_sampled_rows_do_not_go_ahead(tiny, kernels, launches) -> None:
    """Penalties count the tokens on the host, logprobs are computed there: such steps are accepted first."""
    model, _ = tiny
    ps = prompts(2, seed=13)
    reqs = [Request(ps[0], 6, Sampling(ignore_eos=True, repetition_penalty=1.3)),
            Request(ps[1], 6, Sampling(ignore_eos=True, logprobs=2))]  # fmt: skip
    got = engine(model, True).generate(reqs)
    want = engine(model, False).generate(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]
    assert not launches


def test_defaults_and_refusals(tiny, kernels) -> None:
    model, _ = tiny
    assert engine(model, None).overlap is ON_GPU  # by default where graphs are captured
    assert model.engine(slots=2, context=32, graphs=False).overlap is False
    with pytest.raises(InvalidArgument, match="overlap"):
        model.engine(slots=2, context=32, graphs=False, overlap=True)
    # a layer budget settles the step in flight and launches none
    e = engine(model, True)
    e.add(Request(prompts(1, seed=3)[0], 6, Sampling(ignore_eos=True)))
    e.advance()
    e.advance()
    assert e.runner.in_flight
    e.advance(layer_budget=1)
    assert e.runner.in_flight is False


def test_a_restored_request_is_scheduled_at_once(tiny, kernels, launches) -> None:
    """A restored sequence joins the running set directly: steps launched ahead for the others stop, so
    it gets its next token in the next step, as without overlap."""
    model, _ = tiny
    ps = prompts(3, seed=15)
    src = engine(model, False)
    rid = src.add(Request(ps[2], 8, Sampling(ignore_eos=True)))
    while not src.output.seqs[rid].output:
        src.advance()
    blob = src.save(rid)
    on = engine(model, True)
    for p in ps[:2]:
        on.add(Request(p, 20, Sampling(ignore_eos=True)))
    for _ in range(4):
        on.advance()
    assert on.runner.in_flight
    back = on.restore(blob)
    got = [t for _ in range(3) for q in on.advance() if q.id == back for t in q.tokens]
    assert got  # within three advances (the step in flight, then a scheduled step)


def test_full_slots_with_a_queue_go_ahead(tiny, kernels, launches) -> None:
    """Every slot busy and requests waiting: no admission is possible, so steps still go ahead; a freed
    slot is filled by the next schedule. Tokens equal the steps run one at a time (fp32, tiny model)."""
    model, _ = tiny
    ps = prompts(3, seed=17)
    reqs = [Request(p, n, Sampling(ignore_eos=True)) for p, n in zip(ps, (4, 9, 6))]
    on = model.engine(slots=2, context=64, page_size=4, graphs=True, overlap=True)
    got = on.generate(reqs)
    off = model.engine(slots=2, context=64, page_size=4, graphs=True, overlap=False)
    want = off.generate(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert max(launches.waiting) == 1 and on.pool.num_used == 0  # steps went ahead with the third queued
