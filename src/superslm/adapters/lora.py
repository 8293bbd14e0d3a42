"""LoRA adapters (PEFT folders) applied at run time, per request, with grouped low-rank matmuls.

A PEFT adapter holds, per adapted linear, A [r, in] and B [out, r]; the linear computes
W x + scale * B (A x) with scale = alpha / r (alpha / sqrt(r) with rsLoRA). Our forward pass fuses
q, k, v into one linear and gate, up into another, so an adapter keeps per fused linear one A (the
parts' A stacked) and one block-diagonal B (scale folded in); a step's rows are grouped by adapter and
each group adds its delta to its own rows only.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from superslm.errors import AdapterInUse, AdapterMismatch, FormatError, ModelNotFound, UnsupportedModel
from superslm.kernels.row_blocks import by_row_blocks
from superslm.models.arch import Arch

#: our fused linears and the HF module names of their parts, in row order
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@dataclass(eq=False)
class Adapter:
    """A LoRA adapter mapped onto one model: per (layer, fused linear) the stacked A and scaled B."""

    name: str
    rank: int
    scale: float
    #: (layer, "qkv" | "o" | "gate_up" | "down") -> (A [k*r, in], B [out, k*r]): the k parts' stacked A and
    #: block-diagonal B, or a fused module's own A [r, in] and B [out, r]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    model_fingerprint: str
    #: the merged-weight view for tests and `convert --lora`: canonical name -> delta [out, in]
    users: set[int] = field(default_factory=set)
    unmapped: bool = False

    @property
    def fingerprint(self) -> str:
        """sha256 of the adapter's name, rank, scale and weights: how a saved request names its adapter in another
        process, and the prefix cache's key of the pages computed with it."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"{self.name}|{self.rank}|{self.scale}|{self.model_fingerprint}".encode())
            for key in sorted(self.weights):
                h.update(repr(key).encode())
                for t in self.weights[key]:
                    h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    _fingerprint: str | None = field(default=None, repr=False)

    def delta(self, layer: int, part: str) -> torch.Tensor | None:
        """scale * B A [out_part, in] of one canonical linear (q, k, v, o, gate, up, down), for merging."""
        for fused, parts in FUSED.items():
            if part in parts and (layer, fused) in self.weights:
                a, b = self.weights[(layer, fused)]
                full = (b.float() @ a.float())  # [out_fused, in]
                sizes = self._sizes[(layer, fused)]
                start = sum(sizes[: parts.index(part)])
                return full[start : start + sizes[parts.index(part)]]
        return None

    _sizes: dict[tuple[int, str], list[int]] = field(default_factory=dict, repr=False)

    def plan_weights(self, layers: int) -> list[torch.Tensor | None]:
        """(A, B) of each layer's qkv, o, gate_up, down in turn (None, None where not adapted) in float32: the C++
        plan's operands (kernels/cpu_decode.py), built once."""
        if self._plan is None or len(self._plan) != layers * 8:
            self._plan = [None if t is None else t.float().contiguous() for i in range(layers) for fused in FUSED
                          for t in self.weights.get((i, fused), (None, None))]  # fmt: skip
        return self._plan

    _plan: list[torch.Tensor | None] | None = field(default=None, repr=False)

    def unmap(self) -> None:
        """Release the adapter; refused while live requests use it."""
        if self.users:
            raise AdapterInUse(f"adapter {self.name!r} is used by {len(self.users)} live request(s)")
        self.unmapped = True
        self.weights = {}
        self._plan = None


