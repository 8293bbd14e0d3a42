"""Reading a model's tensors from a Hugging Face folder or a GGUF file into canonical names.

Each tensor stays as its file holds it (`Stored`: a GGUF block type or a safetensors dtype) until the
compute layer decides what to make of it; `materialize` is the plain float path (fp32 / bf16).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from superslm.errors import FormatError, ModelNotFound, UnsupportedModel
from superslm.models.arch import Arch, DeltaNet, Experts, Rope, eos_tuple, gguf_longrope
from superslm.models.parts import MTP_TENSORS, mtp_arch, mtp_shapes
from superslm.models.registry import Recipe, recipe_for_gguf, recipe_for_hf


@dataclass(frozen=True)
class Stored:
    """A tensor in its file: its shape (torch order), its storage kind ("Q4_1", "BF16", ...) and a loader."""

    name: str
    shape: tuple[int, ...]
    kind: str
    load: Callable[[], torch.Tensor]


@dataclass
class Source:
    """What a model file or folder holds: its recipe, Arch, tensors and where it came from."""

    path: Path
    format: str  # "gguf", "hf" or "native" (a converted folder)
    recipe: Recipe
    arch: Arch
    tensors: dict[str, Stored]
    config: dict[str, Any]
    gguf: Any = None  # the open GGUFFile, for the tokenizer and metadata

    @property
    def is_hf(self) -> bool:
        return self.format == "hf"

    def block_types(self) -> dict[str, int]:
        """How many tensors of each storage kind the source holds."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.kind] = out.get(t.kind, 0) + 1
        return out

    def parameter_count(self) -> int:
        total = 0
        for t in self.tensors.values():
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total


# --- Hugging Face folders -------------------------------------------------------------------------


def _hf_tensors(folder: Path) -> dict[str, Stored]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{index}: malformed safetensors index ({e})") from e
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise FormatError(f"{folder}: no safetensors files")
    out: dict[str, Stored] = {}
    for shard in shards:
        path = folder / shard
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise FormatError(f"{path}: not a readable safetensors file ({e})") from e
        for name in handle.keys():
            if name in out:
                raise FormatError(f"{path}: tensor {name} appears in two shards")
            sl = handle.get_slice(name)
            out[name] = Stored(
                name=name,
                shape=tuple(sl.get_shape()),
                kind=str(sl.get_dtype()),
                load=(lambda h=handle, n=name: h.get_tensor(n)),
            )
    return out


def open_hf(folder: Path) -> Source:
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError as e:
        raise ModelNotFound(f"{folder}: no config.json") from e
    except ValueError as e:
        raise FormatError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise FormatError(f"{cfg_path}: not a JSON object")
    recipe = recipe_for_hf(config)
    arch = _read_arch(recipe.arch_from_hf, config, cfg_path)
    gen = folder / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids = () if eos is None else eos_tuple(eos)
        except (ValueError, TypeError, AttributeError) as e:
            raise FormatError(f"{gen}: malformed eos_token_id ({e})") from e
        arch = replace(arch, eos_ids=tuple(dict.fromkeys(arch.eos_ids + ids)))
    tensors = _hf_tensors(folder)
    return Source(folder, "hf", recipe, replace(arch, mtp=_hf_mtp_layers(recipe, tensors)), tensors, config)


def _hf_mtp_layers(recipe: Recipe, tensors: Mapping[str, Stored]) -> int:
    """How many MTP layers a folder holds ("mtp.layers.{j}." tensors; none for a family without MTP). The tensors
    decide, not the config: Qwen3.5 configs say mtp_num_hidden_layers=1 where transformers' save_pretrained dropped
    the tensors (its model ignores "mtp.*" keys), and Qwen3-Next configs do not say (llama.cpp's converter counts
    them too)."""
    if not recipe.hf_mtp or recipe.hf_mtp["fc"] not in tensors:
        return 0
    found = {int(n.split(".")[2]) for n in tensors if n.startswith("mtp.layers.") and n.split(".")[2].isdecimal()}
    return max(found) + 1 if found else 0


