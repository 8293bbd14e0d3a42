"""The Triton test modules' shared set-up: on a CPU they run the kernels under TRITON_INTERPRET=1.

triton reads TRITON_INTERPRET when it decorates a kernel and when it runs one, so the variable is set
while `import_kernels` imports the kernels and, through the `triton_interpret` fixture (conftest.py),
while a module's tests run; the rest of the session's environment stays untouched.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")


def import_kernels() -> ModuleType:
    """superslm.kernels.triton (and its aot module) imported for the interpreter on a CPU; skips the
    calling test module when triton itself cannot be imported."""
    set_here = not ON_GPU and "TRITON_INTERPRET" not in os.environ
    if set_here:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - CI installs triton
        if set_here:
            del os.environ["TRITON_INTERPRET"]
        pytest.skip(f"triton cannot be imported ({e}); install the 'test' or 'gpu' extra", allow_module_level=True)
    try:
        # our own modules: an ImportError here is a bug, never a skip
        importlib.import_module("superslm.kernels.triton.aot")
        return importlib.import_module("superslm.kernels.triton")
    finally:
        if set_here:
            del os.environ["TRITON_INTERPRET"]


def interpret() -> Iterator[None]:
    """TRITON_INTERPRET=1 for the duration of a test module on a CPU (the body of the conftest fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            mp.setenv("TRITON_INTERPRET", "1")
        yield
