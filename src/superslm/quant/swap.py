"""Swapping a Transformer's DenseLinear modules for runtime formats, in place (gpt-fast's module swap).

`quantize_linears` re-quantizes the dense weights the model holds (any source); `quantize_from_source`
builds the linears from a GGUF file's own blocks, running Q4_0/Q4_1/Q4_K as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from superslm.errors import FormatError, InvalidArgument, UnsupportedModel
from superslm.memory import release_freed_memory
from superslm.models.loader import Source, Stored, all_finite, canonical_names
from superslm.models.parts import DELTA_LAYOUTS, LinearSpec, mtp_arch
from superslm.models.transformer import DenseLinear, Transformer
from superslm.quant.base import LinearFormat, format_class
from superslm.quant.gguf_map import GGUFEmbedding, GGUFPart, linear_from_gguf

#: formats a rotation helps (bf16 keeps every bit anyway)
_ROTATED = ("int4", "int8")


def make_linear(
    fmt: str, weight: torch.Tensor, bias: torch.Tensor | None, group: int, rotate: bool, seed: int,
    hessian: torch.Tensor | None = None,
) -> LinearFormat:
    """A `fmt` module from a dense weight [out, in], with the options that format takes (`hessian`, the
    inputs' mean x x^T from calibration, makes int4 codes by GPTQ)."""
    options: dict[str, Any] = {}
    if fmt == "int4":
        options["group"] = group
        if hessian is not None:
            options["hessian"] = hessian
    if rotate and fmt in _ROTATED:
        options["rotate"] = seed
    # formats pack on the CPU; the module then goes where the weight was (int4 takes its GPU layout there)
    return format_class(fmt).from_dense(weight, bias, **options).to(weight.device)


def quantize_linears(
    net: Transformer,
    body: str | None = "int4",
    head: str | None = "int8",
    group: int = 128,
    rotate: bool = True,
    seed: int = 0,
) -> dict[str, str]:
    """Replace every DenseLinear of `net` in place: qkv, o, gate_up, down of each layer by `body`,
    the output head by `head` (None keeps a module dense). With `rotate`, int4/int8 weights are
    Hadamard-rotated with `seed` (the activation rotation runs inside each module's forward).

    Returns {module name: describe()} of what was swapped. Activations enter the formats in bf16:
    load the model in bf16 for speed (an fp32 model is cast at each linear).
    """
    if body == "gguf" or head == "gguf":
        raise InvalidArgument("the gguf format comes from GGUF blocks: use quantize_from_source")
    done: dict[str, str] = {}
    for parent, attr, name in body_linears(net):
        dense = getattr(parent, attr)
        if body is None or not isinstance(dense, DenseLinear):
            continue
        module = make_linear(body, dense.weight, dense.bias, group, rotate, seed)
        setattr(parent, attr, module)
        done[name] = module.describe()
    if getattr(net, "has_head", False) and head is not None and isinstance(net.head, DenseLinear):
        net.head = make_linear(head, net.head.weight, net.head.bias, group, rotate, seed)
        done["head"] = net.head.describe()
    return done


def body_linears(net: Transformer) -> list[tuple[torch.nn.Module, str, str]]:
    """(parent module, attribute, full name) of every linear but the head: each layer's ("layers.{i}." + its name),
    then the MTP block's where the model keeps one ("mtp." + MTP.linears' names)."""
    out = [(parent, attr, f"layers.{i}.{name}") for i, layer in enumerate(net.layers)
           for parent, attr, name in layer.linears()]
    mtp = getattr(net, "mtp", None)
    if mtp is not None:
        out += [(parent, attr, f"mtp.{name}") for parent, attr, name in mtp.linears()]
    return out


def row_permutation(source: Source, short: str, rows: int) -> torch.Tensor | None:
    """The row order the recipe's GGUF fix gives weight `short` (llama's q/k unpermute), as indices
    into the file's rows; None when the fix leaves it alone. UnsupportedModel when the fix is not a
    pure row permutation (it could not be applied to blocks without dequantizing)."""
    fix, arch = source.recipe.fix_gguf, source.arch
    probe = torch.arange(rows, dtype=torch.float64)[:, None].repeat(1, 2)  # [rows, 2], exact row ids
    try:
        got = fix(short, probe, arch)
    except (RuntimeError, ValueError, IndexError):  # a fix along the columns cannot reshape two of them
        raise UnsupportedModel(f"{source.recipe.family}: the GGUF fix of {short} is not a row permutation") from None
    if torch.equal(got, probe):
        return None
    perm = got[:, 0].long()
    values = torch.randn(rows, 3, dtype=torch.float64)
    if (
        got.shape != probe.shape
        or not torch.equal(torch.sort(perm).values, torch.arange(rows))
        or not torch.equal(fix(short, values, arch), values[perm])
    ):
        raise UnsupportedModel(f"{source.recipe.family}: the GGUF fix of {short} is not a row permutation")
    return perm


def gguf_parts(source: Source, names: Mapping[str, Stored], prefix: str, keys: tuple[str, ...]) -> list[GGUFPart]:
    """(raw, block type, shape, row_perm) of the canonical weights prefix + key of a GGUF source
    (`names`: its `canonical_names`)."""
    out: list[GGUFPart] = []
    for key in keys:
        stored = names[prefix + key]
        info = source.gguf.tensors[stored.name]
        perm = row_permutation(source, key, info.shape[0])
        out.append((source.gguf.raw(stored.name), info.block, info.shape, perm))
    return out


def _stored_pieces(names: Mapping[str, Stored], prefix: str, spec: LinearSpec) -> tuple[str, ...] | None:
    """The pieces of a layer's linear `spec` (its canonical keys start with `prefix`, "layers.{i}.") as the file
    stores them: the spec's, or for a delta-rule input projection the layout the file has (llama.cpp keeps
    Qwen3-Next's q, k, v, z apart, b and a fused); None where the file has neither."""
    for pieces in (spec.pieces, *(DELTA_LAYOUTS.values() if spec.pieces in DELTA_LAYOUTS.values() else ())):
        if all(f"{prefix}{k}" in names for k in pieces):
            return pieces
    return None


def _spec_name(name: str) -> str:
    """A layer's linear ("mixer.in_proj", "mlp.shared.down", "mlp.experts_mlp.3.down") as its part's spec names
    it ("in_proj", "shared_down"; an expert keeps its path, which no spec has)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1] == "shared":
        return "shared_" + parts[2]
    return parts[-1] if len(parts) <= 2 else name


#: the stacked expert tensors and each expert's linear in MoE (layers.py): gate and up stacked, then down
_EXPERT_LINEARS = {"experts_gate_up": "gate_up", "experts_down": "down"}


def expert_parts(source: Source, i: int, key: str, e: int) -> list[GGUFPart] | None:
    """Expert e's rows of layer i's stacked expert tensor `key` as the file stores them (its bytes are one
    contiguous run: the expert is the slowest dimension), gate's then up's for experts_gate_up; None where the
    file keeps experts otherwise (one tensor each) or the recipe's fix moves their rows."""
    spec = source.recipe.layer_names(False).get(key)
    out: list[GGUFPart] = []
    for name in spec if isinstance(spec, tuple) else (spec,):
        info = source.gguf.tensors.get(f"blk.{i}.{name}") if isinstance(name, str) else None
        if info is None or len(info.shape) != 3 or info.nbytes % info.shape[0]:
            return None
        try:
            if row_permutation(source, key, info.shape[1]) is not None:
                return None
        except UnsupportedModel:
            return None
        per = info.nbytes // info.shape[0]
        raw = source.gguf.raw(info.name)[e * per : (e + 1) * per]
        out.append((raw, info.block, info.shape[1:], None))
    return out


def block_pieces(source: Source, layers: int) -> frozenset[str]:
    """The canonical weights `quantize_from_source` takes from the file's blocks as they are: every linear piece
    of the parts' specs whose GGUF fix is a row permutation (the loader need not build their dense copies)."""
    names = canonical_names(source, layers)
    out: set[str] = set()
    for i in range(layers):
        for spec in source.recipe.parts.linears(source.arch, i).values():
            # a linear is rebuilt from blocks whole or not at all: all its pieces, or none skipped
            pieces = _stored_pieces(names, f"layers.{i}.", spec)
            try:
                for key in pieces or ():
                    row_permutation(source, key, source.gguf.tensors[names[f"layers.{i}.{key}"].name].shape[0])
            except UnsupportedModel:
                continue
            out.update(pieces or ())
        if source.arch.moe_layers[i]:
            out.update(k for k in _EXPERT_LINEARS if expert_parts(source, i, k, 0) is not None)
    return frozenset(out)


def quantize_from_source(
    net: Transformer,
    source: Source,
    head: str | None = "nearest",
    mapping: Mapping[str, tuple[str, dict[str, Any]]] | None = None,
    group: int = 128,
    rotate: bool = False,
    seed: int = 0,
) -> dict[str, str]:
    """Rebuild `net`'s linears from the GGUF file it was loaded from, in place: Q4_0/Q4_1/Q4_K weights
    run as they are (no re-quantization), other block types in their nearest format (`gguf_map.NEAREST`,
    overridden by `mapping`). `head`: "nearest" maps the head's (or the tied embedding's) block type the
    same way; a format name re-quantizes the model's head weight (with `group`, `rotate`, `seed`);
    None keeps it dense. Biases come from the model (already fused and permuted). Returns
    {module name: describe()}.
    """
    if source.format != "gguf" or source.gguf is None:
        raise InvalidArgument(f"{source.path} is not a GGUF source; use quantize_linears")
    names = canonical_names(source, len(net.layers))
    done: dict[str, str] = {}

    def release() -> None:
        # the linears hold their own packed copies: drop the file's pages (a later read faults them
        # back) and the freed temporaries as we go, so a load peaks near its result, not file + copies
        source.gguf.release_pages()
        release_freed_memory()

    for i, layer in enumerate(net.layers):
        done.update(layer_from_source(layer, i, source, names, mapping, group, seed))
        release()
    mtp = getattr(net, "mtp", None)
    if mtp is not None:
        done.update(mtp_from_source(mtp, source, names, mapping, group, seed))
        release()
    if net.embed_weight.numel() == 0:
        # the loader skipped the dense table: rows come from the file's blocks per step
        part = gguf_parts(source, names, "", ("embed",))[0]
        if part[3] is not None:
            raise UnsupportedModel(f"{source.recipe.family}: the GGUF embedding's rows are permuted")
        fix = source.recipe.fix_gguf
        k = int(part[2][1])  # [vocab, dim]
        read = source.gguf.rows_reader(part[0], k // part[1].block_size * part[1].type_size)
        net.embed_rows = GGUFEmbedding(part[0], part[1], part[2], net.dtype,
                                       lambda t: fix("embed", t, source.arch), source.gguf.release_pages, read)
        # a tied head checks the same blocks below
        if ("head" in names or head != "nearest") and not net.embed_rows.all_finite():
            raise FormatError(f"{source.path}: the embedding holds NaN or infinite values")
    if getattr(net, "has_head", False) and head is not None:
        if head == "nearest":
            key = "head" if "head" in names else "embed"
            net.head = linear_from_gguf(gguf_parts(source, names, "", (key,)), getattr(net.head, "bias", None), mapping,
                                       release)
            check_finite(net.head, f"{source.path}: the head")
        else:
            net.head = make_linear(head, net.head.weight, net.head.bias, group, rotate, seed)
        done["head"] = net.head.describe()
    release()
    return done


def layer_from_source(
    layer: torch.nn.Module,
    i: int,
    source: Source,
    names: Mapping[str, Stored],
    mapping: Mapping[str, tuple[str, dict[str, Any]]] | None = None,
    group: int = 128,
    seed: int = 0,
    mtp: bool = False,
) -> dict[str, str]:
    """`quantize_from_source` for layer i alone (`names`: the source's `canonical_names`): its linears from the
    file's blocks as they are where they can be, the rest int8 from the layer's dense weights, in place. Returns
    {module name: describe()}. `mtp`: the layer is the MTP block's decoder layer i (block layers + i of the file)."""
    done: dict[str, str] = {}
    a = source.arch
    arch, index, prefix, block = (a, i, f"layers.{i}.", i) if not mtp else (mtp_arch(a, i), 0, f"mtp.layers.{i}.",
                                                                            a.layers + i)
    label = f"MTP layer {i}" if mtp else f"layer {i}"
    # a part's linears by their spec's name ("mlp.shared.down" is "shared_down"; the routed experts, stacked
    # in the file, are in no spec)
    where = {_spec_name(name): (parent, attr, name) for parent, attr, name in layer.linears()}
    for key, spec in source.recipe.parts.linears(arch, index).items():
        pieces = _stored_pieces(names, prefix, spec)
        if key not in where or pieces is None:
            continue  # a part this model does not have (a MoE without a shared expert)
        parent, attr, name = where[key]
        old = getattr(parent, attr)
        try:
            parts = gguf_parts(source, names, prefix, pieces)
        except UnsupportedModel:
            if not isinstance(old, DenseLinear) or old.weight.numel() == 0:
                raise
            continue  # blocks whose fix moves columns (llama.cpp's tiled value heads): int8 below
        module = linear_from_gguf(parts, getattr(old, "bias", None), mapping)
        check_finite(module, f"{source.path}: {label}'s {name}")
        setattr(parent, attr, module)
        done[f"{prefix}{name}"] = module.describe()
    experts = getattr(getattr(layer, "mlp", None), "experts_mlp", None)
    for key, attr in _EXPERT_LINEARS.items():
        for e, mlp in enumerate(experts or ()):
            parts = expert_parts(source, block, key, e)
            if parts is None:
                break
            setattr(mlp, attr, linear_from_gguf(parts, None, mapping))
            check_finite(getattr(mlp, attr), f"{source.path}: {label}'s expert {e}")
            done[f"{prefix}mlp.experts_mlp.{e}.{attr}"] = getattr(mlp, attr).describe()
    # what the file's blocks could not give as they are (each expert of a stacked expert tensor, a linear
    # whose fix is not a row permutation) is re-quantized from its dense weights, as Q5_K / Q6_K blocks are
    for parent, attr, name in layer.linears():
        dense = getattr(parent, attr)
        if isinstance(dense, DenseLinear) and dense.weight.numel():
            setattr(parent, attr, make_linear("int8", dense.weight, dense.bias, group, False, seed))
            done[f"{prefix}{name}"] = getattr(parent, attr).describe()
        elif isinstance(dense, DenseLinear):  # its dense copy was skipped for blocks that never came
            raise UnsupportedModel(f"{source.recipe.family}: {label}'s {name} has no weights from the file")
    return done


def mtp_from_source(
    mtp: torch.nn.Module,
    source: Source,
    names: Mapping[str, Stored],
    mapping: Mapping[str, tuple[str, dict[str, Any]]] | None = None,
    group: int = 128,
    seed: int = 0,
) -> dict[str, str]:
    """`layer_from_source` for the MTP block (models/mtp.py): its fc from the file's blocks (llama.cpp's
    nextn.eh_proj), each decoder layer as a body layer. Returns {module name: describe()}."""
    done: dict[str, str] = {}
    fc = linear_from_gguf(gguf_parts(source, names, "mtp.", ("fc",)), None, mapping)
    check_finite(fc, f"{source.path}: the MTP block's fc")
    mtp.fc = fc
    done["mtp.fc"] = fc.describe()
    for j, layer in enumerate(mtp.layers):  # type: ignore[arg-type]
        done.update(layer_from_source(layer, j, source, names, mapping, group, seed, mtp=True))
    return done


def check_finite(module: torch.nn.Module, where: str) -> None:
    """FormatError where a module's float tensors (a format's scales, a bias) hold NaN or inf: every answer
    would be NaN."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not all_finite(t):
            raise FormatError(f"{where}: {name} holds NaN or infinite values")


def linear_summary(net: Transformer) -> dict[str, int]:
    """{describe() of a linear: how many modules} over the whole model (for `superslm info`)."""
    out: dict[str, int] = {}
    modules = [getattr(parent, attr) for parent, attr, _ in body_linears(net)]
    if getattr(net, "has_head", False):
        modules.append(net.head)
    for m in modules:
        if isinstance(m, LinearFormat):
            key = m.describe()
        else:
            key = f"dense {str(m.weight.dtype).replace('torch.', '')}"
        out[key] = out.get(key, 0) + 1
    return out
