"""The Triton test modules' shared set-up: on a CPU they run the kernels under TRITON_INTERPRET=1.

triton reads TRITON_INTERPRET when it decorates a kernel and when it runs one, so the variable is set
while `import_kernels` imports the kernels and, through the `triton_interpret` fixture (conftest.py),
while a module's tests run; the rest of the session's environment stays untouched.

The interpreter computes `tl.dot` with numpy's matmul, that is with whatever BLAS numpy carries; some
BLAS kernel sets (OpenBLAS with OPENBLAS_CORETYPE=Haswell, for one) round an output row by its place in
the tile and the tile's row count. While the fixture runs, a floating-point `tl.dot` is instead a
fixed-order product (`fixed_order_dot`): every output element sums its products in float64, k = 0, 1,
..., one IEEE operation at a time, so its bits depend on its row and column alone, on any CPU. A
difference between a row alone and the same row in a larger step can then only come from the kernel's
own tiling and reduction order, which is what the invariance tests check.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
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


def fixed_order_product(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a @ b over the last two axes with each element's products (exact in float64 for float16/32 inputs)
    added in the order k = 0, 1, ... by elementwise numpy operations, never BLAS; rounded once to dtype."""
    x, y = a.astype(np.float64), b.astype(np.float64)
    acc = np.zeros(x.shape[:-1] + y.shape[-1:], np.float64)
    for k in range(x.shape[-1]):
        acc += x[..., :, k, None] * y[..., None, k, :]  # [..., M, 1] * [..., 1, N]
    return acc.astype(dtype)


def fixed_order_dot(original: Callable) -> Callable:
    """The interpreter builder's create_dot with floating-point operands computed by fixed_order_product;
    other operands (integers, fp8, bf16 held as uint16) go to the interpreter's own dot unchanged."""

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001 - triton's handles
        from triton.runtime.interpreter import TensorHandle

        floats = all(t.data.dtype.kind == "f" and t.dtype.primitive_bitwidth > 8 for t in (a, b))
        if not floats or d.data.dtype.kind != "f":
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(fixed_order_product(a.data, b.data, d.data.dtype) + d.data, d.dtype.scalar)

    create_dot.fixed_order = True
    return create_dot


def one_patch_a_launch(interpreter: ModuleType, mp: pytest.MonkeyPatch) -> None:
    """The interpreter's `_patch_lang` (triton.language's builtins swapped for interpreted ones) once a launch.

    The interpreter patches the language modules a kernel sees when it launches the kernel (and restores them after
    its grid), and again, identically and never restored, at every call of a jit helper inside every program: in an
    engine test ~22% of the time went to those repeats (inspect.getmembers over triton.language at each call). Inside
    a launch, a helper whose language modules the launch already patched skips the repeat; everything else is the
    interpreter's own code."""
    import inspect

    import triton.language as tl

    real_patch, real_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state: dict[str, set[int] | None] = {"patched": None}  # ids of the modules the running launch patched

    seen: dict[object, set[int]] = {}  # a jit function's language modules (its globals'), found once

    def patch_lang(fn):  # noqa: ANN001, ANN202 - triton's
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        patched = state["patched"]
        if patched is not None and langs and langs <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = real_patch(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        outer, state["patched"] = state["patched"], set()
        try:
            return real_call(self, *args, **kwargs)
        finally:
            state["patched"] = outer

    mp.setattr(interpreter, "_patch_lang", patch_lang)
    mp.setattr(interpreter.GridExecutor, "__call__", launch)


def no_discarded_overflow_checks(interpreter: ModuleType, mp: pytest.MonkeyPatch) -> None:
    """The interpreter's builder without `sanitize_overflow` where its `debug` is off (always, unless set by hand).

    With sanitize_overflow on, every integer add, sub and mul (offsets, masks, bit tricks) also computes the
    operation in int64 and its two bound comparisons for a `device_assert` that, with debug off, discards them
    before anything is checked: ~30% of an engine test's time under the interpreter went to that dead work. With
    debug on the checks assert, so they stay."""
    builder = interpreter.interpreter_builder
    if not builder.options.debug and builder.options.sanitize_overflow:
        mp.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))


def np_dtypes_looked_up_once(interpreter: ModuleType, mp: pytest.MonkeyPatch) -> None:
    """The interpreter's `_get_np_dtype` (a Triton type's numpy storage dtype) remembered by scalar type.

    The interpreter builds its whole table of dtypes at each call, for every operand of every operation of every
    program (~7% of an engine test's time). A block type's answer is its element type's, so the answer of each
    scalar type, asked of the interpreter's own function once, is the answer for every later call."""
    import triton.language as tl

    real = interpreter._get_np_dtype
    known: dict[object, np.dtype] = {}

    def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202 - triton's
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):  # unhashable: the interpreter's own answer
            return real(scalar)
        got = known.get(scalar)
        if got is None:
            got = known[scalar] = real(scalar)
        return got

    mp.setattr(interpreter, "_get_np_dtype", get_np_dtype)


def bf16_casts_by_shifts(interpreter: ModuleType, mp: pytest.MonkeyPatch) -> None:
    """The interpreter's `_convert_float` for bfloat16 -> float32 and float32 -> bfloat16 without a rounding mode
    (what `.to()` runs: an exact widening, a truncation) done as the bit shifts they are, where no input is
    subnormal; anything else (subnormal inputs, other types, rounding modes) goes to the interpreter's function.

    The interpreter takes every float apart into sign, exponent and significand in a dozen numpy passes (~5% of a
    bf16 engine test's time). For inputs that are not subnormal its result is exactly the shifted bits (checked
    over every bfloat16 and over float32 bit patterns, NaN and infinities included, by tests/test_triton_interpret.py);
    for subnormal inputs it is not, so those keep the interpreter's own arithmetic."""
    import triton.language as tl

    real = interpreter._convert_float

    def convert_float(input, input_dtype, output_dtype, rounding_mode):  # noqa: ANN001, ANN202, A002 - triton's
        if rounding_mode is None and input.dtype.itemsize in (2, 4):
            if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
                u = np.ascontiguousarray(input).view(np.uint16)
                if not (((u & 0x7F80) == 0) & ((u & 0x007F) != 0)).any():
                    return u.astype(np.uint32) << np.uint32(16)
            elif input_dtype == tl.float32 and output_dtype == tl.bfloat16:
                u = np.ascontiguousarray(input).view(np.uint32)
                if not (((u & 0x7F800000) == 0) & ((u & 0x007FFFFF) != 0)).any():
                    return (u >> np.uint32(16)).astype(np.uint16)
        return real(input, input_dtype, output_dtype, rounding_mode)

    mp.setattr(interpreter, "_convert_float", convert_float)


def interpret() -> Iterator[None]:
    """TRITON_INTERPRET=1, the fixed-order tl.dot, one language patch a launch, no discarded overflow checks and the
    numpy dtypes looked up once, for the duration of a test module on a CPU (the body of the conftest fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            from triton.runtime import interpreter
            from triton.runtime.interpreter import InterpreterBuilder

            mp.setenv("TRITON_INTERPRET", "1")
            mp.setattr(InterpreterBuilder, "create_dot", fixed_order_dot(InterpreterBuilder.create_dot))
            one_patch_a_launch(interpreter, mp)
            no_discarded_overflow_checks(interpreter, mp)
            np_dtypes_looked_up_once(interpreter, mp)
            bf16_casts_by_shifts(interpreter, mp)
        yield