def _read_arch(read: Callable[[Mapping[str, Any]], Arch], config: Mapping[str, Any], where: Path) -> Arch:
    """recipe.arch_from_*(config), a missing or mistyped field reported as a FormatError naming the file."""
    try:
        return read(config)
    except KeyError as e:
        raise FormatError(f"{where}: missing {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise FormatError(f"{where}: malformed ({e})") from e


# --- GGUF files -----------------------------------------------------------------------------------


def open_gguf(path: Path) -> Source:
    from superslm.formats.gguf import GGUFFile

    g = GGUFFile(path)
    md = g.metadata
    recipe = recipe_for_gguf(md)
    arch = _read_arch(recipe.arch_from_gguf, md, path)
    for special in (arch.bos_id, *arch.eos_ids):
        # llama.cpp warns and goes on; a bos outside the table would fail every prompt, an eos never stop one
        if special is not None and not (isinstance(special, int) and 0 <= special < arch.vocab):
            raise FormatError(f"{path}: special token id {special!r} is outside the vocabulary [0, {arch.vocab})")
    names = set(g.tensors)
    arch = replace(
        arch,
        tied="output.weight" not in names,
        qkv_bias=arch.qkv_bias or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
    )
    if "rope_factors_long.weight" in names and "rope_factors_short.weight" in names:  # Phi-3's LongRoPE
        long, short = (tuple(float(x) for x in g.dequantize(f"rope_factors_{k}.weight").reshape(-1))
                       for k in ("long", "short"))
        arch = gguf_longrope(arch, md, long, short)
    if "rope_freqs.weight" in names:
        factors = tuple(float(x) for x in g.dequantize("rope_freqs.weight").reshape(-1))
        arch = replace(arch, rope=replace(arch.rope, freq_factors=factors))
    tensors = {
        name: Stored(name, tuple(info.shape), info.block.name, (lambda n=name: g.dequantize(n)))
        for name, info in g.tensors.items()
    }
    return Source(path, "gguf", recipe, arch, tensors, dict(md), gguf=g)


# --- folders written by `superslm convert` ----------------------------------------------------------


def _arch_from_summary(d: Mapping[str, Any]) -> Arch:
    """The inverse of `Arch.summary()` after a JSON round trip (lists back to tuples)."""

    def rope(r: Mapping[str, Any] | None) -> Rope | None:
        return None if r is None else Rope(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})

    fields = dict(d, rope=rope(d["rope"]), rope_local=rope(d.get("rope_local")))
    fields.update(windows=tuple(d["windows"]), eos_ids=tuple(d["eos_ids"]), rope_layers=tuple(d.get("rope_layers", ())),
                  mixers=tuple(d.get("mixers", ())), moe_layers=tuple(d.get("moe_layers", ())))
    if d.get("delta") is not None:
        fields["delta"] = DeltaNet(**d["delta"])
    if d.get("experts") is not None:
        fields["experts"] = Experts(**d["experts"])
    return Arch(**fields)


