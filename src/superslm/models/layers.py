"""Layers built from their parts: gated attention, the gated delta rule, a mixture of experts.

`PartsLayer` is the straight-line reference forward of any layer the fused `transformer.Layer` does not run
(Qwen3.5, Qwen3-Next, Qwen3-MoE): norm, mixer, residual add, norm, MLP. Its mixer's cache is the layer's
KV pages (attention) or the slots' recurrent states (a delta rule: `cache.state.RecurrentStates` rows), so
the transformer hands each layer the two tensors of its own kind. The decode graphs do not run these parts
(`Transformer.plain` is False); the C++ plan runs their all-decode steps of the default mode (kernels/cpu_hybrid.py
describes them to it; `Transformer._parts_plan` decides). The steps it does not take run here, their pieces in
C++ calls of their own on the CPU: a delta rule's decode glue (kernels/delta_rule.py decode_step), a MoE block's
decode rows (kernels/moe_step.py), decode rows' linears (kernels/cpu_decode.py rows_linear).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from superslm.kernels import cpu_decode, cpu_prompt, delta_rule, moe_step
from superslm.kernels.attention import AttnMetadata, QKVSpec
from superslm.kernels.dispatch import add_rms_norm, gated_act, prepare_attention, rms_norm
from superslm.kernels.row_blocks import by_row_blocks
from superslm.models.arch import Arch
from superslm.models.expert_cache import CachedExperts, ExpertCache
from superslm.models.parts import DELTA_LAYOUTS, stack


def _linear(lin: nn.Module, x: torch.Tensor, deterministic: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """lin(x), or lin.forward_rotated(x, dtype) for an input already rotated; one row of the default mode on the
    CPU through the C++ plan's kernels where they take lin; in deterministic mode a linear whose BLAS rounds a row
    by the row count multiplies 16 rows at a time (kernels/row_blocks.py)."""
    def fn(rows: torch.Tensor) -> torch.Tensor:
        return lin(rows) if dtype is None else lin.forward_rotated(rows, dtype)

    if not deterministic and dtype is None and x.shape[0] < cpu_prompt.PROMPT_ROWS:
        y = cpu_decode.rows_linear(lin, x)  # decode rows on the plan's kernels (the plan runs no such layer)
        if y is not None:
            return y
    if not deterministic and x.shape[0] >= cpu_prompt.PROMPT_ROWS:
        y = cpu_prompt.prompt_linear(lin, x, dtype)  # a prompt chunk: decoded weight blocks, float32 GEMMs
        if y is not None:
            return y
    if not deterministic or getattr(lin, "row_invariant", False):
        return fn(x)
    blocks = getattr(lin, "forward_row_blocks", None)  # the formats: one call where their kernel tiles rows
    return by_row_blocks(fn, x) if blocks is None else blocks(x, dtype)


class GatedAttention(nn.Module):
    """Attention over the paged cache (q/k norms, partial rotary positions), its output times sigmoid(gate)
    where the Arch has the gate (q's linear gives each head its query, then its gate) before o."""

    #: the linears a weight format may replace
    linear_names = ("qkv", "o")

    def __init__(self, arch: Arch, index: int, w: Mapping[str, torch.Tensor | None], linear: type[nn.Module]) -> None:
        super().__init__()
        a = self.arch = arch
        self.window = arch.windows[index]
        # one matmul; with the gate, q's rows stay as stored (each head's query, then its gate) so a file's
        # quantized blocks serve as they are
        self.qkv = linear(torch.cat([w["q"], w["k"], w["v"]]))  # type: ignore[list-item]
        self.o = linear(w["o"])
        for n in ("q_norm", "k_norm"):
            if a.qk_norm:
                self.register_buffer(n, w[n], persistent=False)

    def forward(self, x: torch.Tensor, meta: AttnMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        a = self.arch
        n = x.shape[0]
        out = _linear(self.qkv, x, meta.deterministic)
        if a.attn_gate:
            q_rows = 2 * a.heads * a.head_dim
            heads = out[:, :q_rows].reshape(n, a.heads, 2, a.head_dim)  # [N, heads, (query, gate), D]
            gate = heads[:, :, 1].reshape(n, -1)
            qkv = torch.cat([heads[:, :, 0].reshape(n, -1), out[:, q_rows:]], dim=1)
        else:
            qkv = out.contiguous()
        norms = (self.q_norm, self.k_norm) if a.qk_norm else (None, None)
        spec = QKVSpec(a.heads, a.kv_heads, None, *norms, a.norm_eps, a.norm_float, self.window, a.attn_scale)
        o_in = prepare_attention(qkv, spec, *cos_sin, k_cache, v_cache, meta).reshape(n, a.heads * a.head_dim)
        if a.attn_gate:
            o_in = o_in * torch.sigmoid(gate)
        return _linear(self.o, o_in, meta.deterministic)


class DeltaRule(nn.Module):
    """A gated delta-rule layer over each sequence's recurrent state (kernels/delta_rule.py): the input
    projection, the causal convolution of q, k and v, the delta rule (chunked for prompt rows, recurrent for
    decode rows, all decode rows of a step at once, and a drafting sequence's rows one at a time with the states
    after each kept for verification), the gated norm and the output projection."""

    linear_names = ("in_proj", "out")

    def __init__(self, arch: Arch, w: Mapping[str, torch.Tensor | None], linear: type[nn.Module]) -> None:
        super().__init__()
        self.arch, d = arch, arch.delta
        assert d is not None
        self.dims = d
        names = next(n for n in DELTA_LAYOUTS.values() if all(w.get(k) is not None for k in n))
        self.in_proj = linear(stack(w, names))
        self.out = linear(w["out"])
        for n in ("conv", "dt_bias", "a_log", "delta_norm"):
            self.register_buffer(n, w[n], persistent=False)

    def forward(self, x: torch.Tensor, meta: AttnMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor],
                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N, dim]; conv_state [slots, C, taps - 1] and ssm_state [slots, Hv, Dk, Dv] hold each
        sequence's state (meta.state_slots), read and written here; a sequence at position 0 starts from zeros.
        A sequence with drafts (meta.state_drafts) steps its rows one at a time, as plain decoding would, and
        leaves the states after each but its last in its scratch rows (its own row ends after its last)."""
        d, n = self.dims, x.shape[0]
        proj = _linear(self.in_proj, x, meta.deterministic)
        mixed, z, b, a = torch.split(proj, [d.conv_width, d.value_width, d.v_heads, d.v_heads], dim=1)
        beta = torch.sigmoid(b)
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [N, Hv] log decay
        normed = torch.empty(n, d.value_width, dtype=x.dtype, device=x.device)
        qs, lens, slots, drafts = meta.query_start, meta.seq_lens, meta.state_slots, meta.state_drafts
        decode: list[int] = []
        for s in range(meta.num_seqs):
            r0, r1 = qs[s], qs[s + 1]
            if r1 == r0:
                continue
            if lens[s] == r1 - r0:  # the sequence starts in this step: its state starts from zeros
                conv_state[slots[s]].zero_()
                ssm_state[slots[s]].zero_()
            if r1 - r0 == 1 or (drafts and drafts[s]):
                decode.append(s)
                continue
            if meta.deterministic:
                # token by token through the decode step: a row's state gets the same arithmetic however its
                # prompt was chunked (the chunked form's roundings depend on where its chunks start); on the
                # Triton backend one call whose kernels walk the rows with the step's arithmetic
                rows = delta_rule.prompt_rows(mixed[r0:r1], z[r0:r1], g[r0:r1], beta[r0:r1], self.conv, conv_state,
                                              ssm_state, slots[s], self.delta_norm, self.arch.norm_eps, d.k_heads,
                                              d.k_dim, d.v_heads, d.v_dim)
                if rows is not None:
                    normed[r0:r1] = rows
                    continue
                for t in range(r0, r1):
                    normed[t : t + 1] = self._step(mixed[t : t + 1], z[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                                   conv_state, ssm_state, [slots[s]])
                continue
            y, conv_state[slots[s]] = delta_rule.causal_conv(mixed[r0:r1], self.conv, conv_state[slots[s]])
            q, k, v = self._heads(y)
            core, ssm_state[slots[s]] = delta_rule.chunked(q, k, v, g[r0:r1], beta[r0:r1], ssm_state[slots[s]])
            gate = z[r0:r1].reshape(r1 - r0, d.v_heads, d.v_dim)
            normed[r0:r1] = delta_rule.gated_rms_norm(core.to(x.dtype), gate, self.delta_norm,
                                                      self.arch.norm_eps).reshape(r1 - r0, d.value_width)
        if len(decode) == n:  # a step of decode rows only: their rows as they are, no gather
            normed = self._step(mixed, z, g, beta, conv_state, ssm_state, [slots[s] for s in decode])
        elif drafts:
            self._walk(decode, meta, normed, (mixed, z, g, beta), conv_state, ssm_state)
        elif decode:
            rows = torch.tensor([qs[s] for s in decode], device=x.device)
            normed[rows] = self._step(mixed[rows], z[rows], g[rows], beta[rows], conv_state, ssm_state,
                                      [slots[s] for s in decode])
        return _linear(self.out, normed, meta.deterministic)

    def _walk(self, seqs: list[int], meta: AttnMetadata, normed: torch.Tensor, rows: tuple[torch.Tensor, ...],
              conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """The rows of sequences `seqs` (decode rows, some followed by drafts) into `normed`, row j of every
        sequence that has one in one recurrent step (each row's bits its own, as in plain decoding), then the
        states after row j copied to the scratch row `meta.state_drafts[s][j]` of each sequence with a row after
        it: verification keeps the one after the last accepted row."""
        qs, slots, drafts = meta.query_start, meta.state_slots, meta.state_drafts
        for j in range(max(qs[s + 1] - qs[s] for s in seqs)):
            now = [s for s in seqs if qs[s] + j < qs[s + 1]]
            idx = torch.tensor([qs[s] + j for s in now], device=normed.device)
            mixed, z, g, beta = (t.index_select(0, idx) for t in rows)
            normed[idx] = self._step(mixed, z, g, beta, conv_state, ssm_state, [slots[s] for s in now])
            kept = [(slots[s], drafts[s][j]) for s in now if j < len(drafts[s])]
            if kept:
                src = torch.tensor([r for r, _ in kept], device=conv_state.device)
                dst = torch.tensor([r for _, r in kept], device=conv_state.device)
                conv_state[dst] = conv_state[src]
                ssm_state[dst] = ssm_state[src]

    def _step(self, mixed: torch.Tensor, z: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              conv_state: torch.Tensor, ssm_state: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """One new row of each sequence at state rows `ids` -> its gated norm's output [B, value_width]
        (kernels/delta_rule.py decode_step: one C++ call on the CPU)."""
        d = self.dims
        return delta_rule.decode_step(mixed, z, g, beta, self.conv, conv_state, ssm_state, ids, self.delta_norm,
                                      self.arch.norm_eps, d.k_heads, d.k_dim, d.v_heads, d.v_dim)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved rows [T, C] -> q, k [T, Hk, Dk] normalized, v [T, Hv, Dv]."""
        d, t = self.dims, y.shape[0]
        q, k, v = torch.split(y, [d.key_width, d.key_width, d.value_width], dim=1)
        q, k = delta_rule.normalize_qk(q.reshape(t, d.k_heads, d.k_dim), k.reshape(t, d.k_heads, d.k_dim))
        return q, k, v.reshape(t, d.v_heads, d.v_dim)


class DenseMLP(nn.Module):
    """act(gate) * up, then down."""

    linear_names = ("gate_up", "down")

    def __init__(self, arch: Arch, gate_up: torch.Tensor, down: torch.Tensor, linear: type[nn.Module]) -> None:
        super().__init__()
        self.act = arch.act
        self.gate_up, self.down = linear(gate_up), linear(down)

    def forward(self, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return _linear(self.down, gated_act(_linear(self.gate_up, x, deterministic), self.act), deterministic)


class MoE(nn.Module):
    """A mixture of experts: the router's softmax, each token's top k experts (weights renormalized where the
    Arch says so), tokens grouped by expert so each expert's weights are read once a step; a shared expert
    scaled by sigmoid(shared_scale x) where there is one. `tokens_per_expert` counts what the router chose.
    Each expert is a DenseMLP, so a weight format swaps its linears like any other (int8 or int4 experts); the
    router and the shared expert's gate stay dense (a token's choice of experts should not move with a format's
    rounding)."""

    linear_names = ()

    def __init__(self, arch: Arch, w: Mapping[str, torch.Tensor | None], linear: type[nn.Module]) -> None:
        super().__init__()
        e = self.experts = arch.experts
        assert e is not None
        self.act = arch.act
        self.router = linear(w["router"])
        gate_up, down = w["experts_gate_up"], w["experts_down"]
        assert gate_up is not None and down is not None
        # an empty [0, in] placeholder: the experts come from the file's blocks after (quant/swap.py)
        self.experts_mlp = nn.ModuleList(
            DenseMLP(arch, gate_up[i] if gate_up.dim() == 3 else gate_up, down[i] if down.dim() == 3 else down, linear)
            for i in range(e.count)
        )
        self.shared = None
        if e.shared_ffn:
            self.shared = DenseMLP(arch, stack(w, ("shared_gate", "shared_up")), w["shared_down"], linear)  # type: ignore[arg-type]
            self.shared_scale = linear(w["shared_scale"])
        self.tokens_per_expert = torch.zeros(e.count, dtype=torch.long)
        self._parts: tuple[list[nn.Module | None], moe_step.MoEParts] | None = None
        #: the experts' slots on the device where they do not all fit there (`use_expert_cache`), else None
        self.expert_cache: ExpertCache | None = None

    def use_expert_cache(self, slots: int, device: torch.device | str) -> None:
        """Keep `slots` experts on `device` and the others in host memory, read in when the router picks them
        (models/expert_cache.py). The block then runs its experts one at a time in torch ops (the C++ step and
        plan, which hold every expert's tensors, decline it)."""
        cache = ExpertCache(list(self.experts_mlp), slots, device)
        del self.experts_mlp
        self.expert_slots = nn.ModuleList(cache.slots)
        self.expert_cache, self._parts = cache, None

    def forward(self, x: torch.Tensor, deterministic: bool, decode: bool = False) -> torch.Tensor:
        """x [N, dim] -> [N, dim]. `decode`: every row is a sequence's decode row; in the default mode the CPU then
        runs the block in one C++ call (kernels/moe_step.py) where it takes the experts' linears."""
        parts = self.moe_parts()
        if decode and not deterministic and self.expert_cache is None:
            y = moe_step.run(x, parts, self.tokens_per_expert)
            if y is not None:
                return y
        # the torch ops of kernels/moe_step.py's twin, each linear as this mode runs it
        return moe_step.moe_reference(x, parts, self.tokens_per_expert,
                                      lambda module, rows: _linear(module, rows, deterministic))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .to() / .float(): the parts and the kernel's step hold the tensors they were built from
        self._parts = None
        return super()._apply(fn, recurse)

    def moe_parts(self) -> moe_step.MoEParts:
        """This block as kernels/moe_step.py takes it, built once and again when a linear was swapped (quant.swap
        replaces the experts' placeholders after construction); read from _modules (nn.Module's __getattr__ per
        expert would cost more than the check)."""
        experts = self._modules["expert_slots" if self.expert_cache is not None else "experts_mlp"]
        mlps = [*experts._modules.values(), *([] if self.shared is None else [self.shared])]  # type: ignore[union-attr]
        mods: list[nn.Module | None] = [self._modules["router"], self._modules.get("shared_scale")]
        for mlp in mlps:
            mods += mlp._modules.values()  # type: ignore[union-attr]
        cached = self._parts
        if cached is not None and len(cached[0]) == len(mods) and all(a is b for a, b in zip(cached[0], mods)):
            return cached[1]
        e = self.experts
        assert e is not None
        cache = self.expert_cache
        pairs: Sequence[tuple[nn.Module, nn.Module]] = [(m.gate_up, m.down) for m in self.experts_mlp] \
            if cache is None else CachedExperts(cache)  # type: ignore[union-attr]
        shared = None if self.shared is None else (self.shared.gate_up, self.shared.down)
        parts = moe_step.MoEParts(self.router, pairs, e.top_k, e.norm_top_k, self.act, shared,
                                  None if self.shared is None else self.shared_scale,
                                  watch=tuple(self.modules())[1:], step=None if cache is None else False)
        self._parts = (mods, parts)
        return parts


class PartsLayer(nn.Module):
    """One layer from its parts: x + mixer(norm(x)), then that plus mlp(norm(...)), as `transformer.Layer`'s
    (h, y) pair: the stream after the layer is h + y, which the next layer adds in its first norm."""

    #: the decode graphs do not run these parts (Transformer.plain); the C++ plan runs their all-decode steps
    plain = False

    def __init__(self, arch: Arch, index: int, w: Mapping[str, torch.Tensor | None], linear: type[nn.Module]) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        self.kind = arch.mixers[index]
        self.mixer: nn.Module = (DeltaRule(arch, w, linear) if self.kind == "delta"
                                 else GatedAttention(arch, index, w, linear))
        if arch.moe_layers[index]:
            self.mlp: nn.Module = MoE(arch, w, linear)
        else:
            self.mlp = DenseMLP(arch, stack(w, ("gate", "up")), w["down"], linear)  # type: ignore[arg-type]
        self.register_buffer("attn_norm", w["attn_norm"], persistent=False)
        self.register_buffer("ffn_norm", w["ffn_norm"], persistent=False)

    def linears(self) -> list[tuple[nn.Module, str, str]]:
        """(parent module, attribute, name within the layer) of each linear a weight format may replace."""
        out = []
        for prefix, m in self.named_modules():
            for attr in getattr(m, "linear_names", ()):
                out.append((m, attr, f"{prefix}.{attr}" if prefix else attr))
        return out

    def forward(
        self,
        h: torch.Tensor,
        meta: AttnMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache_a: torch.Tensor,
        cache_b: torch.Tensor,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, y) for h [N, dim]; cache_a, cache_b: this layer's K and V pages, or its conv and delta states."""
        a = self.arch
        if pending is None:
            x = rms_norm(h, self.attn_norm, a.norm_eps, a.norm_float)
        else:
            x, h = add_rms_norm(pending, h, self.attn_norm, a.norm_eps, a.norm_float)
        mixed = self.mixer(x, meta, cos_sin, cache_a, cache_b)
        x, h = add_rms_norm(mixed, h, self.ffn_norm, a.norm_eps, a.norm_float)
        if isinstance(self.mlp, MoE):
            return h, self.mlp(x, meta.deterministic, _all_decode(meta, x.shape[0]))
        return h, self.mlp(x, meta.deterministic)


def _all_decode(meta: AttnMetadata, rows: int) -> bool:
    """Whether the step's rows are one decode row of each sequence, unpadded (once per step)."""
    return rows == meta.num_seqs and meta.step_cache(
        "all_decode", lambda: all(b - a == 1 for a, b in zip(meta.query_start, meta.query_start[1:])))
