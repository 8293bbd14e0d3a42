"""Sampling on the device: the torch references of kernels/triton/sampling.py's kernels, and the choice between them.

`shape_logits_reference` and `select_tokens_reference` run this package's own stages on every row at once;
sampling/batch.py builds their inputs (kernels.sampling_args: `LogitBias`, `Penalties`). `shape_logits` and
`select_tokens` run the Triton kernels where kernels.dispatch chose Triton for the device, else the references.
"""

from __future__ import annotations

import torch

from superslm.kernels.dispatch import triton_kernels
from superslm.kernels.sampling_args import LogitBias, Penalties
from superslm.sampling.noise import gumbel_noise
from superslm.sampling.params import GREEDY_EPS
from superslm.sampling.shaping import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k,
    apply_top_p,
)


def shape_logits_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bias: LogitBias | None = None,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """float32 [B, V]: sampler.sample's stages up to the temperature, on every row at once.

    The grammar bitmask (int32 [B, words]), logit_bias, the penalties, then logits / temperature
    on rows with temperature >= GREEDY_EPS (greedy rows stay undivided: their argmax is the token).
    Each stage is exactly neutral where a row has it off, so this equals the sampler's per-row
    subsets. `logits` (any float dtype) is not modified.
    """
    x = logits.to(torch.float32, copy=True)
    if bitmask is not None:
        apply_token_bitmask(x, bitmask)
    if bias is not None:
        per_row = bias.offsets[1:] - bias.offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), per_row,
                                       output_size=bias.tokens.shape[0])  # fmt: skip
        apply_logit_bias(x, rows, bias.tokens.long(), bias.values)
    if penalties is not None and penalties.counts.shape[0] > 0:
        on = (penalties.rows >= 0).unsqueeze(1)
        idx = penalties.rows.clamp(min=0).long()
        # (0, 0, 1) leaves a row exactly unchanged
        f = torch.where(on, penalties.factors, torch.tensor([0.0, 0.0, 1.0], device=x.device))
        x = apply_penalties(x, penalties.counts[idx], penalties.prompt_mask[idx], f[:, 0], f[:, 1], f[:, 2])
    return apply_temperature(x, torch.where(temperature < GREEDY_EPS, 1.0, temperature))


def select_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    log_min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [B]: sampler.sample's token of every row from `shape_logits_reference`'s output.

    Rows with temperature < GREEDY_EPS take the first argmax; the others min_p (log_min_p float32
    [B]), top_k (int [B], 0 or >= V off), top_p (float32 [B]), then argmax(x + gumbel_noise(keys)).
    `filtered`, if given (float32 [B, V]), receives the logits after top_p (greedy rows: unchanged).
    """
    x = logits.to(torch.float32, copy=True)
    vocab = x.shape[1]
    greedy = temperature < GREEDY_EPS
    first = x.argmax(dim=-1)
    apply_min_p(x, log_min_p)
    # max_k = V sorts whole rows: the same k-th values as the sampler's max(k), with no host sync
    apply_top_k(x, torch.where((top_k > 0) & (top_k < vocab), top_k, 0).long(), vocab)
    x = apply_top_p(x, top_p)
    if filtered is not None:
        filtered.copy_(torch.where(greedy.unsqueeze(1), logits.float(), x))
    x += gumbel_noise(keys, vocab)
    return torch.where(greedy, first, x.argmax(dim=-1))


def shape_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bias: LogitBias | None = None,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """`shape_logits_reference` on the chosen backend."""
    t = triton_kernels(logits.device)
    return (t.shape_logits if t else shape_logits_reference)(logits, temperature, bitmask, bias, penalties)


def select_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    log_min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    filtered: torch.Tensor | None = None,
) -> torch.Tensor:
    """`select_tokens_reference` on the chosen backend."""
    t = triton_kernels(logits.device)
    fn = t.select_tokens if t else select_tokens_reference
    return fn(logits, temperature, log_min_p, top_k, top_p, keys, filtered)
