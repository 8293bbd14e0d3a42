"""Batched logit shaping: one vectorised op per stage over [N, V] float32 logits.

Order (vLLM v1's sampler, vllm/v1/sample/sampler.py):

    1. grammar bitmask            (vLLM applies it in the model runner, before the sampler)
    2. logit_bias                 (a non-argmax-invariant logits processor)
    3. penalties                  repetition, then frequency, then presence
    -- greedy rows take the argmax here; the stages below only move probability mass --
    4. temperature
    5. min_p                      (vLLM v1 runs it as an argmax-invariant processor after temperature)
    6. top_k, then top_p          (top_p renormalises over what min_p and top_k left)

vLLM v0 ran min_p after top_k/top_p instead. The two orders keep the same min_p and top_k sets
(both are thresholds on the same ranking), but top_p differs: here it sees the mass left by min_p.

Every stage is exactly neutral at its "off" value (k = 0, p = 1, min_p = 0, penalties 0/1), so a
row's result never depends on which other rows are in the batch or which stages they switch on.
Functions modify `logits` in place where they can and return the result.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from superslm.errors import InvalidArgument

NEG_INF = float("-inf")


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None) -> Tensor:
    """Set disallowed tokens to -inf, in place (xgrammar / llguidance bitmask convention).

    Bit j of word w (int32, least significant bit first) is token 32 * w + j; a set bit means the
    token is allowed. As in xgrammar's reference implementation, bits past the logits' width are
    ignored and logits past the bitmask's 32 * W tokens are left unchanged.

    Args:
        logits: float [B, V].
        bitmask: int32 [R, W] with W = ceil(V / 32) (R = B, or R = len(indices)).
        indices: optional int64 [R]: which logits rows the bitmask rows apply to.

    Returns:
        `logits`, modified.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise InvalidArgument(
            f"bitmask must be int32 [rows, words], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    rows_expected = logits.shape[0] if indices is None else indices.shape[0]
    if bitmask.shape[0] != rows_expected:
        raise InvalidArgument(f"bitmask has {bitmask.shape[0]} rows, expected {rows_expected}")
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    # move the packed words (V/8 bytes a row), not the unpacked mask; a pinned bitmask may be
    # refilled by the grammar right after this call, so only pageable ones go non-blocking
    bitmask = bitmask.to(logits.device, non_blocking=not bitmask.is_pinned())
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    disallowed = (bits == 0).reshape(bitmask.shape[0], -1)[:, :width]  # [R, width]
    if indices is None:
        logits[:, :width].masked_fill_(disallowed, NEG_INF)
    else:
        rows = logits[indices, :width].masked_fill_(disallowed, NEG_INF)  # gathered copy [R, width]
        logits[indices, :width] = rows
    return logits


def apply_logit_bias(logits: Tensor, rows: Tensor, tokens: Tensor, bias: Tensor) -> Tensor:
    """logits[rows[i], tokens[i]] += bias[i] for every i, in place (pairs must be distinct)."""
    logits.index_put_((rows, tokens), bias.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(
    logits: Tensor,
    output_counts: Tensor,
    prompt_mask: Tensor,
    presence: Tensor,
    frequency: Tensor,
    repetition: Tensor,
) -> Tensor:
    """Repetition, frequency and presence penalties (vLLM / OpenAI definitions).

    Repetition applies to tokens seen in the prompt or the output: a positive logit is divided by
    it, any other multiplied. Frequency subtracts frequency * count(output); presence subtracts
    presence once if the token occurs in the output.

    Args:
        logits: float [N, V].
        output_counts: integer [N, V], occurrences of each token in the output.
        prompt_mask: bool [N, V], tokens that occur in the prompt.
        presence, frequency, repetition: float [N].

    Returns:
        The penalised logits (a new tensor).
    """
    in_output = output_counts > 0  # [N, V]
    seen = prompt_mask | in_output
    one = torch.ones((), dtype=logits.dtype, device=logits.device)
    rep = torch.where(seen, repetition.unsqueeze(1), one)  # [N, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= frequency.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits / temperature per row, in place (temperature float [N], all > 0)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: Tensor, log_min_p: Tensor) -> Tensor:
    """Mask tokens with p < min_p * p_max, in place.

    Compared in log space, l - l_max < log(min_p), which needs no softmax.

    Args:
        logits: float [N, V].
        log_min_p: float [N], log(min_p) per row; -inf (min_p = 0) keeps everything. Computed on
            the host by the sampler so that the threshold cannot depend on the batch.
    """
    top = logits.amax(dim=-1, keepdim=True)  # [N, 1]
    drop = (logits - top) < log_min_p.unsqueeze(1)
    return logits.masked_fill_(drop, NEG_INF)


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int) -> Tensor:
    """Keep each row's top_k largest logits (ties with the k-th value are kept), in place.

    Args:
        logits: float [N, V].
        top_k: int64 [N], 0 means off; values must be <= V.
        max_k: max(top_k), known on the host (so no device sync is needed to size the topk).
    """
    if max_k <= 0:
        return logits
    kth = logits.topk(max_k, dim=-1).values  # [N, max_k], sorted descending
    threshold = kth.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))  # [N, 1]
    neg_inf = torch.full_like(threshold, NEG_INF)
    threshold = torch.where(top_k.unsqueeze(1) > 0, threshold, neg_inf)
    return logits.masked_fill_(logits < threshold, NEG_INF)


