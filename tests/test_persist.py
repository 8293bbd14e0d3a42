"""Sequence save/restore: a restored sequence continues exactly as if never saved."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

import superslm
from superslm import Request, Sampling
from superslm.engine import persist
from superslm.errors import SequenceBusy, StateCorrupted, StateModelMismatch, StateVersionUnsupported, UnknownRequest
from tests.test_engine import engine_page_bytes, prompts
from tests.tiny_models import build_hf_model

SAMPLING = Sampling(temperature=0.8, top_k=40, seed=7, repetition_penalty=1.2, frequency_penalty=0.3,
                    logprobs=2, stop=("zzz",), ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> superslm.Model:
    folder = tmp_path_factory.mktemp("persist")
    build_hf_model("qwen3", folder)
    return superslm.load(folder)


def collect(engine, rid: int, steps: int | None = None) -> tuple[list[int], str, list]:
    tokens, text, lps = [], "", []
    n = 0
    while engine.busy() and (steps is None or n < steps):
        for p in engine.advance():
            if p.id == rid:
                tokens += p.tokens
                text += p.text
                lps += [(x.token, x.logprob) for x in p.logprobs]
        n += 1
    return tokens, text, lps


@pytest.mark.parametrize("kv", ["auto", "int8", "k8v4", "k4v4"])
def test_restored_sequence_continues_exactly(model, kv: str) -> None:
    """Float pages, int8 and 4-bit rows alike (keys and values each as stored): the answer goes on exactly."""
    p = prompts(1, seed=31, lo=30, hi=30)[0]
    ref_engine = model.engine(slots=2, context=128, deterministic=True, kv=kv)
    want = collect(ref_engine, ref_engine.add(Request(p, 20, SAMPLING)))

    engine = model.engine(slots=2, context=128, deterministic=True, kv=kv)
    rid = engine.add(Request(p, 20, SAMPLING))
    head = collect(engine, rid, steps=6)
    blob = engine.save(rid)
    engine.cancel(rid)
    assert engine.pool.num_used == 0
    # into a fresh engine, and into one whose pool is too full to take it at once
    for fresh in (model.engine(slots=2, context=128, deterministic=True, kv=kv),
                  model.engine(slots=1, context=128, deterministic=True, page_size=4, kv=kv,
                               kv_budget=14 * engine_page_bytes(model, 4, kv if kv != "auto" else None))):
        other = None
        if fresh.slots == 1:
            other = fresh.add(Request(prompts(1, seed=32, lo=20, hi=20)[0], 8, Sampling(ignore_eos=True)))
            fresh.advance()
        new = fresh.restore(blob)
        assert fresh.stats(new)["output_tokens"] == len(head[0])
        tail = collect(fresh, new)
        assert (head[0] + tail[0], head[1] + tail[1], head[2] + tail[2]) == want
        assert other is None or fresh.pool.num_used == 0


def test_blobs_keep_their_page_format(model) -> None:
    """An int8 engine's blob holds its int8 rows (codes and scales, not values) and says so; a blob restores only
    into an engine of its page format, anything else refused before a page is taken."""
    blobs, engines = {}, {}
    for kv in ("fp32", "int8"):
        engine = engines[kv] = model.engine(slots=2, context=128, kv=kv)
        rid = engine.add(Request(prompts(1, seed=35)[0], 10, SAMPLING))
        engine.advance()
        blobs[kv] = engine.save(rid)
        saved = persist.decode(blobs[kv], model.fingerprint)
        assert saved.header["kv_format"] == ("int8" if kv == "int8" else "float")
        assert saved.k.dtype == engine.kv.k.dtype and saved.k.shape[-1] == engine.kv.k.shape[-1]
        engine.cancel(rid)
        engine.advance()
    for blob, kv in ((blobs["fp32"], "int8"), (blobs["int8"], "fp32")):
        engine = engines[kv]
        with pytest.raises(StateModelMismatch, match="KV pages"):
            engine.restore(blob)
        assert not engine.busy() and engine.pool.num_used == 0
    # a float blob restores into float pages named otherwise
    assert model.engine(slots=1, context=128, kv=persist.dtype_name(model.dtype)).restore(blobs["fp32"]) >= 0


def test_bad_blobs_are_refused_with_their_own_error(model, tmp_path) -> None:
    engine = model.engine(slots=1, context=128)
    rid = engine.add(Request(prompts(1, seed=33)[0], 10, SAMPLING))
    engine.advance()
    blob = engine.save(rid)
    with pytest.raises(StateCorrupted):
        engine.restore(blob[:-5])
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    with pytest.raises(StateCorrupted):
        engine.restore(bytes(flipped))
    with pytest.raises(StateCorrupted):
        engine.restore(b"hello world" * 10)
    future = bytearray(blob[:-32])
    struct.pack_into("<I", future, 8, persist.VERSION + 1)
    future += hashlib.sha256(future).digest()
    with pytest.raises(StateVersionUnsupported):
        engine.restore(bytes(future))
    other_folder = tmp_path / "other"
    other_folder.mkdir()
    build_hf_model("qwen3", other_folder, seed=1)
    other = superslm.load(other_folder).engine(slots=1, context=128)
    with pytest.raises(StateModelMismatch):
        other.restore(blob)
    with pytest.raises(UnknownRequest):
        engine.save(12345)
    # nothing was taken by the refusals
    assert engine.restore(blob) != rid


def test_consistent_checksum_inconsistent_header_is_refused(model) -> None:
    """The checksum is no signature: a blob re-encoded with a bad prompt or KV of the wrong shape is refused
    before anything is taken (found in review: a wrong KV shape raised after pages were allocated and wedged the
    engine; a text or out-of-vocabulary prompt was accepted)."""
    engine = model.engine(slots=2, context=128)
    rid = engine.add(Request(prompts(1, seed=34)[0], 10, SAMPLING))
    engine.advance()
    saved = persist.decode(engine.save(rid), model.fingerprint)
    engine.cancel(rid)
    engine.advance()
    used = engine.pool.num_used

    def edited(prompt=None, k=None) -> bytes:
        header = json.loads(json.dumps(saved.header))
        if prompt is not None:
            header["sequence"]["prompt"] = prompt
        kk = saved.k if k is None else k
        return persist.encode(header, kk, kk if k is not None else saved.v)

    for blob in (edited(prompt="abc"), edited(prompt=[]), edited(prompt=[10**6]), edited(prompt=[1.5]),
                 edited(k=saved.k[:, :, :1]), edited(k=saved.k[:1])):  # fmt: skip
        with pytest.raises(StateCorrupted):
            engine.restore(blob)
    assert not engine.busy() and engine.pool.num_used == used
    assert engine.restore(edited()) >= 0  # the unedited state still restores


def test_save_mid_step_is_refused(model) -> None:
    engine = model.engine(slots=1, context=128)
    rid = engine.add(Request(prompts(1, seed=34)[0], 4, Sampling()))
    engine.advance(layer_budget=1)
    with pytest.raises(SequenceBusy):
        engine.save(rid)
    while engine.busy():
        engine.advance(layer_budget=1)


def test_every_released_version_stays_readable() -> None:
    """tests/data keeps a blob of each released format version, saved mid-generation from the
    tiny model stored beside it, with the uninterrupted run's tokens."""
    import json
    from pathlib import Path

    data = Path(__file__).parent / "data"
    model = superslm.load(data / "tiny-qwen3")
    for version in range(1, persist.VERSION + 1):
        blob = (data / f"sequence-v{version}.bin").read_bytes()
        want = json.loads((data / f"sequence-v{version}.json").read_text())
        engine = model.engine(slots=1, context=128, deterministic=True, kv=persist.dtype_name(model.dtype))
        rid = engine.restore(blob)
        done = len(engine.output.seqs[rid].output)
        tokens, text, _ = collect(engine, rid)
        assert want["tokens"][:done] + tokens == want["tokens"]


