"""`hf:OWNER/REPO[/PATH][@REVISION]`: fetched through huggingface_hub and converted once.

No network here: each test builds a hub cache in huggingface_hub's own layout (blobs, snapshots
of symlinks, refs/main) and runs with HF_HUB_OFFLINE=1, so the real `snapshot_download` resolves
the revision and returns the snapshot, exactly as it does after a real download. (Monkeypatching
snapshot_download instead would not test how we call it: patterns, revision, cache folder.)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

import superslm
import superslm.convert
from superslm.convert import convert
from superslm.errors import FetchError, InvalidArgument
from superslm.formats import native
from superslm.hf_fetch import HubModel, fetch_converted, parse
from tests.test_engine import prompts
from tests.tiny_models import SingleSequence, build_hf_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKENS = prompts(1, seed=80, lo=16, hi=16)[0]


# tiny shapes: on a busy machine every 2-thread parallel region waits for a descheduled thread
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    build_hf_model("llama", folder)
    return folder


def populate_hub(hub: Path, repo: str, files: dict[str, Path], commit: str = COMMIT, ref: str = "main") -> None:
    """A hub cache entry as huggingface_hub writes one: content-addressed blobs, a snapshot of
    relative symlinks to them, and refs/REF holding the commit."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    for rel, src in files.items():
        data = src.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch, tiny) -> Path:
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    files = {p.name: p for p in tiny.iterdir()}
    populate_hub(hub, "owner/tiny", {**files, **{f"sub/{k}": v for k, v in files.items()},
                                     "other.bin": tiny / "config.json"})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("SUPERSLM_CACHE", str(tmp_path / "superslm"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at its import
    return hub


def logits(model: superslm.Model) -> torch.Tensor:
    with torch.no_grad():
        return SingleSequence(model.net).step(TOKENS).float()


def test_parse() -> None:
    assert parse("hf:Org/Model") == HubModel("Org/Model", "", "main")
    assert parse("hf:Org/Model/sub/dir@v1.0") == HubModel("Org/Model", "sub/dir", "v1.0")
    assert parse("hf:o/r/file.Q4_0.gguf").patterns() == ["file.Q4_0.gguf"]
    assert "sub/config.json" in parse("hf:o/r/sub").patterns()
    assert parse("hf:o/r/a/b").key == "o--r--a--b"
    for bad in ("hf:nobody", "hf:o/../x", "hf:o/r@", "hf:/r", "hf:o/r@-x", "hf:o/r/.hidden"):
        with pytest.raises(InvalidArgument):
            parse(bad)


def test_fetch_converts_once_then_loads_offline(offline_hub, tiny, tmp_path, monkeypatch) -> None:
    model = superslm.load("hf:owner/tiny", quant="int8", dtype="float32")
    path = Path(model.source.path)
    root = tmp_path / "superslm" / "hf" / "owner--tiny"
    assert path.parent == root / COMMIT and (root / "refs" / "main").read_text() == COMMIT
    assert not list(root.rglob(".*partial*"))
    # what `superslm convert` makes of the same folder, bit for bit
    direct = superslm.load(convert(tiny, tmp_path / "direct", format="int8"), dtype="float32")
    assert torch.equal(logits(model), logits(direct))
    assert native.read_folder(path).header["source"] == dict(native.read_folder(tmp_path / "direct").header["source"],
                                                               name=COMMIT)
    assert model.name == "hf:owner/tiny"

    def no_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(superslm.convert, "convert", no_convert)
    assert fetch_converted("hf:owner/tiny", quant="int8") == path
    assert fetch_converted(f"hf:owner/tiny@{COMMIT}", quant="int8") == path
    shutil.rmtree(offline_hub)  # the hub cache is gone: the recorded conversion still loads, offline
    assert torch.equal(logits(superslm.load("hf:owner/tiny", quant="int8", dtype="float32")), logits(direct))
    with pytest.raises(FetchError):
        fetch_converted("hf:owner/tiny", quant="bf16")  # never converted to bf16, and no hub cache now


def test_subfolder_formats_and_missing(offline_hub, tiny) -> None:
    sub = fetch_converted("hf:owner/tiny/sub@main", quant="bf16", progress=False)
    assert sub.parent.parent.name == "owner--tiny--sub"
    assert native.read_folder(sub).header["format"] == "bf16"
    assert fetch_converted("hf:owner/tiny", quant=None, progress=False).name.startswith("v1-dense")
    with pytest.raises(FetchError):
        fetch_converted("hf:owner/absent")
    with pytest.raises(FetchError):
        fetch_converted("hf:owner/tiny/nothing-here")
