"""Decode steps from static buffers (engine/graphs.py): the same tokens as the step built per call, padding
rows that touch no KV, and the refusals. On a CPU the Triton kernels run under TRITON_INTERPRET=1 and the
static step runs eagerly; on a GPU the graphs are captured and replayed."""

from __future__ import annotations

import random

import pytest
import torch

from tests.triton_interpret import ON_GPU, import_kernels

tk = import_kernels()
# the Triton interpreter over a whole engine: slow
pytestmark = [pytest.mark.usefixtures("triton_interpret"), pytest.mark.slow]

import superslm  # noqa: E402
from superslm import Request, Sampling  # noqa: E402
from superslm.engine.graphs import BUCKETS, DecodeGraphs, bucket_for, graph_reason  # noqa: E402
from superslm.errors import InvalidArgument  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from tests.tiny_models import build_hf_model, hf_greedy, two_layers  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[superslm.Model, object]:
    folder = tmp_path_factory.mktemp("tiny-qwen3-graphs")
    # two layers: buckets, padding rows and replays do not depend on the depth (a layer budget of 1 still
    # slices a step)
    hf = build_hf_model("qwen3", folder, spec=two_layers("qwen3"))
    return superslm.load(folder, device="cuda" if ON_GPU else "cpu", dtype="fp32"), hf


@pytest.fixture()
def kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV, "triton")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def run(model: superslm.Model, ps: list[list[int]], n: int, graphs: bool) -> tuple[list[list[int]], object]:
    engine = model.engine(slots=4, context=64, page_size=4, graphs=graphs)
    done = engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])
    return [c.tokens for c in done], engine


def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 17, 33, 65, 257)] == [1, 2, 4, 8, 16, 24, 48, 96, 320]
    assert bucket_for(BUCKETS[-1] + 1) is None
    assert bucket_for(3, (1, 2)) is None


def test_one_sequence_is_transformers_greedy(tiny, kernels) -> None:
    model, hf = tiny
    (p,) = prompts(1, seed=1)
    (ours,), engine = run(model, [p], 8, graphs=True)
    assert ours == hf_greedy(hf, p, 8)
    graphs = engine.graphs
    assert isinstance(graphs, DecodeGraphs) and list(graphs._made) == [1]
    assert all((g.graph is not None) == ON_GPU for g in graphs._made.values())


def test_padded_batches_give_the_tokens_of_built_steps(tiny, kernels) -> None:
    # 3 sequences of different lengths: bucket 4, one padding row; then 2 and 1 as they finish
    model, _ = tiny
    ps = prompts(3, seed=2)
    rng = random.Random(3)
    reqs_n = [rng.randint(3, 9) for _ in ps]
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True)
    got = [c.tokens for c in engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p, n in zip(ps, reqs_n)])]
    plain = model.engine(slots=4, context=64, page_size=4, graphs=False)
    want = [c.tokens for c in plain.generate([Request(p, n, Sampling(ignore_eos=True)) for p, n in zip(ps, reqs_n)])]
    assert got == want and [len(t) for t in got] == reqs_n
    assert {2, 4} <= set(engine.graphs._made)
    assert plain.graphs is None


def test_padding_rows_write_no_kv(tiny, kernels) -> None:
    model, _ = tiny
    ps = prompts(3, seed=4)
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True, prefix_caching=False)
    engine.kv.k.fill_(7.0)
    engine.kv.v.fill_(7.0)
    n = 5
    engine.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])
    assert 4 in engine.graphs._made  # three sequences ran in bucket 4, with a padding row
    written = (engine.kv.k[0] != 7.0).flatten(1).any(1)
    # every prompt token and every sampled token but the last has its key stored, nothing else
    assert written.sum().item() == sum(len(p) + n - 1 for p in ps)
    assert torch.equal((engine.kv.v[0] != 7.0).flatten(1).any(1), written)
    # and the same values as the steps built per call (same pages in the same order): a padding row that
    # wrote into a used slot (page 0 is handed out first) would change one
    plain = model.engine(slots=4, context=64, page_size=4, graphs=False, prefix_caching=False)
    plain.kv.k.fill_(7.0)
    plain.kv.v.fill_(7.0)
    plain.generate([Request(p, n, Sampling(ignore_eos=True)) for p in ps])
    torch.testing.assert_close(engine.kv.k, plain.kv.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.kv.v, plain.kv.v, atol=1e-5, rtol=1e-5)


