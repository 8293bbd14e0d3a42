"""Token rows -> one vector per sequence: sentence-transformers' pooling modes, Dense and Normalize."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from superslm.encoders.batching import Packed
from superslm.encoders.config import DenseSpec
from superslm.encoders.net import Linear, read_tensors
from superslm.errors import FormatError


def _pool_group(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [count, length, dim] (float32) -> [count, dim]."""
    length = x.shape[1]
    if mode == "cls":
        return x[:, 0]
    if mode == "lasttoken":
        return x[:, -1]
    if mode == "max":
        return x.amax(dim=1)
    if mode == "mean":
        return x.sum(dim=1) / length
    if mode == "mean_sqrt_len_tokens":
        return x.sum(dim=1) / (float(length) ** 0.5)
    if mode == "weightedmean":
        w = torch.arange(1, length + 1, dtype=x.dtype, device=x.device)  # [length]
        return (x * w[None, :, None]).sum(dim=1) / w.sum()
    raise AssertionError(mode)


def pool(h: torch.Tensor, packed: Packed, modes: Sequence[str]) -> torch.Tensor:
    """Hidden rows h [N, dim] -> [S, len(modes) * dim] float32, the modes concatenated in order,
    the sequences in packed order."""
    d = h.shape[1]
    out = []
    for start, count, length in packed.groups:
        x = h[start : start + count * length].view(count, length, d).float()  # [count, length, dim]
        out.append(torch.cat([_pool_group(x, m) for m in modes], dim=1))
    return torch.cat(out)


class Dense:
    """A sentence-transformers Dense module: act(x W^T + b) with the weights of its own folder."""

    def __init__(self, spec: DenseSpec, device: torch.device) -> None:
        t = read_tensors(spec.folder)
        w = t.get("linear.weight")
        if w is None or tuple(w.shape) != (spec.out_features, spec.in_features):
            raise FormatError(f"{spec.folder}: linear.weight missing or not [{spec.out_features}, {spec.in_features}]")
        b = t.get("linear.bias") if spec.bias else None
        if spec.bias and (b is None or tuple(b.shape) != (spec.out_features,)):
            raise FormatError(f"{spec.folder}: linear.bias missing or not [{spec.out_features}]")
        self.linear = Linear(
            w.to(device, torch.float32).contiguous(), None if b is None else b.to(device, torch.float32), spec.act
        )
        self.out_features = spec.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def finish(x: torch.Tensor, dense: Sequence[Dense], normalize: bool) -> torch.Tensor:
    """Pooled vectors through the Dense modules, then L2-normalized when the model has Normalize."""
    for d in dense:
        x = d(x)
    return F.normalize(x, p=2.0, dim=1) if normalize else x
