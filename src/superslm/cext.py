"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled once per machine and loaded.

Built at first use with the system's C++ compiler and the ninja wheel (torch.utils.cpp_extension) into
$TORCH_EXTENSIONS_DIR, else $SUPERSLM_CACHE/kernels (~/.cache/superslm/kernels), named by a hash of the
sources, this CPU's flags, torch's version and the build flags; later processes import the built module
directly (cpp_extension pulls in setuptools: ~5 MB of RSS and 50 ms for nothing once it is built). The bottom of
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
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent / "kernels" / "cpu"
_SOURCES = [_DIR / n for n in ("decode_layers.cpp", "gemv.cpp", "gemm.cpp", "greedy.cpp", "avx2.cpp", "delta_step.cpp",
                               "moe_step.cpp", "iq4.cpp", "prompt.cpp", "q6k.cpp", "avx2_rows.cpp", "pair_rows.cpp",
                               "q80.cpp")]
_HEADERS = [_DIR / n for n in ("vnni.h", "rowops.h", "rowbase.h", "rowops_avx2.h", "plan_linear.h", "int5_avx2.h",
                               "parts_layer.h", "dynamic_for.h", "aten_ops.h", "q8_groups.h", "decoded_gemm.h",
                               "pair_tiles.h", "iq4_scales.h")]
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


def _build_dir(name: str) -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env) / name
    cache = os.environ.get("SUPERSLM_CACHE")
    return (Path(cache) if cache else Path.home() / ".cache" / "superslm") / "kernels" / name


def _import_built(name: str, path: Path) -> Any:
    """The built module at `path`, imported as cpp_extension.load would after building it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    # ... and the interpreter's ABI: two venvs of different Pythons share the cache folder
    abi = sys.implementation.cache_tag or ""
    build = " ".join([_cpu_flags(), torch.__version__, abi, *_CFLAGS, *_LDFLAGS]).encode()
    tag = hashlib.sha256(src + build).hexdigest()[:12]
    name = f"superslm_decode_{tag}"
    build_dir = _build_dir(name)
    built = build_dir / f"{name}.so"
    if built.exists():
        try:
            _ext = _import_built(name, built)
            return _ext
        except Exception as e:  # a damaged build: removed, so cpp_extension (ninja) rebuilds it below
            log.warning("superslm: rebuilding the C++ kernels (%s)", str(e).splitlines()[0])
            built.unlink(missing_ok=True)
    try:
        from torch.utils.cpp_extension import load

        try:  # the `ninja` wheel's binary, for interpreters run without their venv activated
            import ninja

            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

        # the first use on a machine compiles (100 s on 2 cores of an AMD EPYC): say so rather than look hung;
        # a second process waits on the first one's lock (torch's FileBaton) and says that instead
        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        if (build_dir / "lock").exists():
            print("superslm: another process is building the C++ kernels for this machine; waiting for it...",
                  file=sys.stderr, flush=True)
        else:
            print("superslm: building the C++ kernels for this machine (once; 1-3 minutes on 2 cores)...",
                  file=sys.stderr, flush=True)
        start = time.monotonic()
        _ext = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(build_dir),
            verbose=False,
        )
        print(f"superslm: C++ kernels ready ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    except Exception as e:  # no compiler, no ninja, headers missing: the reference still runs
        log.warning("superslm: C++ decode layers unavailable (%s); using the torch path", str(e).splitlines()[0])
        _ext = None
    return _ext


#: a build lock older than this was left by a process killed mid-build (builds take 1-3 minutes, ~12 under heavy
#: load): torch's FileBaton would wait on it forever
STALE_LOCK_S = 30 * 60


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove `build_dir`'s build lock when it is older than STALE_LOCK_S; True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False
    log.warning("superslm: removing a stale C++ kernels build lock (%.0f min old): %s", age / 60, lock)
    lock.unlink(missing_ok=True)
    return True


def vnni() -> Any:
    """The extension when it runs the VNNI kernels on this CPU (AVX-512 VNNI, not switched off), else None."""
    ext = extension()
    return ext if ext is not None and ext.vnni_available() else None


def torch_kernels_forced() -> bool:
    """Whether `SUPERSLM_KERNELS=torch` asks for torch's kernels everywhere (no C++ plan, no 5-bit codes)."""
    return os.environ.get("SUPERSLM_KERNELS", "auto").strip().lower() == "torch"
