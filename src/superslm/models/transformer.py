"""The one forward pass every family runs, driven by its Arch.

Split in three so the engine can slice a token's work (layer budgets): `embed` (tokens -> residual
stream), `run_layers(h, meta, kv, start, end)` and `logits`/`final_norm`. Rows are flat: a step may
mix prefill chunks and decode tokens of many sequences; `AttnMetadata` says which is which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from superslm.errors import InvalidArgument
from superslm.kernels import cpu_decode
from superslm.kernels.attention import AttnMetadata, QKVSpec
from superslm.kernels.cpu_decode import decode_layers, row_key_slots
from superslm.kernels.dispatch import (
    add_rms_norm,
    attention_linear,
    attention_rotate,
    backend,
    dense_matmul,
    gated_act,
    gated_act_rotate,
    gated_act_rotate_int4,
    norm_gemv_rows,
    norm_linear,
    norm_rotate,
    norm_rotate_int4,
    prepare_attention,
    rms_norm,
)
from superslm.kernels.fused import Int4Weight
from superslm.kernels.norm import norm_dtype
from superslm.kernels.rope import rope_cos_sin
from superslm.kernels.row_blocks import BLOCK, by_row_blocks, pad_rows
from superslm.models.arch import Arch
from superslm.models.layers import MoE, PartsLayer, _linear
from superslm.models.mtp import MTP
from superslm.models.parts import LINEAR_NAMES, NORMS, LayerParts, stacked


class DenseLinear(nn.Module):
    """y = x W^T (+ b) with W in the compute dtype; other weight formats replace this module."""

    #: BLAS may sum a row differently with another number of rows: deterministic mode multiplies 16 at a time
    row_invariant = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]]:
        """The C++ plan's operands (kernels.cpu_decode.build_plan): kind 0, the weight in the compute dtype."""
        w = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()
        return [w, None, bias, None, None, None], [0, 0, w.shape[0], w.shape[1], w.shape[1]]

    def forward_row_blocks(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Deterministic mode's rule, x [M, in] -> [M, out]: 16 rows a call (kernels.dispatch.dense_matmul; on the
        Triton path one launch of fixed 16-row tiles, not a cuBLAS call per block). A hook keeps the module's call."""
        if self._forward_pre_hooks or self._forward_hooks or x.dtype != self.weight.dtype:
            return by_row_blocks(self, x)
        return dense_matmul(x, self.weight, self.bias, BLOCK)