#: on CPU, top_p first tries the this many most likely tokens before sorting the whole vocabulary
TOP_P_CANDIDATES = 1024


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Nucleus filter, in place: keep the most likely tokens until their mass reaches top_p.

    A token is kept when the mass of the tokens ranked strictly above it is < top_p (so the top
    token always is), the same set as vLLM's "drop the least likely while their mass <= 1 - p".
    Ties are ranked by token id; rows with top_p >= 1 are left exactly unchanged.

    Masses are unnormalised exp(l - l_max) accumulated in float64 (the total by a row sum), so the
    cut does not hinge on float32 rounding. On CPU the rows whose nucleus lies inside the top
    TOP_P_CANDIDATES tokens skip the full sort; both paths add the same numbers in the same order,
    so which path a row takes never changes its result.

    Args:
        logits: float [N, V].
        top_p: float [N] in (0, 1].
    """
    top = logits.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = (logits - top).exp().to(torch.float64)  # [N, V], unnormalised
    limit = top_p.to(torch.float64).unsqueeze(1) * probs.sum(dim=-1, keepdim=True)  # [N, 1]
    active = (top_p < 1).unsqueeze(1)  # [N, 1]
    limit = torch.where(active, limit, torch.full_like(limit, math.inf))
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and vocab > 4 * TOP_P_CANDIDATES:
        # a host check is free on CPU; on an accelerator the full sort avoids a sync
        drop, inside = _top_p_candidates(logits, probs, limit, TOP_P_CANDIDATES)
        drop &= active
        inside |= ~active.squeeze(1)
        if not inside.any():
            drop = _top_p_sorted(logits, probs, limit)
        elif not inside.all():
            rest = (~inside).nonzero().squeeze(1)  # [M]
            drop[rest] = _top_p_sorted(logits[rest], probs[rest], limit[rest])
    else:
        drop = _top_p_sorted(logits, probs, limit)
    return logits.masked_fill_(drop, NEG_INF)


def _top_p_sorted(logits: Tensor, probs: Tensor, limit: Tensor) -> Tensor:
    """bool [N, V]: tokens the nucleus drops, by a stable sort of the whole row."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices  # [N, V]
    sorted_probs = probs.gather(1, order)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass ranked strictly above
    return torch.empty_like(before, dtype=torch.bool).scatter_(1, order, before >= limit)


def _top_p_candidates(logits: Tensor, probs: Tensor, limit: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Nucleus over the k most likely tokens: (drop bool [N, V], inside bool [N]).

    `inside` marks rows whose result is exact: the mass strictly above the k-th value already
    reaches the limit, so every token at or below that value is dropped whatever its tie order.
    """
    vals, ids = logits.topk(k, dim=-1)  # [N, k], tie order unspecified
    ids, perm = ids.sort(dim=-1)  # token order first ...
    vals = vals.gather(1, perm)
    vals, perm = vals.sort(dim=-1, descending=True, stable=True)  # ... so ties rank by token id
    ids = ids.gather(1, perm)
    cand = probs.gather(1, ids)  # [N, k]
    before = cand.cumsum(dim=-1) - cand
    above = (vals > vals[:, -1:]).sum(dim=-1, keepdim=True)  # [N, 1], < k
    inside = (before.gather(1, above) >= limit).squeeze(1)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, ids, before >= limit)
    return drop, inside


def ranked_top(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of float32 x [N, V]: (values, ids) [N, k], by value, ties to the lowest
    token id. A row's list is a prefix of its longer lists and does not depend on the other rows (topk orders
    ties as its algorithm, chosen by k and the row count, happens to): one topk over unique int64 keys, the
    float's order in the high half, the reversed token id in the low."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, equal values one key
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # ordered as the floats
    low = 0xFFFFFFFF - torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    keys = order * (1 << 32) + low  # [N, V], unique per row
    ids = 0xFFFFFFFF - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)
    return x.gather(1, ids), ids
