"""The packaged GGUF models against transformers reading the same files: greedy tokens at fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import superslm
from superslm import Request, Sampling
from tests.tiny_models import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "Water boils at",
    "List three colors:\n1.",
]


def transformers_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    return [hf_greedy(hf, p, n) for p in prompts]


@pytest.mark.parametrize("name", ["smollm2_gguf", "gemma3_gguf"])
def test_greedy_tokens_equal_transformers(name: str, request) -> None:
    path: Path = request.getfixturevalue(name)
    model = superslm.load(path, device="cpu", dtype="float32")
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    engine = model.engine(slots=5, context=256)
    ours = [c.tokens for c in engine.generate([Request(p, 32, Sampling(ignore_eos=True)) for p in prompts])]
    theirs = transformers_greedy(path, prompts, 32)
    assert ours == theirs


def test_default_model_answers(smollm2_gguf: Path) -> None:
    model = superslm.load(smollm2_gguf)
    engine = model.engine(slots=1, context=512)
    text = engine.complete(model.chat_tokens([{"role": "user", "content": "What is 2+2?"}]), 24)
    assert "4" in text