class Layer(nn.Module):
    """One transformer block: attention over the paged cache, then a gated MLP."""

    def __init__(self, arch: Arch, index: int, w: Mapping[str, torch.Tensor | None]) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        self.window = arch.windows[index]
        # each linear is one matmul: q, k, v stacked, gate and up stacked (as the checkpoint fused them or not)
        for name in LINEAR_NAMES:
            setattr(self, name, DenseLinear(*stacked(w, name, arch)))
        wanted = LayerParts().norms(arch)
        for n in NORMS:  # in this order: a model's fingerprint hashes its buffers in order
            if n in wanted:
                self.register_buffer(n, w[n], persistent=False)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, getattr(self, name), self.arch.norm_eps, self.arch.norm_float)

    def linears(self) -> list[tuple[nn.Module, str, str]]:
        """(parent module, attribute, name within the layer) of each linear a weight format may replace."""
        return [(self, name, name) for name in LINEAR_NAMES]

    def forward(
        self,
        h: torch.Tensor,
        meta: AttnMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream h, this layer's MLP output y) for h [N, dim]: the stream after the layer is h + y,
        which the next layer adds in its first norm (`pending`, this y), one kernel fewer per layer."""
        a = self.arch
        n = h.shape[0]
        lora = meta.lora
        bias = None
        src, residual = (h, None) if pending is None else (pending, h)  # the first norm's input, what it adds to
        done = self._rotated(self.qkv, self.attn_norm, src, residual, lora, meta.deterministic)
        if done is not None:
            qkv, h = done
        else:
            qkv, h, bias = self._qkv(src, residual, lora, meta.deterministic)
        q_norm, k_norm = (self.q_norm, self.k_norm) if a.qk_norm else (None, None)
        spec = QKVSpec(a.heads, a.kv_heads, bias, q_norm, k_norm, a.norm_eps, a.norm_float, self.window, a.attn_scale)
        prep = (qkv, spec, *cos_sin, k_cache, v_cache, meta)
        rot = _fused_rotation(self.o, qkv, lora)
        if rot is not None:  # the merge of the attention's key splits rotates o's input (int4/int8)
            o = _linear(self.o, attention_rotate(*prep, *rot), meta.deterministic, qkv.dtype)
        elif _gemv_fused(self.o, qkv, lora, meta.deterministic) and self.o.bias is None:
            # a few rows: the o projection's GEMV merges the attention's key splits
            o = attention_linear(*prep, self.o.weight)
        else:
            # bias, q/k norms, RoPE, the KV store and the attention: one launch of a decode step on the GPU
            o_in = prepare_attention(*prep).reshape(n, a.heads * a.head_dim)
            o = _linear(self.o, o_in, meta.deterministic)
            if lora is not None:
                o = lora.apply(self.index, "o", o_in, o)
        if a.post_norms:
            o = self.norm(o, "post_attn_norm")
        done = self._rotated(self.gate_up, self.ffn_norm, o, h, lora, meta.deterministic)
        if done is not None:
            gu, h = done
        elif _gemv_fused(self.gate_up, o, lora, meta.deterministic) and _fused_rotation(self.down, o, lora) is None:
            # add + norm, gate_up and the activation in one GEMV launch
            act, h = norm_linear(o, h, self.ffn_norm, a.norm_eps, a.norm_float, self.gate_up.weight, a.act)
            return h, self._down(act, lora, meta.deterministic)
        else:
            x, h = add_rms_norm(o, h, self.ffn_norm, a.norm_eps, a.norm_float)
            gu = _linear(self.gate_up, x, meta.deterministic)
            if lora is not None:
                gu = lora.apply(self.index, "gate_up", x, gu)
        rot = _fused_rotation(self.down, gu, lora)
        if rot is not None:  # the activation's kernel rotates the down projection's input
            w4 = _int4_gemv(self.down, gu, meta.deterministic)
            if w4 is not None:  # ... inside the down projection's int4 GEMV
                y = self.down.finish(gated_act_rotate_int4(gu, a.act, *rot, w4), gu.dtype)
            else:
                y = _linear(self.down, gated_act_rotate(gu, a.act, *rot), meta.deterministic, gu.dtype)
            return h, (self.norm(y, "post_ffn_norm") if a.post_norms else y)
        return h, self._down(gated_act(gu, a.act), lora, meta.deterministic)

    def _down(self, act: torch.Tensor, lora: Any, deterministic: bool) -> torch.Tensor:
        """The MLP's output from its activation: the down projection (+ LoRA), then Gemma's post-norm."""
        y = _linear(self.down, act, deterministic)
        if lora is not None:
            y = lora.apply(self.index, "down", act, y)
        if self.arch.post_norms:
            y = self.norm(y, "post_ffn_norm")
        return y

    def _rotated(
        self, lin: nn.Module, norm: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, lora: Any,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """(lin(rms_norm(residual + x)), residual + x) with the norm's kernel rotating lin's input (x alone
        without a residual), inside an int4 lin's GEMV at a few rows; None where that rotation cannot move into
        the norm (`_fused_rotation`)."""
        rot = _fused_rotation(lin, x, lora)
        if rot is None:
            return None
        a = self.arch
        dtype = norm_dtype(x.dtype, norm.dtype, a.norm_float)
        w4 = _int4_gemv(lin, x, deterministic)
        if w4 is not None:
            y, h = norm_rotate_int4(x, residual, norm, a.norm_eps, a.norm_float, *rot, w4)
            return lin.finish(y, dtype), (x if h is None else h)
        xr, h = norm_rotate(x, residual, norm, a.norm_eps, a.norm_float, *rot)
        return _linear(lin, xr, deterministic, dtype), (x if h is None else h)

    def _qkv(
        self, src: torch.Tensor, residual: torch.Tensor | None, lora: Any, deterministic: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qkv before its bias where prepare_qkv adds it, the residual stream, that bias or None) from the
        first norm of residual + src (src alone without a residual)."""
        a = self.arch
        lin = self.qkv
        if _gemv_fused(lin, src, lora, deterministic):
            # the norm in the GEMV's prologue; the bias joins prepare_qkv, as below
            qkv, h = norm_linear(src, residual, self.attn_norm, a.norm_eps, a.norm_float, lin.weight)
            return qkv, (src if h is None else h), lin.bias
        if residual is None:
            x, h = self.norm(src, "attn_norm"), src
        else:
            x, h = add_rms_norm(src, residual, self.attn_norm, a.norm_eps, a.norm_float)
        bias = None
        if (lora is None and type(lin) is DenseLinear and lin.bias is not None and backend(x.device) == "triton"
                and not deterministic and not (lin._forward_pre_hooks or lin._forward_hooks)):
            # the bias joins the fused kernel below: torch's matmul with a bias is two launches at one row
            # (not past a hook on the module: calibration watches its inputs; not in deterministic mode, whose
            # matmuls go 16 rows at a time)
            qkv, bias = F.linear(x, lin.weight), lin.bias
        else:
            qkv = _linear(lin, x, deterministic)
            if lora is not None:
                qkv = lora.apply(self.index, "qkv", x, qkv)
        return qkv, h, bias


def _gemv_fused(lin: nn.Module, x: torch.Tensor, lora: Any, deterministic: bool) -> bool:
    """Whether a dense linear runs as one Triton GEMV with its neighbours' work in it (`norm_linear`,
    `attention_linear`): the Triton path, at most `norm_gemv_rows()` rows, not in deterministic mode (a row's
    bits must not depend on the step's row count), no LoRA, no hook on the module (calibration watches inputs)."""
    return (0 < x.shape[0] <= norm_gemv_rows() and not deterministic and type(lin) is DenseLinear
            and lora is None and lin.weight.dtype == x.dtype and backend(x.device) == "triton"
            and not (lin._forward_pre_hooks or lin._forward_hooks))  # fmt: skip


def _fused_rotation(lin: nn.Module, x: torch.Tensor, lora: Any) -> tuple[torch.Tensor, int, torch.dtype] | None:
    """(signs, block, compute dtype) of a linear format's input rotation (`LinearFormat.input_rotation`) when the
    kernel that makes its input can apply it instead: the Triton path, no LoRA. Saves a launch a linear on a GPU."""
    rotation = getattr(lin, "input_rotation", None)
    if rotation is None or lora is not None or backend(x.device) != "triton":
        return None
    return rotation()


def _int4_gemv(lin: nn.Module, x: torch.Tensor, deterministic: bool) -> Int4Weight | None:
    """The int4 weight (kernels.fused.Int4Weight) of a rotated linear whose input kernel may run inside its GEMV
    (`norm_rotate_int4`, `gated_act_rotate_int4`): at most `norm_gemv_rows()` rows, not in deterministic mode;
    None otherwise. The caller has checked `_fused_rotation` (the Triton path, no LoRA, no hooks)."""
    if not 0 < x.shape[0] <= norm_gemv_rows() or deterministic:
        return None
    return lin.int4_weight()


class Transformer(nn.Module):
    """A decoder-only model built from canonical weights (see models/registry.py for the names)."""

    def __init__(self, arch: Arch, weights: Mapping[str, torch.Tensor | None], layers: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        n = arch.layers if layers is None else layers
        self.embed_weight = nn.Parameter(weights["embed"], requires_grad=False)  # type: ignore[arg-type]
        #: every layer attention and a dense MLP: the fused `Layer`, the C++ plan and the decode graphs run it;
        #: otherwise each layer is a `PartsLayer` on the reference path (the C++ plan runs its all-decode steps)
        self.plain = not (arch.hybrid or any(arch.moe_layers) or arch.attn_gate)

        def build(i: int) -> nn.Module:
            w = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
            return Layer(arch, i, w) if self.plain else PartsLayer(arch, i, w, DenseLinear)

        self.layers = nn.ModuleList(build(i) for i in range(n))
        #: each layer's index among the built layers of its mixer: its KV pages' layer, or its state's
        self.cache_index = [arch.mixers[:i].count(arch.mixers[i]) for i in range(n)]
        #: layers that keep KV pages, and delta-rule layers (a recurrent state per slot)
        self.kv_layers = arch.mixers[:n].count("attention")
        self.state_layers = n - self.kv_layers
        self.has_head = n == arch.layers and "norm" in weights
        if self.has_head:
            self.register_buffer("norm_weight", weights["norm"], persistent=False)
            head = weights["embed"] if arch.tied or weights.get("head") is None else weights["head"]
            self.head = DenseLinear(head)  # type: ignore[arg-type]
        #: the multi-token prediction block where the checkpoint has one and every layer is kept (models/mtp.py:
        #: `draft` computes its logits; the steps above never run it)
        self.mtp: nn.Module | None = None
        if self.has_head and arch.mtp and weights.get("mtp.fc") is not None:
            self.mtp = MTP(arch, weights, DenseLinear)
        self._inv_freq: dict[int, tuple[torch.Tensor, float]] = {}
        self._long_inv_freq: dict[int, torch.Tensor] = {}
        #: per rope key, (cos, sin) of every position below a power of two (CPU; `_rope_rows`)
        self._rope_rows_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kinds = sorted({self.rope_key(i) for i in range(n)})
        #: embeddings computed from tokens another way (quant.gguf_map.GGUFEmbedding reads the file's blocks)
        self.embed_rows: nn.Module | None = None
        #: run all-decode steps through the C++ plan where it is built (kernels/cpu_decode.py)
        self.fast_decode = True

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to() / .float() replace the tensors the C++ plan holds: build it again on next use
        self._decode_plan = None
        self._rope_rows_cache = {}  # tables in the old dtype
        return super()._apply(fn, recurse)

    def use_expert_cache(self, slots: int, device: torch.device | str) -> None:
        """Move the net to `device`, its mixtures of experts keeping `slots` experts each there and the others in
        host memory (models/expert_cache.py): a model whose experts do not fit in a GPU's memory. Call it on a net
        built on the CPU. InvalidArgument for a model without experts."""
        moes = [m for m in self.modules() if isinstance(m, MoE)]  # the MTP block's too
        if not moes:
            raise InvalidArgument("expert slots: the model has no mixture-of-experts layers")
        for mlp in moes:
            mlp.use_expert_cache(slots, device)
        self.to(device)

    def expert_cache(self) -> dict[str, Any]:
        """The expert caches' counts: slots (per block), hits, misses and the reads' ms, summed over the blocks
        (zeros where the experts are all on the device)."""
        caches = [m.expert_cache for m in self.modules() if isinstance(m, MoE) and m.expert_cache is not None]
        stats = [c.stats() for c in caches]
        return {"slots": stats[0]["slots"] if stats else 0, "blocks": len(stats),
                "hits": sum(s["hits"] for s in stats), "misses": sum(s["misses"] for s in stats),
                "read_ms": sum(s["read_ms"] for s in stats)}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def rope_key(self, layer: int) -> int:
        """Which rope table a layer reads: 0 the global rope, 1 the local (sliding-window) rope where the family
        has one, 2 none (NoPE layers: identity tables, cos 1 and sin 0, leave q and k exactly as they are on
        every path). The C++ decode plan reads it too."""
        if not self.arch.rope_layers[layer]:
            return 2
        return int(self.arch.windows[layer] is not None and self.arch.rope_local is not None)

    def _rope_tables(self, positions: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        a = self.arch
        out = {}
        for kind in self._kinds:
            if kind == 2:
                ones = torch.ones(positions.shape[0], a.rotary_dim, dtype=self.dtype, device=self.device)
                out[kind] = (ones, torch.zeros_like(ones))
                continue
            rope = a.rope_local if kind else a.rope
            assert rope is not None
            if rope.kind == "longrope":
                out[kind] = self._longrope_tables(kind, rope, positions)
                continue
            if rope.kind == "dynamic":
                # batch-invariant variant of HF's dynamic NTK: the base follows each row's own length
                tabs = [
                    rope_cos_sin(p[None], rope.dynamic_inv_freq(a.rotary_dim, int(p) + 1, a.context).to(self.device),
                                 1.0, self.dtype)
                    for p in positions
                ]
                out[kind] = (torch.cat([t[0] for t in tabs]), torch.cat([t[1] for t in tabs]))
                continue
            if kind not in self._inv_freq:
                inv, scale = rope.inv_freq(a.rotary_dim)
                self._inv_freq[kind] = (inv.to(self.device), scale)
            inv, scale = self._inv_freq[kind]
            out[kind] = self._rope_rows(kind, positions, inv, scale)
        return out

    #: the most positions `_rope_rows` keeps a table of (Gemma-3's two keys at 8192: 16 MB in bf16)
    ROPE_TABLE_ROWS = 8192

    def _rope_rows(self, kind: int, positions: torch.Tensor, inv: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_cos_sin(positions, ...) read from a table of every position below a power of two, computed by the
        same call: each row's values are its position's alone (elementwise ops; tests/test_rope.py holds the table's
        rows equal to one-position calls). A CPU decode step then indexes where it ran seven small ops a rope key.
        Past ROPE_TABLE_ROWS positions, and off the CPU (the largest position would cost a device sync), computed."""
        if self.device.type != "cpu" or positions.numel() == 0:
            return rope_cos_sin(positions, inv, scale, self.dtype)
        top = int(positions.max()) + 1
        if top > self.ROPE_TABLE_ROWS:
            return rope_cos_sin(positions, inv, scale, self.dtype)
        table = self._rope_rows_cache.get(kind)
        if table is None or table[0].shape[0] < top or table[0].dtype != self.dtype:
            rows = max(256, 1 << (top - 1).bit_length())
            table = self._rope_rows_cache[kind] = rope_cos_sin(torch.arange(rows), inv, scale, self.dtype)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def rope_table_list(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) at every rope key up to the largest a layer reads (the C++ plan indexes them by key)."""
        tables = self._rope_tables(positions)
        some = next(iter(tables.values()))  # keys no layer reads get any table
        return [tables.get(k, some) for k in range(max(tables) + 1)]

    def _longrope_tables(self, kind: int, rope: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LongRoPE per row: the short factors' table where the row's position + 1 is within the original
        context, the long factors' past it. transformers picks one table for a whole forward call by its
        longest position; the per-row rule is the same when tokens are fed one at a time, and keeps a row's
        bits independent of the rest of its step (a prompt fed whole across the boundary differs)."""
        if kind not in self._inv_freq:
            inv, scale = rope.inv_freq(self.arch.rotary_dim)
            self._inv_freq[kind] = (inv.to(self.device), scale)
            self._long_inv_freq[kind] = rope.long_inv_freq(self.arch.rotary_dim).to(self.device)
        short, scale = self._inv_freq[kind]
        cos, sin = rope_cos_sin(positions, short, scale, self.dtype)
        lcos, lsin = rope_cos_sin(positions, self._long_inv_freq[kind], scale, self.dtype)
        past = (positions + 1 > rope.original_context)[:, None]  # both tables always: no host sync in a graph
        return torch.where(past, lcos, cos), torch.where(past, lsin, sin)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> residual stream [N, dim]."""
        h = F.embedding(tokens, self.embed_weight) if self.embed_rows is None else self.embed_rows(tokens)
        if self.arch.embed_scale != 1.0:
            h = h * torch.tensor(self.arch.embed_scale, dtype=h.dtype)
        return h

    def run_layers(
        self,
        h: torch.Tensor,
        meta: AttnMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int = 0,
        end: int | None = None,
        plan: bool | None = None,
        states: Any = None,
    ) -> torch.Tensor:
        """Layers start..end-1 on the residual stream h [N, dim]; k_cache/v_cache are [kv_layers, slots, kv, D].
        `plan`: whether the C++ plan runs them, as the caller chose for the step (`plan_step`; None: chosen here).
        `states`: the delta-rule layers' cache.state.RecurrentStates (rows meta.state_slots), where there are any."""
        end = len(self.layers) if end is None else end
        positions = meta.positions
        use_plan = self.plan_step(h, meta, k_cache) if plan is None else plan
        if use_plan and (states is not None or not self.state_layers):
            # all layers in one C++ call (kernels/cpu_decode.py): all-decode steps, or every step in
            # deterministic mode, where its per-row arithmetic makes each row batch-invariant (parts layers:
            # all-decode steps of the default mode, `_parts_plan`)
            tabs = self.rope_table_list(positions)
            key_slots, row_seq, lens = row_key_slots(meta, h.device)
            return decode_layers(self, h, meta.slot_mapping, key_slots, row_seq, lens, tabs, k_cache, v_cache, start,
                                 end, meta.deterministic, meta.lora, states, meta.state_slots)
        if not self.plain:
            return self._run_parts(h, meta, k_cache, v_cache, start, end, states)
        if meta.deterministic and self.row_multiple > 1:
            # fixed-shape matmuls: every row gets the same bits wherever it sits in the step
            h, positions = pad_rows(h, BLOCK), pad_rows(positions, BLOCK)
        tables = self._rope_tables(positions)
        y = None
        for i in range(start, end):
            h, y = self.layers[i](h, meta, tables[self.rope_key(i)], k_cache[i], v_cache[i], y)
        return h if y is None else h + y

    def _run_parts(self, h: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   start: int, end: int, states: Any) -> torch.Tensor:
        """Layers of parts, the reference executor: each gets its KV pages or its recurrent states."""
        if self.state_layers and (states is None or len(meta.state_slots) != meta.num_seqs):
            raise TypeError("delta-rule layers need the recurrent states and a state slot per sequence")
        positions = meta.positions
        if meta.deterministic and self.row_multiple > 1:
            h, positions = pad_rows(h, BLOCK), pad_rows(positions, BLOCK)
        tables = self._rope_tables(positions)
        y = None
        for i in range(start, end):
            j = self.cache_index[i]
            caches = (k_cache[j], v_cache[j]) if self.arch.mixers[i] == "attention" else (states.conv[j], states.ssm[j])
            h, y = self.layers[i](h, meta, tables[self.rope_key(i)], *caches, y)
        return h if y is None else h + y

    def plan_step(self, h: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor, drafting: bool = False) -> bool:
        """Whether this step runs through the C++ plan (LoRA deltas included): on the CPU; every step in
        deterministic mode, else all-decode steps and prompt chunks where it is faster (`_plan_pays`).
        `drafting`: every chunk is a decode row and its drafts (engine/speculative.py), a few rows that the plan
        computes as it computes decode rows (the SDPA path reads int4 weights slower: SmolLM2 at 5 rows 41 ms in
        the plan, 71 ms there)."""
        if h.device.type != "cpu" or not self.fast_decode:
            return False
        if not self.plain and not self._parts_plan(meta, drafting):
            return False
        if backend(h.device) != "torch":
            return False  # the Triton kernels were asked for (SUPERSLM_KERNELS=triton: the interpreter's tests)
        if h.shape[0] != meta.query_start[-1]:
            return False  # rows padded by a caller
        if not meta.deterministic and not drafting and not self._plan_pays(meta):
            return False  # prompt chunks whose attention the C++ rows would compute slower than SDPA
        return cpu_decode.usable(self, h, k_cache)

    def _parts_plan(self, meta: AttnMetadata, drafting: bool) -> bool:
        """Whether the plan may run this step of parts layers (gated attention, delta rules, experts): one decode
        row of each sequence in the default mode, each with its own state row. Deterministic mode keeps the layers
        (their batch-invariant linears and attention are not the plan's bits), as do drafts (a drafting sequence's
        rows step its states one at a time, keeping each in a scratch row) and adapters."""
        if meta.deterministic or drafting or meta.state_drafts or meta.lora is not None:
            return False
        if self.state_layers and (len(meta.state_slots) != meta.num_seqs or min(meta.state_slots, default=0) < 0):
            return False
        return meta.step_cache("all_decode", lambda: all(b - a == 1 for a, b in zip(meta.query_start,
                                                                                  meta.query_start[1:])))

    def _plan_pays(self, meta: AttnMetadata) -> bool:
        """Whether the default mode runs this step in the C++ plan: every all-decode step, and prompt chunks
        cut by a sliding window (SDPA's masked path computes every key of such a chunk, where the plan's rows
        visit only their window: Gemma-3 prefill of 2048 tokens 517 -> 1037 tok/s). Other prompt chunks keep
        SDPA: a 512-token SmolLM2 prompt runs 10% faster in the plan, but its different roundings move the
        default model's greedy answers (one bf16 ulp between the first two logits of the docs' example)."""
        qs = meta.query_start
        rows = [(qs[s + 1] - qs[s], meta.seq_lens[s]) for s in range(len(qs) - 1)]
        if all(q == 1 for q, _ in rows):
            return True
        return any(q > 1 and w is not None and n > w for q, n in rows for w in self.arch.windows)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm_weight, self.arch.norm_eps, self.arch.norm_float)

    @property
    def row_multiple(self) -> int:
        """16 when some linear may round a row differently with another row count, else 1."""
        linears = [m for layer in self.layers for m in layer.modules() if hasattr(m, "row_invariant")]
        if self.has_head:
            linears.append(self.head)
        return 1 if all(getattr(m, "row_invariant", False) for m in linears) else BLOCK

    def _head_input(self, h: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """final_norm(h), padded to BLOCK rows in deterministic mode where a linear rounds by row count."""
        if deterministic and self.row_multiple > 1:
            h = pad_rows(h, BLOCK)
        return self.final_norm(h)

    def logits(self, h: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Residual rows [n, dim] -> logits [n, vocab] in float32."""
        n = h.shape[0]
        if _gemv_fused(self.head, h, None, deterministic) and self.head.bias is None:
            # the final norm in the head's GEMV: one launch
            return norm_linear(h, None, self.norm_weight, self.arch.norm_eps, self.arch.norm_float,
                               self.head.weight)[0].float()  # fmt: skip
        x = self._head_input(h, deterministic)
        # the VNNI int8 kernels: one row at memory speed; in deterministic mode every row count, so a
        # row's logits do not depend on its batch (kernels/cpu/gemm.cpp)
        y = cpu_decode.vnni_linear(self.head, x[:n], deterministic)
        if y is not None:
            return y.float()
        return _linear(self.head, x, deterministic)[:n].float()

    def greedy_tokens(self, h: torch.Tensor, deterministic: bool = False) -> torch.Tensor | None:
        """Residual rows [n, dim] -> each row's argmax token (int64 [n], first index on ties) where the head
        can certify it without all the logits (an int8 head: cpu_decode.greedy_head), else None.
        The tokens are those of the int8 kernels' logits (from 4 rows): on the VNNI kernels `logits` itself in
        deterministic mode, while the default mode's `logits` may run torch's kernel (CPUs with AVX512-BF16,
        `gemm_rows`), whose roundings may break a tie within one bf16 ulp the other way; on the AVX2 kernels
        (default mode, up to `avx2_gemm_rows` rows) `logits` itself."""
        if not self.has_head:
            return None
        return cpu_decode.greedy_head(self.head, self._head_input(h, deterministic)[: h.shape[0]], deterministic)
