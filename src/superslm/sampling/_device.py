"""Host-to-device copies of the small per-step tensors the sampler builds from Python lists."""

from __future__ import annotations

import torch
from torch import Tensor


def upload(data: Tensor, device: torch.device | str) -> Tensor:
    """Copy a freshly built CPU tensor to `device` without a stream synchronisation.

    A blocking `.to("cuda")` waits for every queued kernel (the forward pass) to finish; a
    non-blocking copy of a temporary the caller never touches again is safe (pageable memory is
    staged before the call returns) and keeps the host running ahead of the device.
    """
    return data.to(device, non_blocking=True)
