"""Issue 9's agreement check: greedy tokens of the Triton path in bf16 (with decode graphs) against the CPU's
float32 torch path, step by step, on >= 99% of 256 steps; every step where they differ is a near tie of the
float32 logits (what bf16's rounding can flip). Each step is scored with the float32 model fed the bf16 run's
own tokens (teacher forcing), so one flipped tie does not count the rest of the sequence as disagreement.

Under TRITON_INTERPRET=1 on the CPU: four tiny families, 64 steps each. On a GPU also SmolLM2-135M's real
weights, 256 steps from each of three prompts. (float32 runs equal the CPU path token for token:
test_graphs.py, test_kernels_fused.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.triton_interpret import DEV, ON_GPU, import_kernels

tk = import_kernels()
# the Triton interpreter over a whole engine: slow
pytestmark = [pytest.mark.usefixtures("triton_interpret"), pytest.mark.slow]

import superslm  # noqa: E402
from superslm import Request, Sampling  # noqa: E402
from superslm.kernels import dispatch  # noqa: E402
from tests.tiny_models import SingleSequence, build_hf_model  # noqa: E402

#: a float32 logit margin below which bf16's rounding may pick either token
NEAR_TIE = 0.05


def scored(path: Path, runs: list[tuple[list[int], list[int]]], monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """(steps agreeing, steps) of (prompt, bf16 tokens) runs under the float32 CPU model; asserts near ties."""
    monkeypatch.setenv(dispatch.ENV, "torch")
    ref = superslm.load(path, device="cpu", dtype="fp32", quant=None)
    agree = total = 0
    for prompt, tokens in runs:
        seq = prompt + tokens
        logits = SingleSequence(ref.net, pages=-(-len(seq) // 4) + 1).step(seq[:-1])[len(prompt) - 1 :]
        best, got = logits.argmax(-1), torch.tensor(tokens)
        off = (best != got).nonzero().flatten()
        margins = logits[off, best[off]] - logits[off, got[off]]
        assert (margins < NEAR_TIE).all(), f"steps {off.tolist()} differ by {margins.tolist()}"
        agree, total = agree + len(tokens) - len(off), total + len(tokens)
    return agree, total


def bf16_greedy(path: Path, prompts: list[list[int]], steps: int, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Greedy tokens of the bf16 model on the Triton path with decode graphs (eager static steps on a CPU)."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    model = superslm.load(path, device=DEV, dtype="bf16", quant=None)
    engine = model.engine(slots=len(prompts), context=max(map(len, prompts)) + steps + 8, page_size=16, graphs=True)
    done = engine.generate([Request(p, steps, Sampling(ignore_eos=True)) for p in prompts])
    assert engine.graphs is not None and engine.graphs._made
    return [d.tokens for d in done]


def test_tiny_families_in_bf16_agree_with_the_cpu_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    agree = total = 0
    steps = 64 if ON_GPU else 24  # the interpreter runs every program in Python: 24 steps a family there
    for family in ("llama", "qwen2", "qwen3", "gemma3"):
        build_hf_model(family, tmp_path / family)
        prompt = [5, 17, 99, 3, 250, 41, 7]
        (tokens,) = bf16_greedy(tmp_path / family, [prompt], steps, monkeypatch)
        a, t = scored(tmp_path / family, [(prompt, tokens)], monkeypatch)
        agree, total = agree + a, total + t
    assert total == 4 * steps and agree >= total - max(1, total // 100)


@pytest.mark.skipif(not ON_GPU, reason="SmolLM2's 30 layers for 768 steps: too slow under the interpreter")
def test_smollm2_in_bf16_agrees_with_the_cpu_path(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = superslm.load(smollm2_gguf, device="cpu").tokenizer
    prompts = [tok.encode(t) for t in ("The history of the printing press", "def fibonacci(n):\n",
                                       "Once upon a time, in a small village")]  # fmt: skip
    runs = list(zip(prompts, bf16_greedy(smollm2_gguf, prompts, 256, monkeypatch), strict=True))
    agree, total = scored(smollm2_gguf, runs, monkeypatch)
    assert total == 768 and agree >= 0.99 * total
