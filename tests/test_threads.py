"""CPU threads under contention (devices.ThreadPolicy): a step uses the threads asked for, fewer while other
processes keep cores busy, and the answers do not depend on the count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import superslm
from superslm import Request, Sampling, devices
from superslm.devices import ThreadPolicy, others_running
from tests.test_engine import prompts
from tests.tiny_models import build_hf_model


@pytest.fixture()
def two_cores(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    monkeypatch.setattr(devices, "_WANTED", 2)
    yield
    torch.set_num_threads(before)


def test_the_policy_gives_busy_cores_back(two_cores) -> None:  # type: ignore[no-untyped-def]
    import itertools

    looks = itertools.chain([0, 1, 1, 0, 1, 1, 1, 0, 0, 0, None], itertools.repeat(1))
    now = [0.0]
    policy = ThreadPolicy(every_s=0.05, probe=lambda: next(looks), clock=lambda: now[0])

    def step() -> int:
        n = policy.choose()
        now[0] += 0.06
        assert torch.get_num_threads() == n
        return n

    # looks 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, None: the middle of the last three decides (of two, the busier), so
    # one quiet look in a busy spell changes nothing, and the threads come back once the core is free
    assert [step() for _ in range(11)] == [2, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]
    # between looks the choice stands: a busy look now, then none for 0.05 s
    assert policy.choose() == 2 and policy.choose() == 2
    devices._WANTED = 1  # set_threads(1): never more than asked
    now[0] += 1
    assert ThreadPolicy(probe=lambda: 0, clock=lambda: now[0]).choose() == 1


def test_others_running_sees_a_busy_process() -> None:
    import subprocess
    import sys
    import time

    quiet = others_running()
    if quiet is None:
        pytest.skip("no /proc here")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        seen = max(others_running() or 0 for _ in range(20))
    finally:
        burner.kill()
        burner.wait()
    assert seen >= 1


def _answers(model: superslm.Model, threads: int, busy: int, monkeypatch: pytest.MonkeyPatch,
             streams: int = 3) -> tuple[list, int | None]:  # fmt: skip
    monkeypatch.setattr(devices, "_WANTED", threads)
    monkeypatch.setattr(devices, "others_running", lambda: busy)
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    engine = model.engine(slots=max(streams, 4), context=256, prefix_caching=False)
    s = Sampling(logprobs=3, ignore_eos=True)
    reqs = [Request(p, 10 if streams <= 4 else 4, s) for p in prompts(streams, seed=9, lo=20, hi=80)]
    done = engine.generate(reqs)
    used = engine.runner.threads.threads if engine.runner.threads is not None else None
    return [(c.tokens, [(lp.logprob, lp.top) for lp in c.logprobs]) for c in done], used


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_answers_do_not_depend_on_the_threads(family: str, tmp_path: Path, two_cores,  # type: ignore[no-untyped-def]
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Prompt chunks (torch's kernels) and decode steps (the C++ plan) give the same bits on 1 and 2 threads, so
    the policy's switches change speed only."""
    build_hf_model(family, tmp_path)
    model = superslm.load(tmp_path)
    two, used_two = _answers(model, 2, 0, monkeypatch)
    one, used_one = _answers(model, 2, 1, monkeypatch)  # a busy core: the steps ran on one thread
    assert (used_two, used_one) == (2, 1)
    assert one == two


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2_gguf", "gemma3_gguf"])
def test_real_models_answer_the_same_on_one_and_two_threads(name: str, request, two_cores,  # type: ignore[no-untyped-def]
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model = superslm.load(request.getfixturevalue(name))
    two, _ = _answers(model, 2, 0, monkeypatch)
    one, _ = _answers(model, 2, 1, monkeypatch)
    assert one == two


@pytest.mark.slow
def test_sixteen_streams_answer_the_same_on_one_and_two_threads(smollm2_gguf: Path, two_cores,  # type: ignore[no-untyped-def]
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """16 decode rows: the plan splits the rows' norms, activations, q/k norms, rope and KV stores and the row
    kernels' activation splits across the threads (3 rows stay on one); each row's bits do not depend on it."""
    model = superslm.load(smollm2_gguf)
    two, _ = _answers(model, 2, 0, monkeypatch, streams=16)
    one, _ = _answers(model, 2, 1, monkeypatch, streams=16)
    assert one == two
