"""Which device and dtype a model runs in: the bottom of the house, so formats, encoders and models all ask here."""

from __future__ import annotations

import os

import torch

from superslm.errors import InvalidArgument

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"unknown device {device!r}") from e
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise InvalidArgument(f"device {str(dev)!r}: this machine has {count} CUDA device(s)")
    elif dev.type != "cpu":
        raise InvalidArgument(f"device {str(dev)!r}: models run on cpu or cuda (ROCm devices are cuda too)")
    return dev


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    return DTYPES[dtype]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def set_threads(n: int | None = None) -> int:
    """Threads for the CPU kernels (torch's and ours, which share its pool): `n`, or by default the cores this
    process may use. Returns the number set."""
    if n is None:
        n = usable_cores()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgument(f"threads must be a positive integer, got {n!r}")
    torch.set_num_threads(n)
    return n