def test_padding_rows_leave_other_sequences_kv_alone(tiny, kernels) -> None:
    """On int8 pages the decode step stores k and v apart from the attention (prepare_qkv), where a row's
    slot alone keeps it from writing: the decode steps leave every prompt's keys and values as the prompt
    step wrote them (a padding row at slot 0 would overwrite the first sequence's first ones) and write one
    slot per token they compute. On float pages the fused decode attention also skips rows that read no
    keys, so there it would not show."""
    model, _ = tiny
    ps = prompts(3, seed=4)
    n = 4
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True, prefix_caching=False, kv="int8")
    ids = [engine.add(Request(p, n, Sampling(ignore_eos=True))) for p in ps]
    engine.advance()  # the prompts, in one built step
    seqs = [engine.output.seqs[i] for i in ids]
    assert [s.num_computed_tokens for s in seqs] == [len(p) for p in ps]
    size = engine.kv.page_size
    prompt_slots = [s.block_table[q // size] * size + q % size for s in seqs for q in range(s.num_computed_tokens)]
    assert 0 in prompt_slots
    k, v = engine.kv.k.clone(), engine.kv.v.clone()
    while engine.busy():
        engine.advance()
    assert list(engine.graphs._made) == [4]  # three sequences in bucket 4: one padding row each step
    for old, new in ((k, engine.kv.k), (v, engine.kv.v)):
        torch.testing.assert_close(new[:, prompt_slots], old[:, prompt_slots], atol=0, rtol=0)
        changed = (old != new).flatten(2).any(-1)  # [layers, slots]
        # each decode step computes one token of each sequence: all sampled tokens but the last
        assert changed.sum(1).tolist() == [len(ps) * (n - 1)] * changed.shape[0]


def test_sampling_and_layer_budgets_run_with_graphs(tiny, kernels) -> None:
    model, _ = tiny
    ps = prompts(2, seed=5)
    seeded = [Request(p, 6, Sampling(temperature=0.8, top_k=20, seed=11, ignore_eos=True)) for p in ps]
    a = model.engine(slots=4, context=64, page_size=4, graphs=True).generate(seeded)
    b = model.engine(slots=4, context=64, page_size=4, graphs=False).generate(seeded)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    # a layer budget slices the step layer by layer: those steps take the built path
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True)
    engine.add(Request(ps[0], 4, Sampling(ignore_eos=True)))
    tokens = []
    while engine.busy():
        tokens += [t for p in engine.advance(layer_budget=1) for t in p.tokens]
    assert tokens == run(model, [ps[0]], 4, graphs=False)[0][0]
    assert not engine.graphs._made


def test_refusals(tiny, kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny
    with pytest.raises(InvalidArgument, match="deterministic"):
        model.engine(slots=2, context=32, graphs=True, deterministic=True)
    assert "deterministic" in (graph_reason(model.net, True) or "")
    with pytest.raises(InvalidArgument, match="at most"):
        DecodeGraphs(model.net, model.engine(slots=1, context=32).kv, BUCKETS[-1] + 1, 32)
    if not ON_GPU:
        with pytest.raises(InvalidArgument, match="CUDA"):
            DecodeGraphs(model.net, model.engine(slots=1, context=32).kv, 2, 32, capture=True)
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert "torch references" in (graph_reason(model.net, False) or "")
    with pytest.raises(InvalidArgument, match="graphs=True"):
        model.engine(slots=2, context=32, graphs=True)


def test_warm_up_makes_every_bucket(tiny, kernels) -> None:
    model, _ = tiny
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True)
    assert engine.warm_up_graphs() > 0 and set(engine.graphs._made) == {1, 2, 4}
    made = dict(engine.graphs._made)
    ps = prompts(3, seed=6)
    got = [c.tokens for c in engine.generate([Request(p, 4, Sampling(ignore_eos=True)) for p in ps])]
    assert engine.graphs._made == made  # nothing built during the run
    assert got == run(model, ps, 4, graphs=False)[0]
    assert model.engine(slots=2, context=32, graphs=False).warm_up_graphs() == 0.0


def test_a_failed_capture_runs_eagerly(tiny, kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny
    engine = model.engine(slots=2, context=64, page_size=4, graphs=True)
    engine.graphs.capture = True  # as on a GPU, with a kernel that cannot be captured

    def fail(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.graphs, "_capture", fail)
    ps = prompts(2, seed=7)
    with pytest.warns(UserWarning, match="capture failed"):
        got = [c.tokens for c in engine.generate([Request(p, 4, Sampling(ignore_eos=True)) for p in ps])]
    assert "not permitted" in (engine.graphs.capture_error or "")
    assert engine.graphs._made and all(g.graph is None for g in engine.graphs._made.values())
    assert got == run(model, ps, 4, graphs=False)[0]


def test_a_changed_backend_takes_the_built_path(tiny, kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    # the static metadata's host tuples are placeholders: the torch path must never see them
    model, _ = tiny
    ps = prompts(3, seed=8)
    engine = model.engine(slots=4, context=64, page_size=4, graphs=True)
    engine.warm_up_graphs()
    monkeypatch.setenv(dispatch.ENV, "torch")
    got = [c.tokens for c in engine.generate([Request(p, 5, Sampling(ignore_eos=True)) for p in ps])]
    assert got == run(model, ps, 5, graphs=False)[0]
