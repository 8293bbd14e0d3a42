"""Loading a folder written by `superslm convert`: its linears built from their stored formats.

No re-quantization: int4 comes back in its packed layout (a memory map), other formats from their state;
off the CPU the formats that run there keep their form (the dispatcher's kernels), the others become dense.
"""

from __future__ import annotations

import torch

from superslm.errors import FormatError, InvalidArgument
from superslm.models.loader import Source
from superslm.models.parts import LINEAR_NAMES
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
) -> Transformer:
    """The forward pass of a converted folder (`open_source` of it), its linears built from their stored
    formats (no re-quantization; int4 from its packed layout). `quant`: "auto" or the stored format
    runs them as stored (bf16 activations: dtype defaults to bf16); None/"none" dequantizes them into
    dense weights of `dtype` (as other devices do for formats outside DEVICE_FORMATS)."""
    from superslm.devices import pick_dtype

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
    as_dense = quant in (None, "none") or (device.type != "cpu" and not on_device)
    dt = pick_dtype(dtype, device) if dtype is not None or as_dense or body == "dense" else torch.bfloat16
    a, stored = source.arch, {name: s.load() for name, s in source.tensors.items()}

    def get(name: str) -> torch.Tensor:
        if name not in stored:
            raise FormatError(f"{source.path}: tensor {name} is missing")
        return stored[name].to(device=device, dtype=dt)

    weights = {"embed": get("embed")}
    if n == a.layers:
        weights.update({k: get(k) for k in ("norm", "head") if k in stored})
    parts = source.recipe.parts
    norms = parts.norms(a)
    specs = parts.linears(a).values()
    for i in range(n):
        weights.update({f"layers.{i}.{k}": get(f"layers.{i}.{k}") for k in norms})
        if body == "dense":  # the pieces as the source stored them, split or fused
            for spec in specs:
                weights.update({f"layers.{i}.{k}": get(f"layers.{i}.{k}") for k in (*spec.pieces, *spec.bias)})
        else:  # empty placeholders: the module swap below replaces these linears
            for spec in specs:
                weights.update({f"layers.{i}.{k}": torch.empty(0, a.dim, device=device, dtype=dt) for k in spec.pieces})
                weights.update({f"layers.{i}.{k}": torch.empty(0, device=device, dtype=dt) for k in spec.bias})
    net = Transformer(a, weights, n)
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    shapes = {"qkv": (a.dim, q + 2 * kv), "o": (q, a.dim), "gate_up": (a.dim, 2 * a.ffn), "down": (a.ffn, a.dim),
              "head": (a.dim, a.vocab)}

    def build(name: str) -> torch.nn.Module:
        if name not in linears:
            raise FormatError(f"{source.path}: linear {name} is missing from the header")
        pre = name + "."
        module = linear_from_state({k[len(pre):]: v for k, v in stored.items() if k.startswith(pre)}, linears[name])
        if (module.in_features, module.out_features) != shapes[name.rsplit(".", 1)[-1]]:
            raise FormatError(f"{source.path}: linear {name} is {module.in_features} -> {module.out_features}, "
                              f"the arch implies {shapes[name.rsplit('.', 1)[-1]]}")
        if not as_dense:
            return module.to(device)  # off the CPU, int4 takes the kernels' layout (Int4Linear._apply)
        bias = _bias_of(module)
        return DenseLinear(module.dequantize().to(device, dt), None if bias is None else bias.to(device, dt))

    if body != "dense":
        for i, layer in enumerate(net.layers):
            for attr in LINEAR_NAMES:
                setattr(layer, attr, build(f"layers.{i}.{attr}"))
    if net.has_head and "head" in linears:
        net.head = build("head")
    return net