def _forge(blob: bytes, fingerprint: str, path: tuple, value) -> bytes:
    """The blob with one header field replaced and the checksum recomputed (a checksum is no signature)."""
    saved = persist.decode(blob, fingerprint)
    header = json.loads(json.dumps(saved.header))
    node = header
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return persist.encode(header, saved.k, saved.v)


_DROP = object()
NONSENSE = [None, -1, 0, 1e29, 2**70, "x", [], {}, [[1]], [-5], True, _DROP]


def _paths(state: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in state.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _paths(value, prefix + (key,))
    return out


def test_forged_fields_are_refused_as_corrupted_or_run(model) -> None:
    """Every field of a saved sequence, set to nonsense with a valid checksum: restore() refuses it with
    StateCorrupted (before: AttributeError, IndexError, or accepted: cached=-1, max_tokens=1e29, page_size=0),
    or what it accepts runs to its end; nothing leaks and the engine goes on serving."""
    engine = model.engine(slots=1, context=128)
    rid = engine.add(Request(prompts(1, seed=34)[0], 12, SAMPLING))
    engine.advance()
    engine.advance()
    blob = engine.save(rid)
    engine.cancel(rid)
    fp = model.fingerprint
    header = persist.decode(blob, fp).header
    paths = [("page_size",)] + [("sequence",) + p for p in _paths(header["sequence"])]
    accepted = []
    for path in paths:
        for value in NONSENSE:
            forged = _forge(blob, fp, path, value)
            try:
                i = engine.restore(forged)
            except StateCorrupted:
                continue
            accepted.append((path, value))
            while engine.busy():
                engine.advance()
            assert i not in engine.output.seqs
    ints = {("page_size",), ("sequence", "cached"), ("sequence", "max_tokens"), ("sequence", "request_max_tokens"),
            ("sequence", "preemptions"), ("sequence", "layers_run")}
    for path, value in accepted:
        assert path not in ints or type(value) is int and value >= 0 and value < 2**62, (path, value)
    engine.pool.check()
    assert engine.pool.num_used == 0
    assert engine.restore(blob) >= 0
