"""sampling layer: per-request token choice (OpenAI/vLLM semantics), batched in torch, and stop strings.

Public API:

- `Sampling`: a request's frozen sampling parameters (`Sampling()` is greedy); `validate(vocab_size)`.
- `SamplerState`: per-request state the engine keeps (params, seed, step, penalty history).
- `sample(logits, states, bitmask=None) -> SampleResult`: one call per engine step.
- `TokenLogprobs`: one row's logprobs (raw model distribution).
- `PenaltyState`, `build_penalty_tensors`: token history for penalties and its batched tensors.
- `apply_token_bitmask` and the other shaping stages (shaping.py), usable on their own.
- `StopChecker`, `StopResult`: stop strings over streamed text.
"""

from superslm.sampling.noise import draw_seed, gumbel_noise, stream_key
from superslm.sampling.params import GREEDY_EPS, MAX_LOGPROBS, DampedGreedy, Sampling
from superslm.sampling.penalties import PenaltyState, build_penalty_tensors
from superslm.sampling.sampler import SampleResult, SamplerState, TokenLogprobs, sample
from superslm.sampling.shaping import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k,
    apply_top_p,
)
from superslm.sampling.stops import StopChecker, StopResult

__all__ = [
    "GREEDY_EPS",
    "MAX_LOGPROBS",
    "DampedGreedy",
    "PenaltyState",
    "SampleResult",
    "SamplerState",
    "Sampling",
    "StopChecker",
    "StopResult",
    "TokenLogprobs",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_token_bitmask",
    "apply_top_k",
    "apply_top_p",
    "build_penalty_tensors",
    "draw_seed",
    "gumbel_noise",
    "sample",
    "stream_key",
]
