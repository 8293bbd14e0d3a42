"""Which device and dtype a model runs in: the bottom of the house, so formats, encoders and models all ask here."""

from __future__ import annotations

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
