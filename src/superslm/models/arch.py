"""Arch: what a model computes, as one frozen dataclass read from config.json or GGUF metadata.

Every family runs on the same forward pass (models/transformer.py); a family's recipe only reads its
config into an Arch and names its tensors. Anything the forward pass cannot honour is refused here,
with an error that names the option, rather than computed wrongly later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from superslm.errors import UnsupportedModel

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
#: a layer's token mixer: softmax attention over the paged KV cache, or a gated delta rule over a recurrent state
MIXERS = ("attention", "delta")


@dataclass(frozen=True)
class Rope:
    """Rotary positions of one kind of layer: base frequency and scaling (as HF's rope_parameters)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    #: llama3: low/high frequency factors; yarn: beta_fast/beta_slow; all: the trained context
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: yarn: attention temperature (mscale) override; None: derived from factor
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    #: per-dimension divisors of the inverse frequencies (GGUF's rope_freqs tensor, Llama 3.1); longrope: the
    #: short factors, used by positions within original_context
    freq_factors: tuple[float, ...] | None = None
    #: longrope: the divisors of positions past original_context
    long_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise UnsupportedModel(f"rope scaling kind {self.kind!r} is not supported (known: {ROPE_KINDS})")
        if self.theta <= 0 or not math.isfinite(self.theta):
            raise UnsupportedModel(f"rope theta must be a positive number, got {self.theta}")
        if self.kind != "default" and not (self.factor > 0 and math.isfinite(self.factor)):
            raise UnsupportedModel(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind == "longrope":
            for name in ("freq_factors", "long_factors"):
                f = getattr(self, name)
                if f is None or not all(math.isfinite(x) and x > 0 for x in f):
                    raise UnsupportedModel(f"longrope needs positive {name.replace('freq', 'short')}, got {f}")
            if self.original_context <= 0:
                raise UnsupportedModel("longrope needs original_max_position_embeddings")

    def inv_freq(self, rotary_dim: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [rotary_dim // 2] (float32) and the attention scaling of cos/sin."""
        base = 1.0 / (self.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if self.freq_factors is not None:
            base = base / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.kind in ("default", "dynamic"):
            # dynamic NTK depends on the position; see Arch.rope_for_positions.
            return base, 1.0
        if self.kind == "linear":
            return base / self.factor, 1.0
        if self.kind == "llama3":
            return _llama3(base, self), 1.0
        if self.kind == "longrope":
            return base, self.longrope_scale()
        return _yarn(self, rotary_dim)

    def long_inv_freq(self, rotary_dim: int) -> torch.Tensor:
        """longrope: the inverse frequencies of positions past original_context (the long factors')."""
        base = 1.0 / (self.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return base / torch.tensor(self.long_factors, dtype=torch.float32)

    def longrope_scale(self) -> float:
        """longrope's scaling of cos/sin: attention_factor, else sqrt(1 + ln(factor) / ln(original)) (transformers)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_context))

    def dynamic_inv_freq(self, rotary_dim: int, seq_len: int, context: int) -> torch.Tensor:
        """Dynamic NTK: the base grows once a sequence passes the trained context (HF's formula)."""
        original = self.original_context or context
        seq_len = max(seq_len, original)
        theta = self.theta * ((self.factor * seq_len / original) - (self.factor - 1)) ** (
            rotary_dim / (rotary_dim - 2)
        )
        return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3(inv_freq: torch.Tensor, r: Rope) -> torch.Tensor:
    old_context = r.original_context or 8192
    low_wavelen = old_context / r.low_freq_factor
    high_wavelen = old_context / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (old_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(r: Rope, dim: int) -> tuple[torch.Tensor, float]:
    factor = r.factor
    if r.attention_factor is not None:
        attention = r.attention_factor
    elif r.mscale and r.mscale_all_dim:
        attention = _yarn_mscale(factor, r.mscale) / _yarn_mscale(factor, r.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)
    original = r.original_context

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    pos_freqs = r.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, attention


@dataclass(frozen=True)
class DeltaNet:
    """The shapes of a gated delta-rule layer (Qwen3.5's and Qwen3-Next's linear attention): `k_heads` query and
    key heads of `k_dim`, `v_heads` value heads of `v_dim` (each key head serves v_heads / k_heads of them), and
    the causal depthwise convolution's `conv` taps over q, k and v."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModel(f"delta-rule layers: {name} must be a positive integer, got {value!r}")
        if self.v_heads % self.k_heads:
            raise UnsupportedModel(f"delta-rule layers: {self.v_heads} value heads for {self.k_heads} key heads")

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_width(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_width + self.value_width


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: `count` experts of `ffn` each, `top_k` of them a token (their router weights
    renormalized to sum 1 where `norm_top_k`), and where `shared_ffn` > 0 a shared expert of that size whose
    output a sigmoid gate scales, added to every token."""

    count: int
    top_k: int
    ffn: int
    norm_top_k: bool = True
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        for name in ("count", "top_k", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModel(f"experts: {name} must be a positive integer, got {value!r}")
        if self.top_k > self.count:
            raise UnsupportedModel(f"experts: top {self.top_k} of {self.count} experts")
        if not isinstance(self.shared_ffn, int) or self.shared_ffn < 0:
            raise UnsupportedModel(f"experts: shared expert size {self.shared_ffn!r}")


@dataclass(frozen=True)
class Arch:
    """What a decoder-only transformer computes; one field per choice the forward pass makes."""

    family: str
    vocab: int
    dim: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    #: rotary positions on the first `rotary_dim` dimensions of each head (NeoX half-split layout)
    rotary_dim: int
    #: rope of global (full-attention) layers and, when different, of sliding-window layers
    rope: Rope = field(default_factory=Rope)
    rope_local: Rope | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    #: never set: configs with mlp_bias are refused (kept so older converted folders' configs still load)
    mlp_bias: bool = False
    tied: bool = False
    #: one entry per layer: None for full attention, else the window in tokens (keys j > i - window)
    windows: tuple[int | None, ...] = ()
    context: int = 2048
    act: str = "silu"
    #: the embedding is multiplied by this (Gemma: sqrt(dim), rounded to the compute dtype)
    embed_scale: float = 1.0
    #: softmax scale of attention scores (head_dim**-0.5, Gemma: query_pre_attn_scalar**-0.5)
    attn_scale: float = 0.0
    #: Gemma's sandwich norms: a norm after attention and after the MLP, before the residual add
    post_norms: bool = False
    #: Gemma multiplies by the norm weight in float32 before casting; Llama casts first
    norm_float: bool = False
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    #: one entry per layer: whether it rotates q and k (SmolLM3's NoPE layers do not); empty: all do
    rope_layers: tuple[bool, ...] = ()
    #: one entry per layer, of MIXERS; empty: all attention. "delta" layers have the shapes of `delta`
    mixers: tuple[str, ...] = ()
    delta: DeltaNet | None = None
    #: attention's sigmoid output gate: q's linear gives each head its query and then its gate (Qwen3.5, Qwen3-Next)
    attn_gate: bool = False
    #: the mixture of experts of the layers `moe_layers` marks (empty: none; the rest have the dense MLP)
    experts: Experts | None = None
    moe_layers: tuple[bool, ...] = ()
    #: multi-token prediction layers after the body (Qwen3.5 / Qwen3-Next `mtp.*`, llama.cpp's "nextn" blocks):
    #: each a full-attention layer that drafts a token from a hidden state and the next token (models/mtp.py)
    mtp: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "ffn", "layers", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModel(f"{self.family}: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise UnsupportedModel(f"{self.family}: heads ({self.heads}) not a multiple of kv heads ({self.kv_heads})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise UnsupportedModel(f"{self.family}: rotary dims {self.rotary_dim} invalid for head dim {self.head_dim}")
        if self.act not in ACTIVATIONS:
            raise UnsupportedModel(f"{self.family}: activation {self.act!r} is not supported")
        if not self.windows:
            object.__setattr__(self, "windows", (None,) * self.layers)
        if len(self.windows) != self.layers:
            raise UnsupportedModel(f"{self.family}: {len(self.windows)} layer kinds for {self.layers} layers")
        if not self.attn_scale:
            object.__setattr__(self, "attn_scale", self.head_dim**-0.5)
        if not self.rope_layers:
            object.__setattr__(self, "rope_layers", (True,) * self.layers)
        if len(self.rope_layers) != self.layers:
            raise UnsupportedModel(f"{self.family}: {len(self.rope_layers)} rope flags for {self.layers} layers")
        if not self.mixers:
            object.__setattr__(self, "mixers", ("attention",) * self.layers)
        if len(self.mixers) != self.layers or any(m not in MIXERS for m in self.mixers):
            raise UnsupportedModel(f"{self.family}: layer mixers {self.mixers} (of {MIXERS}) for {self.layers} layers")
        if "delta" in self.mixers and self.delta is None:
            raise UnsupportedModel(f"{self.family}: delta-rule layers without their shapes")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (self.experts is not None,) * self.layers)
        if len(self.moe_layers) != self.layers or (any(self.moe_layers) and self.experts is None):
            raise UnsupportedModel(f"{self.family}: {len(self.moe_layers)} expert flags for {self.layers} layers")
        if not isinstance(self.mtp, int) or isinstance(self.mtp, bool) or self.mtp < 0:
            raise UnsupportedModel(f"{self.family}: {self.mtp!r} multi-token prediction layers")
        if self.rope.kind == "longrope" and len(self.rope.long_factors or ()) != self.rotary_dim // 2:
            raise UnsupportedModel(f"{self.family}: longrope needs {self.rotary_dim // 2} factors, got "
                                   f"{len(self.rope.long_factors or ())}")
        if self.rope.freq_factors is not None and len(self.rope.freq_factors) != self.rotary_dim // 2:
            raise UnsupportedModel(f"{self.family}: {len(self.rope.freq_factors)} rope frequency factors for "
                                   f"{self.rotary_dim // 2} frequencies")

    def summary(self) -> dict[str, Any]:
        """A JSON-able view for `superslm info` and converted folders. Fields at their defaults that older
        releases did not have (rope_layers all True, no long factors) are left out, so a model's fingerprint
        (a hash of this) is the same as before they existed."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if isinstance(v, Rope):
                v = {n: x for n, x in v.__dict__.items() if not (n == "long_factors" and x is None)}
            elif isinstance(v, (DeltaNet, Experts)):
                v = dict(v.__dict__)
            out[k] = v
        if all(self.rope_layers):
            del out["rope_layers"]
        if not self.hybrid:
            del out["mixers"], out["delta"]
        if not self.attn_gate:
            del out["attn_gate"]
        if self.experts is None:
            del out["experts"], out["moe_layers"]
        if not self.mtp:
            del out["mtp"]
        return out

    @property
    def hybrid(self) -> bool:
        """Whether some layer is a gated delta rule (a recurrent state per sequence beside the KV pages)."""
        return "delta" in self.mixers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged cache, in order."""
        return tuple(i for i, m in enumerate(self.mixers) if m == "attention")


# --- reading Hugging Face configs ---------------------------------------------------------------


def rope_from_params(p: Mapping[str, Any], default_theta: float, context: int, original: int | None = None) -> Rope:
    """A Rope from HF's rope_parameters / rope_scaling dict (both spellings of the kind).

    `original`: a config's top-level original_max_position_embeddings, which transformers prefers to the dict's
    for llama3 and yarn; without either, the trained context is max_position_embeddings (`context`)."""
    if not isinstance(p, Mapping):
        raise UnsupportedModel(f"rope parameters must be a JSON object, got {type(p).__name__}")
    kind = p.get("rope_type", p.get("type", "default")) or "default"
    if kind in ("su", "yarn") and "long_factor" in p:
        kind = "longrope"  # Phi-3's older spellings, as transformers renames them
    known = {
        "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
        "mscale_all_dim", "truncate", "partial_rotary_factor",
    }
    if kind == "longrope":
        known |= {"long_factor", "short_factor"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise UnsupportedModel(f"rope scaling option(s) {unknown} are not supported")
    if kind == "longrope":
        return _longrope(p, default_theta, context, original)
    if kind in ("llama3", "yarn"):
        original = original or p.get("original_max_position_embeddings") or context
    else:
        # dynamic NTK scales past max_position_embeddings whatever the dict says (transformers ignores the key)
        original = None
    factor = p.get("factor")
    if factor is None and kind == "yarn":
        factor = context / int(original)  # transformers: the ratio of the two contexts
    return Rope(
        theta=float(p.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(factor or 1.0),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_context=int(original or 0),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=p.get("attention_factor"),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        truncate=bool(p.get("truncate", True)),
    )


def _longrope(p: Mapping[str, Any], default_theta: float, context: int, original: int | None) -> Rope:
    """Phi-3's LongRoPE as transformers reads it: short factors within the original context, long past it, and
    cos/sin scaled by attention_factor (derived from max_position_embeddings / original when absent)."""
    original = int(original or p.get("original_max_position_embeddings") or context)
    factor = p.get("factor")
    factor = context / original if factor is None else float(factor)

    def factors(key: str) -> tuple[float, ...]:
        got = p.get(key)
        if not isinstance(got, (list, tuple)) or not all(isinstance(x, (int, float)) for x in got):
            raise UnsupportedModel(f"longrope {key} must be a list of numbers, got {got!r}")
        return tuple(float(x) for x in got)

    attention = p.get("attention_factor")
    return Rope(theta=float(p.get("rope_theta", default_theta)), kind="longrope", factor=float(factor),
                original_context=original, attention_factor=None if attention is None else float(attention),
                freq_factors=factors("short_factor"), long_factors=factors("long_factor"))


def hf_ropes(cfg: Mapping[str, Any], local_theta_key: str | None = None) -> tuple[Rope, Rope | None]:
    """(global rope, local rope or None) from a config in either the old or the new (v5) spelling."""
    context = int(cfg.get("max_position_embeddings", 2048))
    params = cfg.get("rope_parameters")
    theta = float(cfg.get("rope_theta", 10000.0))
    if isinstance(params, Mapping) and "full_attention" in params:
        glob = rope_from_params(params["full_attention"], theta, context)
        loc = params.get("sliding_attention")
        return glob, rope_from_params(loc, theta, context) if loc else None
    original = cfg.get("original_max_position_embeddings")
    if params and not isinstance(params, Mapping):
        raise UnsupportedModel(f"rope_parameters must be a JSON object, got {type(params).__name__}")
    if isinstance(params, Mapping) and params:
        glob = rope_from_params(params, theta, context, original)
    elif cfg.get("rope_scaling"):
        glob = rope_from_params(cfg["rope_scaling"], theta, context, original)
    else:
        glob = Rope(theta=theta)
    local = None
    if local_theta_key and cfg.get(local_theta_key):
        local = Rope(theta=float(cfg[local_theta_key]))
    return glob, local


def eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def hf_layer_windows(cfg: Mapping[str, Any], layers: int, max_window_layers: bool = False) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` (v5 and recent configs) or None everywhere.

    `max_window_layers`: Qwen2/Qwen3 configs without `layer_types` (older transformers wrote them) slide a
    window on layers >= max_window_layers when use_sliding_window is set, as transformers derives them."""
    kinds = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if not kinds and max_window_layers and cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        return tuple(None if i < first else int(window) for i in range(layers))
    if not kinds:
        return (None,) * layers
    out: list[int | None] = []
    for kind in kinds:
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise UnsupportedModel("a sliding_attention layer without sliding_window")
            out.append(int(window))
        else:
            raise UnsupportedModel(f"layer type {kind!r} is not supported")
    return tuple(out)


def check_known(cfg: Mapping[str, Any], refusals: Mapping[str, Any]) -> None:
    """Refuse options whose value changes what is computed in a way we do not implement."""
    for key, allowed in refusals.items():
        value = cfg.get(key)
        if value not in allowed:
            raise UnsupportedModel(f"config option {key}={value!r} is not supported")


def gguf_get(md: Mapping[str, Any], key: str, default: Any = None, required: bool = False) -> Any:
    if key in md:
        return md[key]
    if required:
        raise UnsupportedModel(f"GGUF metadata has no {key}")
    return default


def gguf_longrope(arch: Arch, md: Mapping[str, Any], long: tuple[float, ...], short: tuple[float, ...]) -> Arch:
    """The Arch of a GGUF file that carries LongRoPE factors (llama.cpp's rope_factors_long/short tensors): the
    trained context and the cos/sin scale come from the metadata, as llama.cpp's converter writes them."""
    a = gguf_get(md, "general.architecture", required=True)
    original = gguf_get(md, f"{a}.rope.scaling.original_context_length")
    if not original:
        raise UnsupportedModel(f"{a}: LongRoPE factors without rope.scaling.original_context_length")
    attn = gguf_get(md, f"{a}.rope.scaling.attn_factor")
    rope = Rope(theta=arch.rope.theta, kind="longrope", factor=arch.context / int(original),
                original_context=int(original), attention_factor=None if attn is None else float(attn),
                freq_factors=short, long_factors=long)
    return replace(arch, rope=rope)
