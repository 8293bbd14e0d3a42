"""The expert cache (models/expert_cache.py): a mixture of experts keeping some experts on the device and reading the
others from host memory. Here the device is the CPU (no GPU in CI): the reads, the slots' order, the counts and the
answers are the same code a GPU runs; a CUDA test runs where one is present."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import superslm
from superslm import Request, Sampling
from superslm.errors import InvalidArgument
from superslm.models.expert_cache import ExpertCache
from superslm.models.layers import MoE
from superslm.quant.int4 import Int4Linear
from tests.tiny_models import build_hf_model, hf_greedy


class _Expert(nn.Module):
    """The two linears an expert slot holds (as models/layers.py DenseMLP)."""

    def __init__(self, seed: int, fmt: str = "dense") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        up, down = torch.randn(64, 64, generator=g), torch.randn(64, 32, generator=g)
        if fmt == "int4":
            self.gate_up, self.down = Int4Linear.from_dense(up, group=32), Int4Linear.from_dense(down, group=32)
        else:
            self.gate_up, self.down = nn.Linear(64, 64, bias=False), nn.Linear(32, 64, bias=False)
            with torch.no_grad():
                self.gate_up.weight.copy_(up)
                self.down.weight.copy_(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate_up(x)[:, :32]))


@pytest.mark.parametrize("fmt", ["dense", "int4"])
def test_slots_read_least_recently_used_out(fmt: str) -> None:
    """Each get gives the expert's own weights (compared with a copy of every expert made before the cache took
    them); a miss reads into the least recently used slot; hits and misses count every get."""
    experts = [_Expert(e, fmt) for e in range(5)]
    x = torch.randn(3, 64)
    want = [e(x) for e in experts]
    cache = ExpertCache(experts, 2, "cpu")
    assert cache.stats() == {"slots": 2, "hits": 0, "misses": 0, "read_ms": 0.0}
    order = [0, 1, 0, 2, 3, 0, 4, 4, 1, 2]
    # slots start with experts 0 and 1; the LRU order after each get decides what the next miss evicts
    hits = [True, True, True, False, False, False, False, True, False, False]
    for e, hit in zip(order, hits, strict=True):
        before = cache.hits
        module = cache.get(e)
        assert (cache.hits > before) == hit, f"expert {e}"
        assert torch.equal(module(x), want[e]), f"expert {e} in its slot computes another expert"
    assert (cache.hits, cache.misses) == (sum(hits), len(hits) - sum(hits))
    assert len({id(m) for m in cache.slots}) == 2 and cache.read_ms > 0


def test_bad_slots_and_experts_are_refused() -> None:
    experts = [_Expert(e) for e in range(3)]
    for slots in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgument):
            ExpertCache(experts, slots, "cpu")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ExpertCache([], 1, "cpu")
    with pytest.raises(InvalidArgument, match="one layout"):
        ExpertCache([_Expert(0), _Expert(1, "int4")], 1, "cpu")
    with pytest.raises(IndexError):
        ExpertCache(experts, 2, "cpu").get(3)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return folder, build_hf_model("qwen3_moe", folder)


def test_block_with_slots_computes_the_same(moe_folder) -> None:
    """A block with 2 slots of its 8 experts gives the bits of the block with every expert (the same torch ops on
    the same weights), counts its tokens the same, and its gets are one per expert the router chose."""
    folder, _ = moe_folder
    full = superslm.load(folder).net
    cached = superslm.load(folder, expert_slots=2).net
    a = next(layer.mlp for layer in full.layers if isinstance(layer.mlp, MoE))
    b = next(layer.mlp for layer in cached.layers if isinstance(layer.mlp, MoE))
    assert b.expert_cache is not None and len(b.expert_slots) == 2 and not hasattr(b, "experts_mlp")
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 17):
        x = torch.randn(n, a.router.weight.shape[1], generator=g)
        before = b.tokens_per_expert.clone()
        gets = b.expert_cache.hits + b.expert_cache.misses
        want, got = a(x, True), b(x, True)
        assert torch.equal(got, want)
        used = int(((b.tokens_per_expert - before) > 0).sum())
        assert b.expert_cache.hits + b.expert_cache.misses - gets == used
    assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)


def test_engine_with_expert_slots_matches_transformers(moe_folder) -> None:
    """Greedy tokens of an engine whose MoE blocks keep 2 of 8 experts are transformers' (and the full engine's);
    Engine.expert_cache counts the reads; a model without experts refuses slots."""
    folder, hf = moe_folder
    prompt = [3, 17, 42, 9, 101, 7, 64, 5]
    want = hf_greedy(hf, prompt, 12)
    model = superslm.load(folder, expert_slots=2)
    engine = model.engine(slots=2, context=64)
    assert engine.expert_cache()["misses"] == 0
    got = engine.generate([Request(prompt, 12, Sampling(temperature=0)) for _ in range(2)])
    assert [r.tokens for r in got] == [want, want]
    stats = engine.expert_cache()
    assert stats["slots"] == 2 and stats["blocks"] == sum(model.source.arch.moe_layers)
    assert stats["misses"] > 0 and stats["hits"] > 0 and stats["read_ms"] > 0
    assert superslm.load(folder).engine(slots=1, context=64).expert_cache()["blocks"] == 0
    dense = folder.parent / "llama"
    build_hf_model("llama", dense)
    with pytest.raises(InvalidArgument, match="no mixture-of-experts"):
        superslm.load(dense, expert_slots=2)
    with pytest.raises(InvalidArgument, match="expert_slots"):
        superslm.load(folder, expert_slots=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_gpu_slots_hold_the_device_layout(moe_folder) -> None:
    """On a GPU: the slots are on the device, the host copies pinned in the device's layout, the tokens the same."""
    folder, hf = moe_folder
    prompt = [3, 17, 42, 9, 101, 7, 64, 5]
    model = superslm.load(folder, device="cuda", expert_slots=2, quant="int4")
    moe = next(layer.mlp for layer in model.net.layers if isinstance(layer.mlp, MoE))
    assert all(t.is_cuda for t in moe.expert_slots.parameters()) or all(t.is_cuda for t in moe.expert_slots.buffers())
    assert all(t.is_pinned() for state in moe.expert_cache.host for t in state.values())
    full = superslm.load(folder, device="cuda", quant="int4")
    req = [Request(prompt, 8, Sampling(temperature=0))]
    assert model.engine(slots=1, context=64).generate(req)[0].tokens == \
        full.engine(slots=1, context=64).generate(req)[0].tokens


