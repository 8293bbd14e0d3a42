"""benchmarks/gpu.py end to end on the CPU (--device cpu --tiny): the script runs, prints a table with
finite numbers for both engines, and superslm's greedy tokens are transformers' own."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("superslm_gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_tiny_run_prints_both_engines(gpu_bench, capsys):
    results = gpu_bench.main(["--device", "cpu", "--tiny"])
    out = capsys.readouterr().out
    models, workloads = list(gpu_bench.CONFIGS), list(gpu_bench.WORKLOADS)
    # every model x workload has a row with both engines, plus the int4 batch-1 row (int4 runs on the CPU)
    for m in models:
        rows = [r for r in results if r["model"] == m]
        assert [r["workload"] for r in rows if r["precision"] == "bf16"] == workloads
        assert [r["workload"] for r in rows if r["precision"] == "int4"] == ["decode1"]
        for r in rows:
            engines = ("superslm", "transformers") if r["precision"] == "bf16" else ("superslm",)
            for e in engines:
                run = r[e]
                assert run.tokens == sum(len(o) for o in run.outputs) > 0
                for v in (run.decode_tps, run.e2e_tps, run.wall_s):
                    assert math.isfinite(v) and v > 0, (m, r["workload"], e)
    # the printed tables: one per model, each engine row with finite numbers in every column
    assert out.count("\nmodel ") == len(models)
    table = [line for line in out.splitlines() if re.match(r"^(b\d+ \d+\+\d+|nano-vllm x\d+) (bf16|int4) ", line)]
    # label (3 words), engine, then seqs, out tokens, decode tok/s, e2e tok/s, wall s (ratio rows: two ratios)
    engines = [line.split()[3] for line in table]
    assert {"superslm", "transformers", "ratio"} <= set(engines)
    for line in table:
        cols = line.split()
        nums = [float(c.rstrip("x")) for c in (cols[4:6] if cols[3] == "ratio" else cols[4:9])]
        assert all(math.isfinite(n) and n > 0 for n in nums), line
    # markdown rows for docs/benchmarks.md, one per result
    md = [line for line in out.splitlines() if line.startswith("| qwen")]
    assert len(md) == len(results)
    assert "GPU targets: tiny configs" in out


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b"])
def test_greedy_tokens_match_transformers(gpu_bench, name):
    got = gpu_bench.greedy_tokens(name, ("decode1", "nano"), device="cpu", dtype="fp32")
    # the tiny batch-1 run at fp32: superslm's greedy tokens are transformers' own
    (ours,), (theirs,) = got["decode1"]
    assert len(theirs) == 16
    assert ours == theirs
    # the nano-vllm shape (prompts and outputs of different lengths): continuous batching in superslm and
    # transformers' left-padded batch compute the same sequences, so the throughputs compare like with like
    ours, theirs = got["nano"]
    assert len({len(t) for t in theirs}) > 1
    assert sum(len(set(t)) for t in theirs) > len(theirs)  # not every sequence one repeated token
    assert ours == theirs


def test_peer_rates_projected_from_its_first_steps(gpu_bench, capsys):
    """--peer-steps N: transformers generates N tokens a run; its rates are projected to the whole output
    (marked in the tables)."""
    args = ["--device", "cpu", "--tiny", "--models", "qwen3-0.6b", "--workloads", "decode1,nano", "--no-int4"]
    results = gpu_bench.main([*args, "--peer-steps", "4"])
    out = capsys.readouterr().out
    full = {r["workload"]: r["transformers"] for r in gpu_bench.main([*args, "--peer-steps", "0"])}
    for r in results:
        run = r["transformers"]
        assert run.projected_from == 4 and full[r["workload"]].projected_from == 0
        assert run.tokens == full[r["workload"]].tokens == sum(len(o) for o in full[r["workload"]].outputs)
        assert all(len(o) <= 4 for o in run.outputs)
        for v in (run.decode_tps, run.e2e_tps, run.wall_s):
            assert math.isfinite(v) and v > 0
    assert "projected from its first 4 steps" in out
    assert "transformers' rates projected from its first 4 steps" in out
    md = [line for line in out.splitlines() if line.startswith("| qwen3-0.6b")]
    assert md and all(line.split("|")[5].strip().endswith("*") for line in md)
    with pytest.raises(SystemExit):
        gpu_bench.main([*args, "--peer-steps", "1"])


def test_projection_of_a_steady_run_is_its_measurement(gpu_bench):
    """A fixed batch whose steps each take the same time: the rates projected from its first few steps are those
    `rates` measures on the whole run; a slower later step would make the projection flatter the peer."""
    t0, prefill, step, new, tail = 10.0, 0.75, 0.125, 33, 0.0625  # binary fractions: exact sums
    outputs = [33, 20, 7, 33]  # the batch runs to the longest; shorter sequences are credited their own tokens
    n, tokens = len(outputs), sum(outputs)
    times = [t0 + prefill + step * s for s in range(new)]
    t_end = times[-1] + tail
    events = [(t, sum(o > s for o in outputs)) for s, t in enumerate(times)]
    decode, e2e = gpu_bench.rates(events, times[0], t0, t_end, tokens)
    for k in (2, 5, new):
        assert gpu_bench.project(times[:k], t0, t_end - (new - k) * step, n, tokens, new) == (t_end - t0, decode, e2e)
    slow = [*times[:5], *(t + 0.5 for t in times[5:])]  # one long step later on
    assert gpu_bench.project(slow[:5], t0, slow[4] + tail, n, tokens, new)[1] > gpu_bench.rates(
        [(t, c) for t, (_, c) in zip(slow, events)], slow[0], t0, slow[-1] + tail, tokens)[0]


def test_int4_unavailable_is_reported(gpu_bench, capsys, monkeypatch):
    # where quant="int4" does not run on the device, the int4 row says n/a and why
    monkeypatch.setattr(gpu_bench, "load_int4", lambda folder, device: (None, "no int4 kernel here"))
    results = gpu_bench.main(["--device", "cpu", "--tiny", "--models", "qwen3-0.6b", "--workloads", "decode1"])
    out = capsys.readouterr().out
    (row,) = [r for r in results if r["precision"] == "int4"]
    assert "superslm" not in row and row["note"] == "no int4 kernel here"
    assert "superslm      n/a: no int4 kernel here" in out
    assert "| qwen3-0.6b | b1 16+16 | int4 | n/a (no int4 kernel here) |" in out


def test_int4_probe_reports_instead_of_raising(gpu_bench):
    import torch

    model, why = gpu_bench.load_int4("/nonexistent", torch.device("meta"))
    assert model is None and "does not run on meta" in why


@pytest.mark.slow
def test_host_step_benchmark_runs() -> None:
    """benchmarks/host_step.py (its own process: it replaces the graphs' forward) times a few graph steps."""
    import os
    import subprocess

    script = SCRIPT.parent / "host_step.py"
    env = {k: v for k, v in os.environ.items() if k != "SUPERSLM_KERNELS"}
    r = subprocess.run([sys.executable, str(script), "--seqs", "4", "--tokens", "6", "--prefix-caching"], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"4 sequences, (\d+) decode steps: ([\d.]+) ms of host time a step", r.stdout)
    assert m and int(m.group(1)) == 5 and float(m.group(2)) > 0, r.stdout
    assert "  accept:" in r.stdout and "_launch_ahead:" in r.stdout
