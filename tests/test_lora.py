"""LoRA adapters against transformers + peft, alone and in mixed batches."""

from __future__ import annotations

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.errors import AdapterInUse, AdapterMismatch, InvalidArgument
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf, folder, seed: int, rslora: bool, targets=TARGETS):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                       use_rslora=rslora))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)  # make the adapter matter
    pm.save_pretrained(folder)
    return pm


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def setup(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = build_hf_model(request.param, base)
    pa = make_adapter(hf, base / "a1", 1, rslora=False)
    logits_a = lambda ids: pa(torch.tensor([ids])).logits[0]  # noqa: E731
    hf2 = build_hf_model(request.param, tmp_path_factory.mktemp("again"))
    pb = make_adapter(hf2, base / "a2", 2, rslora=True, targets=["q_proj", "v_proj", "down_proj"])
    logits_b = lambda ids: pb(torch.tensor([ids])).logits[0]  # noqa: E731
    return superslm.load(base), base, logits_a, logits_b, pb


def run(engine, reqs):
    return engine.generate(reqs)


def check(completion, prompt, logits_fn) -> None:
    with torch.no_grad():
        full = logits_fn(prompt + completion.tokens).float().log_softmax(-1)
    for i, lp in enumerate(completion.logprobs):
        assert lp.token == completion.tokens[i]
        assert abs(lp.logprob - full[len(prompt) - 1 + i, lp.token].item()) <= 1e-4
        assert lp.token == int(full[len(prompt) - 1 + i].argmax())


@pytest.mark.float_kv
def test_adapters_match_peft_alone_and_mixed(setup) -> None:
    model, base, logits_a, logits_b, _ = setup
    a1, a2 = model.adapter(base / "a1"), model.adapter(base / "a2")
    p1, p2, p3 = prompts(3, seed=60, lo=8, hi=20)
    s = Sampling(logprobs=1, ignore_eos=True)
    engine = model.engine(slots=4, context=64)
    alone = run(engine, [Request(p1, 6, s, adapter=a1)])[0]
    check(alone, p1, logits_a)
    mixed = run(engine, [Request(p2, 6, s, adapter=a2), Request(p1, 6, s, adapter=a1), Request(p3, 6, s)])
    check(mixed[0], p2, logits_b)
    check(mixed[1], p1, logits_a)
    assert mixed[1].tokens == alone.tokens
    plain = run(model.engine(slots=1, context=64), [Request(p3, 6, s)])[0]
    assert mixed[2].tokens == plain.tokens  # rows without an adapter are untouched
    # the prefix cache never hands one adapter's pages to another
    again = run(engine, [Request(p1, 6, s, adapter=a2)])[0]
    assert again.cached == 0


def test_merged_equals_runtime(setup, tmp_path) -> None:
    model, base, _, _, pb = setup
    merged = pb.merge_and_unload()
    merged.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((base / name).read_bytes())
    merged_model = superslm.load(tmp_path)
    p = prompts(1, seed=61)[0]
    s = Sampling(logprobs=1, ignore_eos=True)
    runtime = run(model.engine(slots=1, context=64), [Request(p, 6, s, adapter=model.adapter(base / "a2"))])[0]
    folded = run(merged_model.engine(slots=1, context=64), [Request(p, 6, s)])[0]
    assert runtime.tokens == folded.tokens
    assert max(abs(x.logprob - y.logprob) for x, y in zip(runtime.logprobs, folded.logprobs)) <= 1e-4


def test_adapter_refusals(setup, tmp_path) -> None:
    model, base, *_ = setup
    a1 = model.adapter(base / "a1")
    engine = model.engine(slots=1, context=64)
    rid = engine.add(Request([3, 4, 5], 4, Sampling(), adapter=a1))
    with pytest.raises(AdapterInUse):
        a1.unmap()
    engine.cancel(rid)
    a1.unmap()
    with pytest.raises(AdapterInUse):
        engine.add(Request([3, 4, 5], 4, Sampling(), adapter=a1))
    other = build_hf_model("llama", tmp_path / "other")
    make_adapter(other, tmp_path / "other" / "ad", 3, rslora=False)
    with pytest.raises(AdapterMismatch):
        model.adapter(tmp_path / "other" / "ad")
    other_model = superslm.load(tmp_path / "other")
    with pytest.raises(AdapterMismatch):
        other_model.engine(slots=1, context=64).add(Request([3], 2, adapter=model.adapter(base / "a2")))


def test_deterministic_mode_with_adapters_mapped(setup) -> None:
    # one arithmetic for every step while an adapter is mapped: bits equal alone and mixed
    model, base, _, _, _ = setup
    a1 = model.adapter(base / "a1")
    p1, p2 = prompts(2, seed=61, lo=9, hi=21)
    s = Sampling(logprobs=1, ignore_eos=True)
    engine = model.engine(slots=4, context=64, deterministic=True)
    alone_plain = run(engine, [Request(p2, 6, s)])[0]
    alone_lora = run(engine, [Request(p1, 6, s, adapter=a1)])[0]
    mixed = run(engine, [Request(p1, 6, s, adapter=a1), Request(p2, 6, s)])
    assert mixed[0].tokens == alone_lora.tokens and mixed[1].tokens == alone_plain.tokens
    assert [lp.logprob for lp in mixed[0].logprobs] == [lp.logprob for lp in alone_lora.logprobs]
    assert [lp.logprob for lp in mixed[1].logprobs] == [lp.logprob for lp in alone_plain.logprobs]
    a1.unmap()


def test_adapted_requests_save_restore_and_share_safely(setup) -> None:
    """A saved adapted request continues exactly when its adapter is handed back to restore() (it used to
    continue without it) and is refused with none, another one, or one for a request saved without; an adapter
    in use in one engine cannot be unmapped from another engine's id-0 request ending; a prefix handle (base
    model KV) cannot serve an adapted request."""
    model, base, *_ = setup
    a1, a2 = model.adapter(base / "a1"), model.adapter(base / "a2")
    p, s = prompts(1, seed=8)[0], Sampling(ignore_eos=True)
    want = model.engine(slots=2, context=128).generate([Request(p, 10, s, adapter=a1)])[0].tokens
    e = model.engine(slots=2, context=128)
    rid = e.add(Request(p, 10, s, adapter=a1))
    head: list[int] = []
    while len(head) < 4:
        for pr in e.advance():
            head += pr.tokens
    blob = e.save(rid)
    e.cancel(rid)
    for wrong in (None, a2):
        with pytest.raises(AdapterMismatch):
            e.restore(blob, adapter=wrong)
    plain = model.engine(slots=1, context=128)
    with pytest.raises(AdapterMismatch):  # saved without an adapter, restored with one
        e.restore(plain.save(plain.add(Request(p, 4))), adapter=a1)
    assert not a1.users
    i = e.restore(blob, adapter=a1)
    with pytest.raises(AdapterInUse):
        a1.unmap()
    tail: list[int] = []
    while e.busy():
        tail += [t for pr in e.advance() if pr.id == i for t in pr.tokens]
    assert head + tail == want and not a1.users
    # two engines number their requests from 0: one ending must not release the other's hold
    x, y = model.engine(slots=1, context=64), model.engine(slots=1, context=64)
    ix, iy = x.add(Request(p, 4, s, adapter=a2)), y.add(Request(p, 4, s, adapter=a2))
    assert ix == iy == 0
    x.cancel(ix)
    with pytest.raises(AdapterInUse):
        a2.unmap()
    y.cancel(iy)
    a2.unmap()
    with pytest.raises(InvalidArgument, match="prefix"):
        e.add(Request(p[3:], 4, s, prefix=e.prefix(p[:3]), adapter=a1))


def test_a_salt_cannot_read_an_adapters_cached_pages(setup) -> None:
    """The prefix-cache key of an adapted request once joined the salt and the adapter with "|" (and the
    adapter's id(), which Python reuses): a request without the adapter whose salt spelled "|lora:NAME:ID" read
    the adapter's KV. Now the key is bytes with the adapter's content fingerprint; its own pages still hit,
    and a second mapping of the same adapter (same weights) shares them."""
    model, base, *_ = setup
    a1 = model.adapter(base / "a1")
    p, s = prompts(1, seed=9, lo=40, hi=40)[0], Sampling(ignore_eos=True)
    e = model.engine(slots=1, context=512)  # 32 pages: none of the requests' evicts another's
    first = e.generate([Request(p, 2, s, adapter=a1)])[0]
    assert first.cached == 0
    for forged in (f"|lora:{a1.name}:{id(a1)}", f"lora:{a1.fingerprint}", "\0", ""):
        assert e.generate([Request(p, 2, s, salt=forged)])[0].cached == 0, forged
    assert e.generate([Request(p, 2, s, adapter=a1, salt="x")])[0].cached == 0  # a salt still separates
    again = model.adapter(base / "a1")
    assert e.generate([Request(p, 2, s, adapter=again)])[0].cached == 32  # two full pages of 16
    assert e.generate([Request(p, 2, s, adapter=model.adapter(base / "a2"))])[0].cached == 0


@pytest.mark.float_kv
def test_an_adapter_of_fused_modules_matches_peft(tmp_path) -> None:
    """Phi-3 stores q/k/v and gate/up fused, so PEFT adapts `qkv_proj` and `gate_up_proj` as one module each:
    the adapter's A and B are then the fused linears' own (not blocks of parts), and the answer is PEFT's."""
    hf = build_hf_model("phi3", tmp_path / "base")
    pm = make_adapter(hf, tmp_path / "fused", 3, rslora=False,
                      targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    model = superslm.load(tmp_path / "base")
    adapter = model.adapter(tmp_path / "fused")
    assert {fused for _, fused in adapter.weights} == {"qkv", "o", "gate_up", "down"}
    prompt = prompts(1, seed=61, lo=8, hi=20)[0]
    s = Sampling(logprobs=1, ignore_eos=True)
    done = model.engine(slots=2, context=64).generate([Request(prompt, 6, s, adapter=adapter)])[0]
    check(done, prompt, lambda ids: pm(torch.tensor([ids])).logits[0])
    # the merged view of one part of a fused module is its rows of scale * B A
    a, b = adapter.weights[(0, "qkv")]
    q = model.arch.heads * model.arch.head_dim
    torch.testing.assert_close(adapter.delta(0, "k"), (b.float() @ a.float())[q : q + model.arch.kv_heads
                                                                                * model.arch.head_dim])