def test_cli_expert_slots(moe_folder, tmp_path) -> None:
    """`superslm generate --expert-slots N` answers as without; a model without experts gets a clear error."""
    from tests.test_cli import superslm as run

    folder, _ = moe_folder
    base = ["generate", "--model", str(folder), "--max-tokens", "6", "--temperature", "0", "-p", "Once upon a"]
    plain, slotted = run(*base), run(*base, "--expert-slots", "3")
    assert plain.returncode == slotted.returncode == 0, slotted.stderr
    assert slotted.stdout == plain.stdout and plain.stdout.strip()
    build_hf_model("llama", tmp_path / "llama")
    bad = run("generate", "--model", str(tmp_path / "llama"), "--expert-slots", "2", "-p", "hi")
    assert bad.returncode != 0 and "no mixture-of-experts" in bad.stderr and "Traceback" not in bad.stderr


def test_metrics_count_the_expert_cache(moe_folder) -> None:
    """/metrics (prometheus_client's parser) carries the engine's expert-cache counts after a request; a server
    without the cache writes none of them."""
    import openai

    from superslm.serve import create_app
    from tests.test_server_helpers import LiveServer
    from tests.test_server_metrics import scrape

    folder, _ = moe_folder
    app = create_app(superslm.load(folder, expert_slots=2), slots=2, context=64, served_model_name="moe")
    with LiveServer(app) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        c.completions.create(model="moe", prompt="one two three", max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
        m = scrape(s.url)
        stats = s.state.engine.expert_cache()
        assert m["superslm_expert_cache_slots"] == {(): 2}
        assert m["superslm_expert_cache_hits_total"] == {(): stats["hits"]}
        assert m["superslm_expert_cache_misses_total"] == {(): stats["misses"]} and stats["misses"] > 0
        assert m["superslm_expert_cache_read_seconds_total"][()] > 0
    with LiveServer(create_app(superslm.load(folder), slots=1, context=64)) as s:
        assert "superslm_expert_cache_slots" not in scrape(s.url)
