"""`superslm bench`: runs each engine in its own process and prints the figures and ratios."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's float32 GGUF (~8 MB) of a small random llama with a byte-level BPE tokenizer: the bench's
    paths (a GGUF through both engines, transformers' GGUF reader for the tokenizer and the weights) without a
    real model's load time, which in transformers' peer is ~25 s for SmolLM2 (the file parsed three times)."""
    from tests.llama_cpp_convert import convert
    from tests.tiny_models import CONFIGS, build_hf_model

    cls, kwargs = CONFIGS["llama"]
    tmp = tmp_path_factory.mktemp("bench_llama")
    build_hf_model("llama", tmp / "hf", spec=(cls, dict(kwargs, hidden_size=256, intermediate_size=512,
                                                        head_dim=64, num_attention_heads=4, num_key_value_heads=2)))
    return convert(tmp / "hf", tmp / "model.gguf")


@pytest.mark.slow  # fetches llama-cpp-python's source distribution (the converter) from PyPI once
def test_bench_with_transformers_peer(llama_gguf: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "superslm.cli", "bench", "--model", str(llama_gguf), "--threads", "1",
         "--prefill", "32", "--decode", "6", "--streams", "3", "--peer", "transformers"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rows = {m.group(1): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"^(superslm|transformers)\s+([\d.\snan]+)$", r.stdout, re.M)}
    assert set(rows) == {"superslm", "transformers"}, r.stdout
    assert len(rows["superslm"]) == 5 and all(v > 0 for v in rows["superslm"])
    assert re.search(r"vs transformers: prefill [\d.]+x, decode [\d.]+x", r.stdout)
    size = llama_gguf.stat().st_size / 2**20
    assert size > 4  # a figure the rounding cannot hide
    assert re.search(rf"superslm peak RSS \d+ MB = file {size:.0f} MB \+ KV \d+ MB", r.stdout), r.stdout


@pytest.mark.slow
def test_bench_refuses_bad_numbers(smollm2_gguf: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "superslm.cli", "bench", "--model", str(smollm2_gguf), "--decode", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--decode must be at least 2" in r.stderr


def test_summary_takes_the_median_of_rounds_that_ran() -> None:
    from superslm.bench import summary

    def rnd(ours_decode: float, peer_decode: float) -> dict:
        return {"superslm": {"prefill": 200.0, "decode": ours_decode, "streams": 4 * peer_decode},
                "llama.cpp": {"prefill": 100.0, "decode": peer_decode}}

    rounds = [rnd(120, 100), rnd(150, 100), rnd(130, 100), {"superslm": {"error": "x"}, "llama.cpp": {}}]
    line = summary(rounds)
    assert line == ("median of 3 rounds vs llama.cpp: prefill 2.00x (2.00-2.00), decode 1.30x (1.20-1.50), "
                    "16 streams vs its single stream 4.00x (4.00-4.00)")


def test_table_counts_a_converted_folder_as_the_file(tmp_path: Path) -> None:
    from superslm.bench import table

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    (tmp_path / "config.json").write_bytes(b"\0" * 2**20)
    ours = {"prefill": 1.0, "decode": 1.0, "streams": 1.0, "load_s": 0.1, "rss_mb": 300.0, "kv_mb": 100.0}
    assert "= file 4 MB + KV 100 MB + 196 MB" in table(str(tmp_path), 2, {"superslm": ours})


def _dies(*args: object) -> dict:
    os._exit(3)  # as a peer's native code crashing would: no result, no exception


def _sleeps(*args: object) -> dict:
    time.sleep(120)
    return {}


def _answers(*args: object) -> dict:
    return {"prefill": 1.0, "args": list(args)}


def test_a_child_that_dies_or_hangs_is_an_error_row_not_a_wait() -> None:
    from superslm.bench import run_engine

    t = time.perf_counter()
    assert run_engine("llama.cpp", "m", 1, bench=_dies) == {
        "error": "the llama.cpp process ended without a result (exit code 3)"}
    assert run_engine("x", 1, timeout_s=3, bench=_sleeps) == {"error": "the x process gave no result within 3 s"}
    assert run_engine("y", "m", 2, bench=_answers) == {"prefill": 1.0, "args": ["m", 2]}
    assert time.perf_counter() - t < 60
