"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled once per machine and loaded.

Built at first use with the system's C++ compiler and the ninja wheel into torch's extension cache,
named by a hash of the sources, this CPU's flags, torch's version and the build flags. The bottom of
the house: the decode layers (kernels/cpu_decode.py) and the formats that need a kernel torch lacks
(quant/int5.py) both load it from here. `SUPERSLM_CPU_KERNELS=0` turns it off; where it cannot be built,
callers take their torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent / "kernels" / "cpu"
_SOURCES = [_DIR / n for n in ("decode_layers.cpp", "gemv.cpp", "gemm.cpp")]
_HEADERS = [_DIR / n for n in ("vnni.h", "rowops.h")]
_ext: Any = None
_ext_tried = False
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def extension() -> Any:
    """The compiled module, or None when it is disabled or cannot be built here (reason logged once)."""
    global _ext, _ext_tried
    if _ext_tried:
        return _ext
    _ext_tried = True
    if os.environ.get("SUPERSLM_CPU_KERNELS", "1") == "0":
        return None
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    # -march=native code must never be reused on another CPU: the name carries the CPU's and build's flags
    build = " ".join([_cpu_flags(), torch.__version__, *_CFLAGS, *_LDFLAGS]).encode()
    tag = hashlib.sha256(src + build).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load

        try:  # the `ninja` wheel's binary, for interpreters run without their venv activated
            import ninja

            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

        name = f"superslm_decode_{tag}"
        try:  # the first use on a machine compiles (~30-60 s): say so rather than look hung
            from torch.utils.cpp_extension import _get_build_directory

            built = (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
        except Exception:  # a private torch helper: its absence only costs the notice
            built = True
        if not built:
            print("superslm: building the C++ decode kernels for this machine (once, under a minute)...",
                  file=sys.stderr, flush=True)
        _ext = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, headers missing: the reference still runs
        log.warning("superslm: C++ decode layers unavailable (%s); using the torch path", str(e).splitlines()[0])
        _ext = None
    return _ext


def vnni() -> Any:
    """The extension when it runs the VNNI kernels on this CPU (AVX-512 VNNI, not switched off), else None."""
    ext = extension()
    return ext if ext is not None and ext.vnni_available() else None


def torch_kernels_forced() -> bool:
    """Whether `SUPERSLM_KERNELS=torch` asks for torch's kernels everywhere (no C++ plan, no 5-bit codes)."""
    return os.environ.get("SUPERSLM_KERNELS", "auto").strip().lower() == "torch"
