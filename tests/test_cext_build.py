"""What the first run says while it builds the C++ kernels: that it builds, how long it took, and, in a second
process that finds the first one's build lock, that it waits (before: a promise of "under a minute" for a
build of minutes, nothing when done, and silence while waiting). The compiler itself is replaced here."""

from __future__ import annotations

import pytest
import torch.utils.cpp_extension

from superslm import cext


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("SUPERSLM_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("SUPERSLM_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cext, "_ext", None)
    monkeypatch.setattr(cext, "_ext_tried", False)
    built = object()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: built)
    return tmp_path, built


def test_the_build_says_it_builds_and_when_it_is_ready(fresh, capsys) -> None:
    _, built = fresh
    assert cext.extension() is built
    err = capsys.readouterr().err
    assert "building the C++ kernels" in err and "1-3 minutes" in err and "C++ kernels ready (" in err


def test_a_second_process_says_it_waits(fresh, capsys) -> None:
    tmp, _ = fresh
    kernels = tmp / "kernels"
    # the build folder's name is the source's hash: make the lock where extension() will look
    real_build_dir = cext._build_dir

    def with_lock(name):
        folder = real_build_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "lock").write_text("")
        return folder

    import unittest.mock

    with unittest.mock.patch.object(cext, "_build_dir", with_lock):
        cext.extension()
    err = capsys.readouterr().err
    assert "another process is building the C++ kernels" in err and "ready (" in err
    assert kernels.exists()


def test_a_lock_left_by_a_killed_build_is_removed(fresh, capsys) -> None:
    """A build killed mid-way (SIGKILL: torch's FileBaton never releases) left its lock; torch would wait on it
    forever. A lock older than STALE_LOCK_S is removed and this process builds; a fresh one is waited on."""
    import os
    import time
    import unittest.mock

    real_build_dir = cext._build_dir
    ages = []

    def with_lock(name):
        folder = real_build_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"
        lock.write_text("")
        old = time.time() - ages[-1]
        os.utime(lock, (old, old))
        return folder

    ages.append(cext.STALE_LOCK_S + 60)
    with unittest.mock.patch.object(cext, "_build_dir", with_lock):
        cext.extension()
    err = capsys.readouterr().err
    assert "building the C++ kernels" in err and "another process" not in err
    folder = real_build_dir("x")
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    assert not cext.clear_stale_lock(folder) and (folder / "lock").exists()  # a build in progress: kept
    assert cext.clear_stale_lock(folder, now=time.time() + cext.STALE_LOCK_S + 1) and not (folder / "lock").exists()
    assert not cext.clear_stale_lock(folder)  # no lock: nothing to do