def _part_shapes(arch: Arch) -> dict[str, tuple[int, int]]:
    """[out, in] of every linear an adapter may target: the canonical parts, and the fused qkv and gate_up that
    checkpoints such as Phi-3 store (and PEFT then adapts) as one module."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    return {"q": (q, arch.dim), "k": (kv, arch.dim), "v": (kv, arch.dim), "o": (arch.dim, q),
            "gate": (arch.ffn, arch.dim), "up": (arch.ffn, arch.dim), "down": (arch.dim, arch.ffn),
            "qkv": (q + 2 * kv, arch.dim), "gate_up": (2 * arch.ffn, arch.dim)}


def load_peft(folder: str | Path, arch: Arch, hf_layer_names: dict[str, str], fingerprint: str,
              dtype: torch.dtype, device: torch.device) -> Adapter:
    """Map a PEFT LoRA folder onto a model of `arch`; refuses what does not fit (AdapterMismatch). Its targets are
    the checkpoint's modules: the seven projections, or the fused qkv_proj / gate_up_proj where the checkpoint
    stores them fused (Phi-3), adapted as one."""
    from safetensors import safe_open

    if arch.hybrid or arch.attn_gate or any(arch.moe_layers):
        raise UnsupportedModel(f"LoRA adapters on {arch.family} (gated attention, delta-rule or expert layers) are "
                               "not supported yet")
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError as e:
        raise ModelNotFound(f"{folder}: no adapter_config.json") from e
    except ValueError as e:
        raise FormatError(f"{folder}/adapter_config.json is not valid JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModel(f"adapter type {cfg.get('peft_type')!r} is not supported (LoRA only)")
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise UnsupportedModel(f"adapter option {key} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise UnsupportedModel("adapters with per-module rank_pattern/alpha_pattern are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise UnsupportedModel("adapters with biases or modules_to_save are not supported")
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    path = folder / "adapter_model.safetensors"
    if not path.exists():
        raise ModelNotFound(f"{folder}: no adapter_model.safetensors")
    module_of = {v.rsplit(".", 1)[0]: k for k, v in hf_layer_names.items() if k in _part_shapes(arch)}
    shapes = _part_shapes(arch)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            # base_model.model.model.layers.{i}.{module}.lora_{A|B}.weight
            head, _, tail = name.partition(".layers.")
            idx, _, rest = tail.partition(".")
            module, _, which = rest.rpartition(".lora_")
            part = module_of.get(module)
            if not tail or not idx.isdigit() or part is None or which not in ("A.weight", "B.weight"):
                raise AdapterMismatch(f"adapter tensor {name} does not map onto this model")
            layer = int(idx)
            if layer >= arch.layers:
                raise AdapterMismatch(f"adapter tensor {name}: the model has {arch.layers} layers")
            t = f.get_tensor(name).float()
            out, inp = shapes[part]
            want = (r, inp) if which[0] == "A" else (out, r)
            if tuple(t.shape) != want:
                raise AdapterMismatch(f"adapter tensor {name} has shape {tuple(t.shape)}, the model needs {want}")
            parts.setdefault((layer, part), {})[which[0]] = t
    adapter = Adapter(folder.name, r, scale, {}, fingerprint)
    for layer in range(arch.layers):
        for fused, names in FUSED.items():
            present = [p for p in names if (layer, p) in parts]
            whole = parts.get((layer, fused)) if len(names) > 1 else None
            if whole is not None:
                # the checkpoint's fused module adapted as one: its A and B are the fused linear's as they are
                if present or "A" not in whole or "B" not in whole:
                    raise AdapterMismatch(f"layer {layer} {fused}: lora_A and lora_B of the fused module only")
                adapter.weights[(layer, fused)] = (whole["A"].to(device, dtype), (whole["B"] * scale).to(device, dtype))
                adapter._sizes[(layer, fused)] = [shapes[p][0] for p in names]
                continue
            if not present:
                continue
            a_list, b_blocks = [], []
            for p in names:
                out, inp = shapes[p]
                ab = parts.get((layer, p))
                if ab is None or "A" not in ab or "B" not in ab:
                    if ab is not None:
                        raise AdapterMismatch(f"layer {layer} {p}: lora_A and lora_B must come together")
                    a_list.append(torch.zeros(r, inp))
                    b_blocks.append(torch.zeros(out, r))
                else:
                    a_list.append(ab["A"])
                    b_blocks.append(ab["B"] * scale)
            a = torch.cat(a_list)  # [k*r, in]
            b = torch.block_diag(*b_blocks)  # [out_fused, k*r]
            adapter.weights[(layer, fused)] = (a.to(device, dtype), b.to(device, dtype))
            adapter._sizes[(layer, fused)] = [shapes[p][0] for p in names]
    if not adapter.weights:
        raise AdapterMismatch(f"{folder}: the adapter adapts none of the model's linears")
    return adapter


@dataclass
class LoraBatch:
    """The adapters of a step's rows: (adapter, row indices) groups; rows without one are absent."""

    groups: list[tuple[Adapter, torch.Tensor]]
    #: deterministic mode: each group's low-rank matmuls take 16 rows at a time (kernels/row_blocks.py)
    deterministic: bool = False

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each group's low-rank delta on its own rows (x [N, in], y [N, out])."""
        for adapter, rows in self.groups:
            w = adapter.weights.get((layer, fused))
            if w is None:
                continue
            a, b = w
            xr = x.index_select(0, rows)
            low_rank = _LowRank(a, b)
            delta = by_row_blocks(low_rank, xr) if self.deterministic else low_rank(xr)
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y


@dataclass
class _LowRank:
    """x -> (x A^T) B^T: a LoRA delta."""

    a: torch.Tensor
    b: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.T) @ self.b.T


def group_rows(adapters: Sequence[Adapter | None], device: torch.device) -> list[tuple[Adapter, torch.Tensor]]:
    """Row indices per adapter, in first-appearance order."""
    order: dict[int, tuple[Adapter, list[int]]] = {}
    for i, a in enumerate(adapters):
        if a is not None:
            order.setdefault(id(a), (a, []))[1].append(i)
    return [(a, torch.tensor(rows, dtype=torch.long, device=device)) for a, rows in order.values()]
