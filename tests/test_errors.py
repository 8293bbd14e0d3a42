"""Every refusal is an exception class of its own: each class is provoked through the public API."""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

import superslm
from superslm import Request, Sampling, errors
from superslm.grammar import Constraint
from tests.tiny_models import build_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("errors")
    build_hf_model("qwen3", folder)
    return superslm.load(folder), folder


def _gguf_error(tiny, tmp: Path) -> None:
    bad = tmp / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 99) + b"\0" * 32)
    superslm.load(bad)


def _format_error(tiny, tmp: Path) -> None:
    (tmp / "config.json").write_text("{not json")
    superslm.load(tmp)


def _unsupported(tiny, tmp: Path) -> None:
    (tmp / "config.json").write_text('{"model_type": "mamba"}')
    superslm.load(tmp)


def _tokenizer_error(tiny, tmp: Path) -> None:
    from superslm.tokenizer import Tokenizer

    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
                         "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []})


def _template_error(tiny, tmp: Path) -> None:
    from superslm.tokenizer import ChatTemplate

    ChatTemplate("{{ raise_exception('no system messages') }}").render([{"role": "user", "content": "x"}])


def _kv_full(tiny, tmp: Path) -> None:
    model, _ = tiny
    engine = model.engine(slots=1, context=64, page_size=4, kv_budget=2 * 2 * 3 * 4 * 2 * 32 * 4)
    engine.step(list(range(3, 20)), [0] * 17, [False] * 17)


def _busy(tiny, tmp: Path) -> None:
    model, _ = tiny
    engine = model.engine(slots=1, context=64)
    rid = engine.add(Request([3, 4, 5], 3))
    engine.advance(layer_budget=1)
    engine.save(rid)


def _state(kind: str) -> Callable[..., None]:
    def provoke(tiny, tmp: Path) -> None:
        model, folder = tiny
        engine = model.engine(slots=1, context=64)
        rid = engine.add(Request([3, 4, 5], 3))
        engine.advance()
        blob = engine.save(rid)
        if kind == "corrupted":
            engine.restore(blob[:-1])
        elif kind == "version":
            import hashlib

            body = bytearray(blob[:-32])
            struct.pack_into("<I", body, 8, 999)
            engine.restore(bytes(body) + hashlib.sha256(body).digest())
        else:
            build_hf_model("qwen3", tmp, seed=9)
            superslm.load(tmp).engine(slots=1, context=64).restore(blob)

    return provoke


def _prefix_in_use(tiny, tmp: Path) -> None:
    model, _ = tiny
    engine = model.engine(slots=1, context=64)
    pre = engine.prefix([3, 4, 5, 6])
    engine.add(Request([7], 3, prefix=pre))
    engine.release(pre)


def _adapter(kind: str) -> Callable[..., None]:
    def provoke(tiny, tmp: Path) -> None:
        from tests.test_lora import make_adapter

        model, folder = tiny
        if kind == "mismatch":
            other = build_hf_model("llama", tmp)
            make_adapter(other, tmp / "ad", 0, rslora=False)
            model.adapter(tmp / "ad")
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        make_adapter(hf, tmp / "ad", 0, rslora=False)
        adapter = model.adapter(tmp / "ad")
        model.engine(slots=1, context=64).add(Request([3], 2, adapter=adapter))
        adapter.unmap()

    return provoke


def _integrity(tiny, tmp: Path) -> None:
    from superslm.convert import convert

    model, folder = tiny
    out = convert(folder, tmp / "converted", format="bf16")
    with open(out / "config.json", "a") as f:
        f.write(" ")
    superslm.load(out)


def _unknown_schema(tiny, tmp: Path) -> None:
    model, _ = tiny
    model.engine(slots=1, context=64).add(Request([3], 2, Sampling(schema="nope")))


PROVOKE: dict[type[errors.SuperSLMError], Callable[..., None]] = {
    errors.InvalidArgument: lambda t, tmp: t[0].engine(slots=1, context=64).add(Request([3], 0)),
    errors.TokenOutOfRange: lambda t, tmp: t[0].engine(slots=1, context=64).add(Request([10**6], 2)),
    errors.ContextLengthExceeded: lambda t, tmp: t[0].engine(slots=1, context=8).add(Request(list(range(3, 20)), 2)),
    errors.ModelNotFound: lambda t, tmp: superslm.load(tmp / "nowhere"),
    errors.FormatError: _format_error,
    errors.ModelIntegrityError: _integrity,
    errors.GGUFError: _gguf_error,
    errors.UnsupportedModel: _unsupported,
    errors.TokenizerError: _tokenizer_error,
    errors.TemplateError: _template_error,
    errors.FetchError: lambda t, tmp: superslm.hub.fetch("no-such-known-model"),
    errors.KVCacheFull: _kv_full,
    errors.UnknownRequest: lambda t, tmp: t[0].engine(slots=1, context=64).cancel(7),
    errors.GrammarError: lambda t, tmp: t[0].engine(slots=1, context=64).add(
        Request([3], 2, Sampling(grammar=Constraint.regex("(unclosed")))),
    errors.StateCorrupted: _state("corrupted"),
    errors.StateVersionUnsupported: _state("version"),
    errors.StateModelMismatch: _state("model"),
    errors.SequenceBusy: _busy,
    errors.PrefixInUse: _prefix_in_use,
    errors.UnknownSchema: _unknown_schema,
    errors.AdapterMismatch: _adapter("mismatch"),
    errors.AdapterInUse: _adapter("in use"),
}
#: provoked through the HTTP server by tests/test_server_errors.py (queue full; engine loop dead)
SERVER_ONLY = {errors.QueueFull: "queue_full", errors.InternalError: "internal_error"}
#: abstract bases, never raised themselves
BASES = {errors.SuperSLMError, errors.StateError}


def test_every_error_class_is_provoked() -> None:
    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.SuperSLMError)}
    assert classes == set(PROVOKE) | set(SERVER_ONLY) | BASES
    server_tests = (Path(__file__).parent / "test_server_errors.py").read_text()
    for code in SERVER_ONLY.values():
        assert f'"{code}"' in server_tests


@pytest.mark.parametrize("cls", list(PROVOKE), ids=lambda c: c.__name__)
def test_provoke(cls, tiny, tmp_path) -> None:
    with pytest.raises(cls) as info:
        PROVOKE[cls](tiny, tmp_path)
    assert type(info.value) is cls, f"raised {type(info.value).__name__}, a relative of {cls.__name__}"
    assert info.value.code and 400 <= info.value.http_status < 600
