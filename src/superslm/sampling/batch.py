"""The inputs of device-side sampling (kernels.dispatch `shape_logits`, `select_tokens`) for a batch of
sampler rows: what `sampler.sample` computes per row subset on the host, here as whole-batch tensors
uploaded once, so a step's sampling runs on the device with no host sync but the tokens' copy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from superslm.errors import InvalidArgument
from superslm.kernels.sampling_args import LogitBias, Penalties
from superslm.sampling._device import upload
from superslm.sampling.noise import keys_tensor
from superslm.sampling.penalties import build_penalty_tensors

if TYPE_CHECKING:
    from superslm.sampling.sampler import SamplerState


@dataclass(frozen=True)
class SamplingBatch:
    """The inputs of `shape_logits` and `select_tokens` for a batch of sampler rows (one upload each)."""

    temperature: torch.Tensor  # float32 [B], 0 for greedy rows
    bias: LogitBias | None  # None when no row has a logit_bias
    penalties: Penalties | None  # None when no row uses penalties
    log_min_p: torch.Tensor  # float32 [B], log(min_p), -inf when off
    top_k: torch.Tensor  # int32 [B], 0 (or >= V) when off
    top_p: torch.Tensor  # float32 [B], 1 when off
    keys: torch.Tensor  # int64 [B, 2], noise.stream_key(seed, step)


def sampling_batch(rows: Sequence[SamplerState], vocab: int, device: torch.device) -> SamplingBatch:
    """What sampler.sample computes on the host for `rows`, as the kernels' inputs (no device sync)."""
    params = [r.params for r in rows]
    # greedy is decided here, in float64 as Sampling.greedy does; the kernels see temperature 0
    scalars = upload(torch.tensor(
        [[0.0 if p.greedy else p.temperature, math.log(p.min_p) if p.min_p > 0 else -math.inf, p.top_p]
         for p in params], dtype=torch.float32).reshape(-1, 3), device)  # fmt: skip
    top_k = upload(torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int32), device)
    bias = None
    if any(p.logit_bias for p in params):
        pairs = [(t, float(v)) for p in params for t, v in (p.logit_bias or {}).items()]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + len(p.logit_bias or ()))
        bias = LogitBias(upload(torch.tensor(offsets, dtype=torch.int32), device),
                         upload(torch.tensor([t for t, _ in pairs], dtype=torch.int32), device),
                         upload(torch.tensor([v for _, v in pairs], dtype=torch.float32), device))  # fmt: skip
    penalties = None
    pen = [i for i, p in enumerate(params) if p.uses_penalties]
    if pen:
        if any(rows[i].penalties is None for i in pen):
            raise InvalidArgument("a row uses penalties but its sampler state has no PenaltyState")
        counts, prompt_mask = build_penalty_tensors([rows[i].penalties for i in pen], vocab, device)
        index = [-1] * len(rows)
        for j, i in enumerate(pen):
            index[i] = j
        factors = [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params]
        penalties = Penalties(upload(torch.tensor(index, dtype=torch.int32), device), counts, prompt_mask,
                              upload(torch.tensor(factors, dtype=torch.float32), device))  # fmt: skip
    keys = keys_tensor([(r.seed, r.step) for r in rows], device)
    return SamplingBatch(scalars[:, 0], bias, penalties, scalars[:, 1], top_k, scalars[:, 2], keys)
