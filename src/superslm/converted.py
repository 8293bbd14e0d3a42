"""Loading a folder written by `superslm convert`: its linears built from their stored formats.

No re-quantization: int4 comes back in its packed layout (a memory map), other formats from their state;
off the CPU the formats that run there keep their form (the dispatcher's kernels), the others become dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.errors import FormatError, InvalidArgument
from superslm.models.arch import Arch
from superslm.models.layers import PartsLayer
from superslm.models.loader import Source
from superslm.models.parts import LINEAR_NAMES, LayerParts, LinearSpec, mtp_arch
from superslm.models.transformer import DenseLinear, Transformer
from superslm.quant import ConcatLinear, LinearFormat
from superslm.quant.stored import linear_from_state


def _bias_of(module: LinearFormat) -> torch.Tensor | None:
    if isinstance(module, ConcatLinear):
        parts = [_bias_of(p) for p in module.parts]  # type: ignore[arg-type]
        if all(b is None for b in parts):
            return None
        return torch.cat([torch.zeros(p.out_features) if b is None else b for p, b in zip(module.parts, parts)])
    return module.bias


#: stored linear formats that run on any device (CPU kernels there, the dispatcher's kernels elsewhere)
DEVICE_FORMATS = frozenset({"int4", "int8", "bf16", "gguf"})


def converted_net(
    source: Source,
    device: torch.device,
    dtype: str | torch.dtype | None = None,
    layers: int | None = None,
    quant: str | None = "auto",
    build_on: torch.device | None = None,
) -> Transformer:
    """The forward pass of a converted folder (`open_source` of it), its linears built from their stored
    formats (no re-quantization; int4 from its packed layout). `quant`: "auto" or the stored format
    runs them as stored (bf16 activations: dtype defaults to bf16); None/"none" dequantizes them into
    dense weights of `dtype` (as other devices do for formats outside DEVICE_FORMATS). `build_on`: where the
    tensors are put (default `device`; the CPU for a net moved later, its formats still chosen for `device`)."""
    from superslm.devices import pick_dtype

    run_on, device = device, build_on or device

    header = source.config["header"]
    body, kept = header["format"], int(header["layers"])
    if quant not in ("auto", None, "none", body):
        raise InvalidArgument(f"{source.path} holds {body} linears; convert again for {quant} (or pass quant='auto')")
    n = kept if layers is None else layers
    if not 0 < n <= kept:
        raise InvalidArgument(f"layers={n}: the converted folder keeps {kept} layers")
    linears = header.get("linears", {})
    # int4, int8 and bf16 linears run on other devices too (the dispatcher's kernels); GGUF's other blocks
    # have CPU kernels only, so a folder holding them is dequantized there
    on_device = all(m.get("format") in DEVICE_FORMATS for m in linears.values())
    as_dense = quant in (None, "none") or (run_on.type != "cpu" and not on_device)
    dt = pick_dtype(dtype, run_on) if dtype is not None or as_dense or body == "dense" else torch.bfloat16
    a, stored = source.arch, {name: s.load() for name, s in source.tensors.items()}
    parts = source.recipe.parts
    # the recipe's float32 tensors (Qwen3.5's 1 + w norms) stay float32 in a bf16 model, as `materialize` keeps them
    keep32 = frozenset(source.recipe.float32)

    def get(name: str) -> torch.Tensor:
        if name not in stored:
            raise FormatError(f"{source.path}: tensor {name} is missing")
        keep = torch.float32 if name.rsplit(".", 1)[-1] in keep32 else dt
        return stored[name].to(device=device, dtype=keep)

    weights = {"embed": get("embed")}
    if n == a.layers:
        weights.update({k: get(k) for k in ("norm", "head") if k in stored})
    by_layer: dict[str, list[str]] = {}
    for name in stored:
        if name.startswith("layers."):
            by_layer.setdefault(name.split(".", 2)[1], []).append(name)
    def layer_weights(la: Arch, i: int, pre: str, names: Any) -> None:
        """Layer i of `la` (its tensors' keys start with `pre`; `names`: those keys where a dense parts layer
        takes every one)."""
        specs = parts.linears(la, i).values()
        if body == "dense" and parts_layers(la):
            # every canonical tensor as convert wrote it (a GGUF source's delta-rule pieces in its own layout)
            weights.update({k: get(k) for k in names})
            return
        weights.update({pre + k: get(pre + k) for k in parts.norms(la, i)})
        if parts_layers(la):  # the tensors no format replaces: the convolution, a_log, dt_bias, the router, ...
            mixer, mlp = parts.of_layer(la, i)
            extra = [k for part in (mixer, mlp) for k in getattr(part, "tensors", lambda a: ())(la)]
            weights.update({pre + k: get(pre + k) for k in extra if k not in EXPERTS})
            weights.update({pre + k: torch.empty(0, a.dim, device=device, dtype=dt) for k in extra if k in EXPERTS})
        if body == "dense":  # the pieces as the source stored them, split or fused
            for spec in specs:
                weights.update({pre + k: get(pre + k) for k in (*spec.pieces, *spec.bias)})
        else:  # empty placeholders: the module swap below replaces these linears
            for spec in specs:
                weights.update({pre + k: torch.empty(0, a.dim, device=device, dtype=dt) for k in spec.pieces})
                weights.update({pre + k: torch.empty(0, device=device, dtype=dt) for k in spec.bias})

    for i in range(n):
        layer_weights(a, i, f"layers.{i}.", by_layer.get(str(i), ()))
    mtp = a.mtp if n == a.layers else 0  # the MTP block (models/mtp.py) where the folder keeps every layer
    if mtp:
        weights.update({f"mtp.{k}": get(f"mtp.{k}") for k in ("enorm", "hnorm", "norm")})
        weights["mtp.fc"] = get("mtp.fc") if body == "dense" else torch.empty(0, 2 * a.dim, device=device, dtype=dt)
        for j in range(mtp):
            pre = f"mtp.layers.{j}."
            layer_weights(mtp_arch(a, j), 0, pre, [k for k in stored if k.startswith(pre)])
    try:
        net = Transformer(a, weights, n)
    except KeyError as e:  # a dense parts layer without one of its tensors
        raise FormatError(f"{source.path}: tensor {e.args[0]} of a layer is missing") from e
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    plain_shapes = {"qkv": (a.dim, q + 2 * kv), "o": (q, a.dim), "gate_up": (a.dim, 2 * a.ffn),
                    "down": (a.ffn, a.dim)}
    states = _by_linear(stored, linears)

    def build(name: str, shape: tuple[int, int]) -> torch.nn.Module:
        if name not in linears:
            raise FormatError(f"{source.path}: linear {name} is missing from the header")
        module = linear_from_state(states[name], linears[name])
        if (module.in_features, module.out_features) != shape:
            raise FormatError(f"{source.path}: linear {name} is {module.in_features} -> {module.out_features}, "
                              f"the arch implies {shape}")
        if not as_dense:
            return module.to(device)  # off the CPU, int4 takes the kernels' layout (Int4Linear._apply)
        bias = _bias_of(module)
        return DenseLinear(module.dequantize().to(device, dt), None if bias is None else bias.to(device, dt))

    if body != "dense":
        for i, layer in enumerate(net.layers):
            if isinstance(layer, PartsLayer):
                shapes = parts_linear_shapes(parts, a, i)
                for parent, attr, name in layer.linears():
                    setattr(parent, attr, build(f"layers.{i}.{name}", shapes[name]))
                continue
            for attr in LINEAR_NAMES:
                setattr(layer, attr, build(f"layers.{i}.{attr}", plain_shapes[attr]))
        if net.mtp is not None:
            net.mtp.fc = build("mtp.fc", (2 * a.dim, a.dim))
            for j, layer in enumerate(net.mtp.layers):  # type: ignore[arg-type]
                shapes = parts_linear_shapes(parts, mtp_arch(a, j), 0)
                for parent, attr, name in layer.linears():
                    setattr(parent, attr, build(f"mtp.layers.{j}.{name}", shapes[name]))
    if net.has_head and "head" in linears:
        net.head = build("head", (a.dim, a.vocab))
    return net


#: the stacked expert tensors, which each expert's own linears replace
EXPERTS = ("experts_gate_up", "experts_down")


def parts_layers(a: Arch) -> bool:
    """Whether the layers are `PartsLayer`s (delta rule, gated attention, experts), as `Transformer.plain` decides:
    their linears are those `PartsLayer.linears()` names, not LINEAR_NAMES."""
    return a.hybrid or a.attn_gate or any(a.moe_layers)


def _by_linear(stored: Mapping[str, torch.Tensor], linears: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """{linear name: {tensor name within it: tensor}}: each stored tensor under the header's linear whose name
    ends before one of its dots (one pass, not a scan of every tensor for each of a MoE's thousands of linears)."""
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in linears}
    for key, t in stored.items():
        at = key.find(".")
        while at >= 0:
            if key[:at] in out:
                out[key[:at]][key[at + 1:]] = t
                break
            at = key.find(".", at + 1)
    return out


def parts_linear_shapes(parts: LayerParts, a: Arch, i: int) -> dict[str, tuple[int, int]]:
    """{name within the layer (as `PartsLayer.linears()` names it): (in_features, out_features)} of layer i's
    linears: its mixer's, its MLP's or shared expert's, and each expert's."""
    shapes = parts.shapes(a, i)
    mixer, mlp = parts.of_layer(a, i)

    def of(spec: LinearSpec) -> tuple[int, int]:
        return shapes[spec.pieces[0]][1], sum(shapes[p][0] for p in spec.pieces)

    out = {f"mixer.{s.name}": of(s) for s in mixer.linears(a)}
    for s in mlp.linears(a):
        shared = s.name.startswith("shared_")
        out[f"mlp.shared.{s.name[len('shared_'):]}" if shared else f"mlp.{s.name}"] = of(s)
    if a.experts is not None and a.moe_layers[i]:
        (_, up, dim), (_, _, ffn) = shapes["experts_gate_up"], shapes["experts_down"]
        for e in range(a.experts.count):
            out[f"mlp.experts_mlp.{e}.gate_up"], out[f"mlp.experts_mlp.{e}.down"] = (dim, up), (ffn, dim)
    return out
