"""The sampler entry point: one call per engine step for every row that samples.

    states = [SamplerState.create(params, prompt_token_ids) for each request]   # once
    result = sample(logits, states, bitmask=grammar_bitmask_or_None)             # each step
    for state, token in zip(states, result.token_list()):                        # one host sync
        state.append_token(token)

`sample` is pure: it reads the states and never changes them, so the engine decides which sampled
tokens it accepts. A row's token depends only on its own logits row, its parameters and its state
(seed, step, penalty history); see noise.py for the random stream and shaping.py for the order of
the shaping stages.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from superslm.errors import InvalidArgument, SuperSLMError
from superslm.kernels import dispatch
from superslm.sampling import on_device
from superslm.sampling._device import upload
from superslm.sampling.batch import sampling_batch
from superslm.sampling.noise import draw_seed, gumbel_noise, keys_tensor
from superslm.sampling.params import Sampling
from superslm.sampling.penalties import PenaltyState, build_penalty_tensors
from superslm.sampling.shaping import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k,
    apply_top_p,
    ranked_top,
)


@dataclass
class SamplerState:
    """What the engine keeps per request for sampling; plain data, saved with `state()`."""

    params: Sampling
    """The request's sampling parameters (validated by the caller)."""
    seed: int
    """The request's seed: `params.seed`, or one drawn from the process RNG at creation."""
    step: int = 0
    """Index of the next output token to sample: the position in the request's random stream."""
    penalties: PenaltyState | None = None
    """Prompt tokens and output counts; kept only when the parameters use penalties."""

    @classmethod
    def create(
        cls,
        params: Sampling,
        prompt_token_ids: Iterable[int] = (),
        *,
        rng: random.Random | None = None,
    ) -> SamplerState:
        """A fresh state for a new request (draws a seed from `rng` or the process RNG if needed)."""
        seed = params.seed if params.seed is not None else draw_seed(rng)
        penalties = PenaltyState.from_prompt(prompt_token_ids) if params.uses_penalties else None
        return cls(params=params, seed=seed, step=0, penalties=penalties)

    def append_token(self, token: int) -> None:
        """Record that `token` was accepted as the output token at position `step`."""
        self.step += 1
        if self.penalties is not None:
            self.penalties.append(token)

    def ahead(self, tokens: Sequence[int]) -> SamplerState:
        """The state as it will be once `tokens` are accepted (a copy; this one is unchanged): a draft row's,
        sampled as plain decoding would sample that position (its place in the random stream, its penalty
        counts)."""
        penalties = self.penalties
        if penalties is not None:
            penalties = PenaltyState(penalties.prompt_token_ids, Counter(penalties.output_counts))
            for token in tokens:
                penalties.append(token)
        return SamplerState(self.params, self.seed, self.step + len(tokens), penalties)

    def state(self) -> dict[str, Any]:
        """Plain, JSON-ready data from which `from_state` rebuilds an identical sampler state."""
        return {
            "params": self.params.to_dict(),
            "seed": self.seed,
            "step": self.step,
            "penalties": None if self.penalties is None else self.penalties.state(),
        }

    @classmethod
    def from_state(cls, data: Mapping[str, Any]) -> SamplerState:
        """Rebuild from `state()` output."""
        penalties = data.get("penalties")
        params = Sampling.from_dict(data["params"])
        seed, step = data["seed"], data["step"]
        if type(seed) is not int or not 0 <= seed < 1 << 64 or type(step) is not int or not 0 <= step < 1 << 62:
            raise ValueError(f"sampler seed {seed!r} / step {step!r} are not counts")
        if params.uses_penalties and penalties is None:
            raise ValueError("the sampler uses penalties but holds no penalty state")
        return cls(
            params=params,
            seed=seed,
            step=step,
            penalties=None if penalties is None or not params.uses_penalties else PenaltyState.from_state(penalties),
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one sampled token under the model's raw distribution (before any shaping)."""

    token: int
    """The sampled token id."""
    logprob: float
    """Its log-probability."""
    rank: int
    """1 + the number of tokens with a strictly higher log-probability."""
    top: tuple[tuple[int, float], ...]
    """The n most likely (token id, logprob) pairs, most likely first (empty for logprobs=0)."""


@dataclass
class SampleResult:
    """What one `sample` call produced; tensors stay on the logits' device until asked for."""

    tokens: Tensor
    """int64 [B]: the sampled token of every row."""
    logprob_rows: tuple[int, ...]
    """Rows that asked for logprobs, ascending; the tensors below have one entry per such row."""
    num_top: tuple[int, ...]
    """For each row in `logprob_rows`, how many top alternatives it asked for."""
    chosen_logprobs: Tensor | None
    """float32 [R]: the sampled token's logprob (None when no row asked)."""
    chosen_ranks: Tensor | None
    """int64 [R]: the sampled token's rank."""
    top_ids: Tensor | None
    """int64 [R, N], N = max(num_top): the most likely token ids, most likely first."""
    top_logprobs: Tensor | None
    """float32 [R, N]: their logprobs."""

    def token_list(self) -> list[int]:
        """The sampled tokens on the host (one device-to-host copy)."""
        return self.tokens.tolist()

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: its TokenLogprobs, or None if it did not ask (one copy for the whole batch)."""
        out: list[TokenLogprobs | None] = [None] * self.tokens.shape[0]
        if not self.logprob_rows:
            return out
        tokens = self.tokens.tolist()
        chosen = self.chosen_logprobs.tolist()
        ranks = self.chosen_ranks.tolist()
        ids = self.top_ids.tolist()
        values = self.top_logprobs.tolist()
        for j, row in enumerate(self.logprob_rows):
            n = self.num_top[j]
            top = tuple(zip(ids[j][:n], values[j][:n], strict=True))
            out[row] = TokenLogprobs(token=tokens[row], logprob=chosen[j], rank=ranks[j], top=top)
        return out


def _index(rows: Sequence[int], device: torch.device) -> Tensor:
    return upload(torch.tensor(rows, dtype=torch.int64), device)


def sample(logits: Tensor, rows: Sequence[SamplerState], *, bitmask: Tensor | None = None,
           fused: bool | None = None) -> SampleResult:
    """Sample one token for every row of `logits`.

    Args:
        logits: float [B, V], the model's next-token logits (any float dtype; shaped in float32).
            Not modified.
        rows: the B rows' sampler states, in the same order (not modified).
        bitmask: optional int32 [B, ceil(V / 32)] grammar bitmask (a set bit allows the token),
            applied after logprobs are taken and before logit_bias; rows without a grammar pass
            all bits set (-1).

    Returns:
        SampleResult with the tokens (int64 [B] on the logits' device) and, for rows whose
        `params.logprobs` is not None, the logprobs of the raw logits (log_softmax in float32)
        as passed in: before the bitmask too. (vLLM's runner masks before its raw logprobs; an
        engine that wants that calls `apply_token_bitmask` itself and passes bitmask=None.)

        fused: run every row through the two device-side kernels (sampling.on_device `shape_logits`,
            `select_tokens`: the same tokens, tests hold them equal) instead of per-stage row subsets.
            None: fused where those kernels are Triton (a GPU, or SUPERSLM_KERNELS=triton): a step then
            costs two launches and no host sync but the tokens' copy. Rows asking for logprobs get their
            tokens the same way; their logprobs come from the raw logits beside.

    Raises:
        InvalidArgument: the shapes do not match.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise InvalidArgument(f"logits {tuple(logits.shape)} do not match {len(rows)} sampler rows")
    n_rows, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    if fused is None:
        try:
            fused = dispatch.backend(device) == "triton"
        except SuperSLMError:  # SUPERSLM_KERNELS=triton on a CPU without the interpreter: the staged path
            fused = False
    shaped = bitmask is not None or any(p.logit_bias or p.uses_penalties or not p.greedy for p in params)
    if bitmask is not None and (bitmask.shape[0] != n_rows or bitmask.shape[-1] * 32 < vocab):
        raise InvalidArgument(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    lp_rows = tuple(i for i, p in enumerate(params) if p.logprobs is not None)
    if fused:
        # every row's token comes from one program of its own (the kernels) or a plain argmax, whatever the
        # other rows ask: a row's token does not depend on whether another row wants logprobs
        if not shaped:
            # plain greedy rows: the kernels' token is the logits' first argmax; one reduction instead of the
            # two kernels (~0.2 ms a step on an H200 at a 152k vocabulary, 13% of a batch-1 decode step)
            tokens = logits.argmax(dim=-1)
        else:
            b = sampling_batch(rows, vocab, device)
            x = on_device.shape_logits(logits, b.temperature, bitmask, b.bias, b.penalties)
            tokens = on_device.select_tokens(x, b.temperature, b.log_min_p, b.top_k, b.top_p, b.keys)
        return _with_logprobs(logits, tokens, params, lp_rows)

    # plain greedy rows read the logits as they are (float32 argmax of bf16 is the same index): a
    # [16, 262k] copy cost Gemma-3 17 MB and ~2 ms a step at 16 streams
    x = logits.to(torch.float32, copy=True) if shaped else logits
    if bitmask is not None:
        apply_token_bitmask(x, bitmask)
    x = _apply_bias_and_penalties(x, rows)

    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == n_rows:
        tokens = x.argmax(dim=-1)  # first index on ties
    elif not greedy:
        tokens = _sample_random(x, rows)
    else:
        rand = [i for i, p in enumerate(params) if not p.greedy]
        greedy_idx, rand_idx = _index(greedy, device), _index(rand, device)
        tokens = torch.empty(n_rows, dtype=torch.int64, device=device)
        tokens[greedy_idx] = x[greedy_idx].argmax(dim=-1)
        tokens[rand_idx] = _sample_random(x[rand_idx], [rows[i] for i in rand])
    return _with_logprobs(logits, tokens, params, lp_rows)


def _with_logprobs(logits: Tensor, tokens: Tensor, params: Sequence[Sampling],
                   lp_rows: tuple[int, ...]) -> SampleResult:
    """The result, with the raw logits' logprobs of the rows in `lp_rows` (log_softmax in float32)."""
    if not lp_rows:
        return SampleResult(tokens, (), (), None, None, None, None)
    n_rows = logits.shape[0]
    device = logits.device
    raw = logits if len(lp_rows) == n_rows else logits[_index(lp_rows, device)]
    num_top = tuple(params[i].logprobs or 0 for i in lp_rows)
    chosen_tokens = tokens if len(lp_rows) == n_rows else tokens[_index(lp_rows, device)]
    chosen, ranks, top_values, top_ids = logprobs_of(raw, chosen_tokens, max(num_top))
    return SampleResult(
        tokens=tokens,
        logprob_rows=lp_rows,
        num_top=num_top,
        chosen_logprobs=chosen,
        chosen_ranks=ranks,
        top_ids=top_ids,
        top_logprobs=top_values,
    )


def logprobs_of(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Of the raw logits [R, V] (log_softmax in float32) and a token per row [R]: its logprob [R], its rank [R]
    (1 + the tokens strictly more likely) and the k most likely (logprobs, ids) [R, k], ties to the lowest id."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens.unsqueeze(1))  # [R, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1
    # a row's list does not depend on the others' k (ranked_top, not topk)
    top_values, top_ids = ranked_top(lp, min(k, lp.shape[1]))
    return chosen.squeeze(1), ranks, top_values, top_ids


def _apply_bias_and_penalties(x: Tensor, rows: Sequence[SamplerState]) -> Tensor:
    """logit_bias then penalties, each only on the rows that use it (argmax-relevant stages)."""
    device = x.device
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            bias_rows.extend([i] * len(r.params.logit_bias))
            bias_tokens.extend(r.params.logit_bias.keys())
            bias_values.extend(float(v) for v in r.params.logit_bias.values())
    if bias_rows:
        idx = upload(torch.tensor([bias_rows, bias_tokens], dtype=torch.int64), device)
        apply_logit_bias(x, idx[0], idx[1], upload(torch.tensor(bias_values, dtype=torch.float32), device))

    pen = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not pen:
        return x
    states = []
    for i in pen:
        if rows[i].penalties is None:
            raise InvalidArgument(f"row {i} uses penalties but its sampler state has no PenaltyState")
        states.append(rows[i].penalties)
    counts, prompt_mask = build_penalty_tensors(states, x.shape[1], device)
    pen_params = [rows[i].params for i in pen]
    factors = upload(
        torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in pen_params],
            dtype=torch.float32,
        ),
        device,
    )  # [P, 3]
    if len(pen) == x.shape[0]:
        return apply_penalties(x, counts, prompt_mask, factors[:, 0], factors[:, 1], factors[:, 2])
    idx = _index(pen, device)
    x[idx] = apply_penalties(x[idx], counts, prompt_mask, factors[:, 0], factors[:, 1], factors[:, 2])
    return x


def _sample_random(x: Tensor, rows: Sequence[SamplerState]) -> Tensor:
    """Temperature, min_p, top_k, top_p, then the Gumbel race; x is float32 [R, V], modified."""
    device = x.device
    vocab = x.shape[1]
    params = [r.params for r in rows]
    # per-row scalars are computed on the host (math.log is the same whatever the batch) and sent
    # in one copy: temperature, log(min_p), top_p
    scalars = upload(
        torch.tensor(
            [[p.temperature, math.log(p.min_p) if p.min_p > 0 else -math.inf, p.top_p] for p in params],
            dtype=torch.float32,
        ),
        device,
    )  # [R, 3]
    x = apply_temperature(x, scalars[:, 0])
    if any(p.min_p > 0 for p in params):
        apply_min_p(x, scalars[:, 1])
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # k >= V keeps everything
    if any(ks):
        apply_top_k(x, upload(torch.tensor(ks, dtype=torch.int64), device), max(ks))
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if len(top_p_rows) == len(rows):
        apply_top_p(x, scalars[:, 2])
    elif top_p_rows:
        # only these rows pay for the full-vocabulary sort
        idx = _index(top_p_rows, device)
        x[idx] = apply_top_p(x[idx], scalars[idx, 2])
    keys = keys_tensor([(r.seed, r.step) for r in rows], device)  # [R, 2]
    x += gumbel_noise(keys, vocab)
    return x.argmax(dim=-1)