def open_native(folder: Path) -> Source:
    """A converted folder, verified against its manifest; tensors are memory-mapped, stored by their
    canonical names (linears by their runtime formats' tensors: see superslm.convert)."""
    from superslm.formats.native import read_folder

    nf = read_folder(folder)
    try:
        recipe = recipe_for_hf({"model_type": nf.config["model_type"]})
        arch = _arch_from_summary(nf.config["arch"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{folder}/config.json: malformed ({e!r})") from e
    tensors = {
        n: Stored(n, tuple(t.shape), str(t.dtype).replace("torch.", ""), (lambda t=t: t)) for n, t in nf.tensors.items()
    }
    return Source(folder, "native", recipe, arch, tensors, dict(nf.config, header=nf.header))


def open_source(path: str | Path) -> Source:
    """A GGUF file, a Hugging Face folder or a converted folder, read lazily (no tensor is loaded yet)."""
    from superslm.formats.native import is_native

    p = Path(path)
    if p.is_dir() and is_native(p):
        return open_native(p)
    if p.is_dir():
        return open_hf(p)
    if p.is_file():
        return open_gguf(p)
    raise ModelNotFound(f"no model file or folder at {p}")


# --- canonical weights ----------------------------------------------------------------------------


def _find(src: Source, name: str) -> Stored | None:
    for prefix in src.recipe.hf_prefixes if src.is_hf else ("",):
        t = src.tensors.get(prefix + name)
        if t is not None:
            return t
    return None


def _stored(src: Source, prefix: str, spec: Any) -> Stored | None:
    """The tensor a recipe's name `spec` names under `prefix`: a name; a name with "{e}", each expert's tensor
    stacked along a new first dimension; a tuple of specs, concatenated along their rows (the second-to-last
    dimension: each expert's gate then up); a list, the first of its alternatives the source holds."""
    if isinstance(spec, list):
        for alt in spec:
            t = _stored(src, prefix, alt)
            if t is not None:
                return t
        return None
    if isinstance(spec, tuple):
        parts = [_stored(src, prefix, p) for p in spec]
        if any(p is None for p in parts):
            return None
        got = [p for p in parts if p is not None]
        if len({(p.shape[:-2], p.shape[-1]) for p in got}) != 1 or len(got[0].shape) < 2:
            raise FormatError(f"{src.path}: tensors {[p.name for p in got]} cannot be stacked")
        shape = (*got[0].shape[:-2], sum(p.shape[-2] for p in got), got[0].shape[-1])
        return Stored(got[0].name, shape, got[0].kind, lambda: torch.cat([p.load() for p in got], dim=-2))
    if "{e}" not in spec:
        return _find(src, prefix + spec)
    count = src.arch.experts.count if src.arch.experts is not None else 0
    each = [_find(src, prefix + spec.format(e=e)) for e in range(count)]
    if not each or any(t is None for t in each):
        return None
    ts = [t for t in each if t is not None]
    if len({t.shape for t in ts}) != 1:
        raise FormatError(f"{src.path}: the experts' {prefix + spec} tensors differ in shape")
    return Stored(prefix + spec, (count, *ts[0].shape), ts[0].kind, lambda: torch.stack([t.load() for t in ts]))


def canonical_names(src: Source, layers: int | None = None) -> dict[str, Stored]:
    """Canonical name -> stored tensor, for the first `layers` layers (all by default)."""
    arch, recipe, hf = src.arch, src.recipe, src.is_hf
    n = arch.layers if layers is None else layers
    if not 0 < n <= arch.layers:
        raise UnsupportedModel(f"cannot keep {n} of {arch.layers} layers")
    glob, per_layer = recipe.global_names(hf), recipe.layer_names(hf)
    out: dict[str, Stored] = {}
    wanted = [("embed", True)]
    if n == arch.layers:
        wanted += [("norm", True), ("head", not arch.tied)]
    for key, required in wanted:
        t = _find(src, glob[key])
        if t is None and required:
            raise FormatError(f"{src.path}: missing tensor {glob[key]}")
        if t is not None:
            out[key] = t
    for i in range(n):
        prefix = f"model.layers.{i}." if hf else f"blk.{i}."
        for key in recipe.parts_for(hf).tensors(arch, i):
            t = _stored(src, prefix, per_layer[key]) if key in per_layer else None
            if t is None:
                raise FormatError(f"{src.path}: missing tensor {prefix}{_spelled(per_layer.get(key, key))}")
            out[f"layers.{i}.{key}"] = t
    if n == arch.layers and arch.mtp:
        out.update(_mtp_names(src))
    return out


def _mtp_names(src: Source) -> dict[str, Stored]:
    """The MTP block's canonical tensors ("mtp." + MTP_TENSORS, "mtp.layers.{j}." + a layer's parts): HF's
    "mtp.*", or llama.cpp's block N "nextn" tensors and blocks N + j (N: the body's layers)."""
    arch, recipe, hf = src.arch, src.recipe, src.is_hf
    names, per_layer = recipe.mtp_names(hf), recipe.layer_names(hf)
    out: dict[str, Stored] = {}
    for key in MTP_TENSORS:
        name = names[key] if hf else f"blk.{arch.layers}.{names[key]}"
        t = _find(src, name)
        if t is None and not hf and key == "norm":
            # llama.cpp's graph_mtp falls back to the body's final norm where the file has no shared_head_norm
            t = _find(src, recipe.global_names(hf)["norm"])
        if t is None:
            raise FormatError(f"{src.path}: missing tensor {name}")
        out[f"mtp.{key}"] = t
    if not hf:
        for extra in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"):
            if f"blk.{arch.layers}.{extra}" in src.tensors:  # llama.cpp would use them; we would not, so refuse
                raise UnsupportedModel(f"{src.path}: the MTP block's own {extra} is not supported")
    for j in range(arch.mtp):
        prefix = f"mtp.layers.{j}." if hf else f"blk.{arch.layers + j}."
        for key in recipe.parts_for(hf).tensors(mtp_arch(arch, j), 0):
            t = _stored(src, prefix, per_layer[key]) if key in per_layer else None
            if t is None:
                raise FormatError(f"{src.path}: missing tensor {prefix}{_spelled(per_layer.get(key, key))}")
            out[f"mtp.layers.{j}.{key}"] = t
    return out


def short_name(key: str) -> str:
    """A canonical key's name within its layer or block ("layers.3.q" and "mtp.layers.0.q": "q"; "mtp.fc": "fc"),
    what the recipe's fixes, float32 list and a load's skip set name."""
    return key.rsplit(".", 1)[-1] if key.startswith(("layers.", "mtp.")) else key


def _spelled(spec: Any) -> str:
    """A recipe's name spec as an error names it (its first alternative, pieces joined by +)."""
    if isinstance(spec, list):
        return _spelled(spec[0])
    return " + ".join(spec) if isinstance(spec, tuple) else str(spec)


def materialize(
    src: Source,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    layers: int | None = None,
    skip: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Canonical weights as dense tensors of `dtype`, with the recipe's fixes applied.

    Tensors whose short name is in `skip` (linears about to be rebuilt from their blocks) become empty
    [0, in] placeholders, so a model is never held dense in memory only to be thrown away.
    """
    out: dict[str, torch.Tensor] = {}
    for key, stored in canonical_names(src, layers).items():
        short = short_name(key)
        if short in skip:
            _check_shape(key, short, tuple(stored.shape), src.arch, src.recipe)  # its blocks are read later
            out[key] = torch.empty((0, int(stored.shape[-1]) if len(stored.shape) else 0), dtype=dtype, device=device)
            continue
        t = canonical_tensor(src, key, stored)
        keep = torch.float32 if short in src.recipe.float32 and dtype.is_floating_point else dtype
        out[key] = t.to(device=device, dtype=keep).contiguous()
    return out


def canonical_tensor(src: Source, key: str, stored: Stored) -> torch.Tensor:
    """Canonical tensor `key` (a `canonical_names` key) as float32 with the recipe's fix applied, in the shape the
    Arch implies (FormatError for another shape, or NaN / infinite values)."""
    fix = src.recipe.fix_hf if src.is_hf else src.recipe.fix_gguf
    short = short_name(key)
    t = _unsqueezed(key, short, fix(short, stored.load().float(), src.arch), src.arch, src.recipe)
    _check_shape(key, short, tuple(t.shape), src.arch, src.recipe)
    if not all_finite(t):
        raise FormatError(f"{src.path}: tensor {stored.name} holds NaN or infinite values")
    return t


def all_finite(t: torch.Tensor) -> bool:
    """False where a float tensor holds NaN or inf, which makes every answer NaN: one float32 sum, a single
    pass (an inf of overflow would need values near 1e31). Non-float tensors are finite."""
    return not t.is_floating_point() or not t.numel() or bool(torch.isfinite(torch.sum(t, dtype=torch.float32)))


def _want_shape(key: str, short: str, a: Arch, recipe: Recipe) -> tuple[int, ...]:
    if key.startswith("mtp.layers."):
        return recipe.parts.shapes(mtp_arch(a, int(key.split(".")[2])), 0)[short]
    if key.startswith("mtp."):
        return mtp_shapes(a)[short]
    layer = int(key.split(".")[1]) if key.startswith("layers.") else 0
    shapes: Mapping[str, tuple[int, ...]] = {
        "embed": (a.vocab, a.dim), "head": (a.vocab, a.dim), "norm": (a.dim,), **recipe.parts.shapes(a, layer)}
    return shapes[short]


def _unsqueezed(key: str, short: str, t: torch.Tensor, a: Arch, recipe: Recipe) -> torch.Tensor:
    """`t` in its expected shape where it differs only by dimensions of size 1: llama.cpp's quantizer writes a
    one-row weight (the shared expert's gate, [1, dim]) as a vector."""
    want = _want_shape(key, short, a, recipe)
    same = [d for d in t.shape if d != 1] == [d for d in want if d != 1]
    return t.reshape(want) if tuple(t.shape) != want and same else t


def _check_shape(key: str, short: str, shape: tuple[int, ...], a: Arch, recipe: Recipe) -> None:
    want = _want_shape(key, short, a, recipe)
    if tuple(shape) != want:
        raise FormatError(f"tensor {key} has shape {tuple(shape)}, the config implies {want}")
