"""`superslm convert SRC DST`: a Hugging Face folder or a GGUF file into SuperSLM's own folder.

Each linear is stored in its runtime format's tensors (int4 in the packed layout its CPU kernel
reads, so loading is a memory map, not a repack), norms in float32, the embedding as the source
holds it (a float dtype) or bf16 (GGUF blocks). A GGUF file's Q4_0/Q4_1/Q4_K blocks are stored as
they are ("gguf": no re-quantization) unless --format says otherwise. A PEFT LoRA adapter is merged
(W + scale B A) before quantizing; --layers N keeps the first N layers (hidden states only). Hybrid and MoE
layers (models/layers.py PartsLayer) store each linear they run, every expert's its own, the same way.
The folder is written atomically with a manifest (formats/native.py) and verified when loaded.
See docs/convert.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from superslm.converted import EXPERTS, parts_layers
from superslm.errors import InvalidArgument, ModelNotFound, UnsupportedModel
from superslm.formats import native
from superslm.models.layers import PartsLayer
from superslm.models.loader import Source, Stored, canonical_names, canonical_tensor, open_source
from superslm.models.parts import DELTA_LAYOUTS, NORMS, PIECES, mtp_arch, stack, stacked
from superslm.models.transformer import DenseLinear
from superslm.quant import LinearFormat, linear_from_gguf
from superslm.quant.stored import INT4_PACKED, linear_state
from superslm.quant.swap import block_pieces, gguf_parts, layer_from_source, make_linear

#: --format: the body's linears; "gguf" runs a GGUF file's int4 blocks as they are (others nearest),
#: "dense" keeps float weights as the source holds them (GGUF blocks dequantized to float32)
BODY_FORMATS = ("int4", "int8", "bf16", "gguf", "dense")
#: --head: a format, "nearest" (a GGUF head's block type mapped like the body's) or "dense"
HEAD_FORMATS = ("int4", "int8", "bf16", "nearest", "dense")
#: files of a Hugging Face folder's tokenizer and template, copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")
_FLOAT_KINDS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def resolve_formats(source: Source, fmt: str = "auto", head: str | None = None) -> tuple[str, str]:
    """(body format, head format) for a source: "auto" is gguf for a GGUF file, int4 otherwise; the
    head defaults to nearest (gguf), bf16 (bf16), dense (dense) or int8 (int4, int8)."""
    body = ("gguf" if source.format == "gguf" else "int4") if fmt == "auto" else fmt
    if body not in BODY_FORMATS:
        raise InvalidArgument(f"unknown format {fmt!r} (known: auto, {', '.join(BODY_FORMATS)})")
    if head is None:
        head = {"gguf": "nearest", "bf16": "bf16", "dense": "dense"}.get(body, "int8")
    if head not in HEAD_FORMATS:
        raise InvalidArgument(f"unknown head format {head!r} (known: {', '.join(HEAD_FORMATS)})")
    if source.format != "gguf" and (body == "gguf" or head == "nearest"):
        raise InvalidArgument("the gguf format and the nearest head come from GGUF blocks: SRC is not a GGUF file")
    return body, head


def source_sha256(source: Source) -> str:
    """sha256 of a GGUF file; of a folder: of the lines "NAME SHA256" of its .safetensors/.json/.jinja files."""
    if source.path.is_file():
        return native.sha256_file(source.path)
    h = hashlib.sha256()
    for p in sorted(source.path.iterdir()):
        if p.is_file() and p.suffix in (".safetensors", ".json", ".jinja"):
            h.update(f"{p.name} {native.sha256_file(p)}\n".encode())
    return h.hexdigest()


# --- linears <-> stored tensors --------------------------------------------------------------------


def _fixed(source: Source, key: str, stored: Stored) -> torch.Tensor:
    """A canonical weight as float32 with the recipe's fix applied (what `materialize` computes)."""
    fix = source.recipe.fix_hf if source.is_hf else source.recipe.fix_gguf
    short = key.rsplit(".", 1)[-1] if key.startswith("layers.") else key
    return fix(short, stored.load().float(), source.arch).contiguous()


def _float_dtype(stored: Stored, exact: bool) -> torch.dtype:
    """How a float tensor is kept: its file's float dtype; GGUF blocks as float32 (exact) or bf16."""
    return _FLOAT_KINDS.get(stored.kind, torch.float32 if exact else torch.bfloat16)


class _Writer:
    """Collects the converted tensors and the linears' metadata, one layer at a time."""

    def __init__(self, source: Source, names: Mapping[str, Stored], opts: dict[str, Any], adapter: Any,
                 calibrator: Any = None) -> None:
        self.source, self.names, self.opts, self.adapter = source, names, opts, adapter
        self.calibrator = calibrator  # calibration.LayerCalibrator: GPTQ for int4 linears
        self.tensors: dict[str, torch.Tensor] = {}
        self.linears: dict[str, dict[str, Any]] = {}
        #: GPTQ's int4 linears by name, kept for end-to-end tuning (`tune`)
        self.gptq: dict[str, LinearFormat] = {}
        #: the canonical weights a GGUF source's parts layers take from its blocks (`block_pieces`), once
        self.blocks: frozenset[str] | None = None

    def put(self, name: str, module: LinearFormat) -> None:
        t, meta = linear_state(module)
        self.tensors.update({f"{name}.{k}": v for k, v in t.items()})
        self.linears[name] = meta

    def make(self, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None,
             hessian: torch.Tensor | None = None) -> LinearFormat:
        o = self.opts
        return make_linear(fmt, weight, bias, o["group"], o["rotate"], o["seed"], hessian)

    def layer(self, i: int) -> None:
        if parts_layers(self.source.arch):
            self.parts_layer(i)
            return
        prefix, body, arch = f"layers.{i}.", self.opts["format"], self.source.arch
        keys = [k[len(prefix):] for k in self.names if k.startswith(prefix)]
        # GGUF blocks kept as they are need no float copy of the linears
        w = {k: _fixed(self.source, prefix + k, self.names[prefix + k]) for k in keys
             if not (body == "gguf" and k in PIECES)}
        if self.adapter is not None:
            for part in (p for p in PIECES if p in w):
                delta = self.adapter.delta(i, part)
                if delta is not None:
                    w[part] = w[part] + delta
        for k in keys:
            if k in NORMS:
                self.tensors[prefix + k] = w[k]
            elif body == "dense":
                self.tensors[prefix + k] = w[k].to(_float_dtype(self.names[prefix + k], exact=True))
        if body == "dense":
            return
        hessians = self.calibrator.layer(i) if self.calibrator is not None else {}
        for attr, spec in self.source.recipe.parts.linears(arch).items():
            if body == "gguf":  # the weight from the file's blocks (w holds no float copy), the bias from w
                bias = stack(w, spec.bias) if spec.bias else None
                module = linear_from_gguf(gguf_parts(self.source, self.names, prefix, spec.pieces), bias)
            else:
                weight, bias = stacked(w, attr, arch)
                module = self.make(body, weight, bias, hessians.get(attr))
                if hessians.get(attr) is not None:
                    self.gptq[prefix + attr] = module
            self.put(prefix + attr, module)

    def parts_layer(self, i: int, mtp: bool = False) -> None:
        """A `PartsLayer`: each linear it runs (`PartsLayer.linears()`: each expert's too) in the body's format from
        the stacked float32 weights the load path builds it from; its other tensors (norms, the convolution, a_log,
        dt_bias, the router and the shared expert's gate, which stay dense as at load) in float32. "dense" keeps
        every canonical tensor instead, linears' pieces in the source's float dtype; "gguf" each linear from the file's
        blocks as `superslm.load` runs them (`quant.swap.layer_from_source`). `mtp`: the MTP block's layer i."""
        body, source = self.opts["format"], self.source
        prefix, arch, index = ((f"mtp.layers.{i}.", mtp_arch(source.arch, i), 0) if mtp
                               else (f"layers.{i}.", source.arch, i))
        parts = source.recipe.parts_for(source.is_hf)
        keys = [k[len(prefix):] for k in self.names if k.startswith(prefix)]
        if body == "gguf" and self.blocks is None:
            self.blocks = block_pieces(source, self.opts["layers"])
        # GGUF blocks kept as they are need no float copy: an empty [0, in] placeholder, as `materialize` skips them
        w = {k: torch.empty(0, self.names[prefix + k].shape[-1]) if body == "gguf" and k in (self.blocks or ())
             else canonical_tensor(source, prefix + k, self.names[prefix + k]) for k in keys}
        pieces = {p for s in parts.linears(arch, index).values() for p in (*s.pieces, *s.bias)}
        pieces.update(*DELTA_LAYOUTS.values(), EXPERTS)
        for k in keys:
            if k not in pieces:
                self.tensors[prefix + k] = w[k]
            elif body == "dense":
                self.tensors[prefix + k] = w[k].to(_float_dtype(self.names[prefix + k], exact=True))
        if body == "dense":
            return
        if body == "gguf":
            # what the blocks cannot give as they are becomes int8 from bf16 weights, as `superslm.load` makes it
            w = {k: v.to(torch.bfloat16) if k in pieces else v for k, v in w.items()}
        layer = PartsLayer(arch, index, w, DenseLinear)  # its linears stacked as `superslm.load` stacks them
        if body == "gguf":
            o = self.opts
            layer_from_source(layer, i, source, self.names, None, o["group"], o["seed"], mtp=mtp)
            source.gguf.release_pages()
        for parent, attr, name in layer.linears():
            module = getattr(parent, attr)
            self.put(prefix + name, module if body == "gguf" else self.make(body, module.weight, module.bias))

    def mtp(self) -> None:
        """The MTP block (models/mtp.py): its norms in float32, fc as a body linear (from the file's blocks for
        "gguf", as `superslm.load` takes it), its decoder layers as parts layers."""
        source, body = self.source, self.opts["format"]
        for k in ("enorm", "hnorm", "norm"):
            self.tensors[f"mtp.{k}"] = canonical_tensor(source, f"mtp.{k}", self.names[f"mtp.{k}"])
        if body == "gguf":
            self.put("mtp.fc", linear_from_gguf(gguf_parts(source, self.names, "mtp.", ("fc",))))
        else:
            fc = canonical_tensor(source, "mtp.fc", self.names["mtp.fc"])
            if body == "dense":
                self.tensors["mtp.fc"] = fc.to(_float_dtype(self.names["mtp.fc"], exact=True))
            else:
                self.put("mtp.fc", self.make(body, fc, None))
        for j in range(source.arch.mtp):
            self.parts_layer(j, mtp=True)

    def tune(self, steps: int, progress: bool) -> dict[str, Any]:
        """GPTQ's int4 scales and zeros tuned end to end against the calibrator's dense model
        (`quant.tune`); the tuned linears replace the stored ones. Returns what the header records."""
        from tqdm import tqdm

        from superslm.quant.tune import tune_int4

        cal = self.calibrator
        cal.h = []  # the calibration hidden states are done with
        bar = tqdm(total=steps, desc="tuning int4 scales", unit="step", disable=not progress)
        try:
            tuned, info = tune_int4(cal.model.net, self.gptq, cal.tuning_seqs(steps), steps,  # type: ignore[arg-type]
                                    report=lambda step, kl: bar.update(1))
        finally:
            bar.close()
        for name, module in tuned.items():
            self.put(name, module)
        return info

    def globals(self, head: str) -> None:
        exact = self.opts["format"] == "dense"
        embed = _fixed(self.source, "embed", self.names["embed"])
        self.tensors["embed"] = embed.to(_float_dtype(self.names["embed"], exact))
        if "norm" not in self.names:
            return  # --layers: no final norm, no head
        self.tensors["norm"] = _fixed(self.source, "norm", self.names["norm"])
        key = "head" if "head" in self.names else "embed"
        if head == "dense":
            if key == "head":
                self.tensors["head"] = _fixed(self.source, "head", self.names["head"]).to(
                    _float_dtype(self.names["head"], exact))
        elif head == "nearest":
            self.put("head", linear_from_gguf(gguf_parts(self.source, self.names, "", (key,))))
        else:
            weight = embed if key == "embed" else _fixed(self.source, "head", self.names["head"])
            self.put("head", self.make(head, weight, None))


def _write_tokenizer(source: Source, folder: Path) -> None:
    if source.is_hf:
        for name in TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, folder / name)
        return
    from superslm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(source.gguf.metadata, lean=False)  # saved as tokenizer.json
    tok.backend.save(str(folder / "tokenizer.json"))
    text = tok.backend.id_to_token
    config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos,
              "add_eos_token": tok.add_eos, "chat_template": tok.chat_template,
              "pad_token": None if tok.pad_id is None else text(tok.pad_id),
              "unk_token": None if tok.unk_id is None else text(tok.unk_id)}
    native.write_json(folder / "tokenizer_config.json", {k: v for k, v in config.items() if v is not None})
    # every end-of-generation id (eos, eot, eom and the ones spelled like them) as the HF way says it
    native.write_json(folder / "generation_config.json", {"bos_token_id": tok.bos_id,
                                                          "eos_token_id": sorted(tok.stop_ids)})


def _write_schemas(schemas: Mapping[str, str | Path], folder: Path) -> None:
    from superslm.grammar.schemas import load_schemas

    for name, file in schemas.items():
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise InvalidArgument(f"schema name {name!r} is not a valid name")
        if not Path(file).is_file():
            raise ModelNotFound(f"schema file {file} not found")
        (folder / "schemas").mkdir(exist_ok=True)
        shutil.copyfile(file, folder / "schemas" / f"{name}.json")
    load_schemas(folder)  # refuses a bad name or a file that is not a JSON schema, before commit


def _source_config(source: Source) -> dict[str, Any]:
    """The source's config: config.json, or the GGUF metadata without the vocabulary."""
    if source.is_hf:
        return dict(source.config)
    out = {}
    for k, v in source.config.items():
        if k.startswith("tokenizer.ggml.") or hasattr(v, "__len__") and not isinstance(v, str) and len(v) > 256:
            continue
        v = v.tolist() if hasattr(v, "tolist") else v
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue  # not JSON: not worth keeping in a config
        out[k] = v
    return out


def convert(
    src: str | Path,
    dst: str | Path,
    format: str = "auto",
    group: int = 128,
    head: str | None = None,
    rotate: bool = True,
    seed: int = 0,
    lora: str | Path | None = None,
    layers: int | None = None,
    schemas: Mapping[str, str | Path] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    calibrate: str | Path | bool | None = None,
    calibration_tokens: int = 2048,
    tune_steps: int = 0,
) -> Path:
    """Convert SRC (a HF folder or a GGUF file) into the folder `dst`; returns `dst`.

    `format`: auto | int4 | int8 | bf16 | gguf | dense (see BODY_FORMATS); `group`: int4's group size;
    `head`: see HEAD_FORMATS (default per format, `resolve_formats`); `rotate`/`seed`: the block
    Hadamard rotation of int4/int8 weights; `lora`: a PEFT folder merged first; `layers`: keep the
    first N layers; `schemas`: {NAME: json file}; `calibrate` (int4 only): GPTQ against
    `calibration_tokens` of a text file's inputs (True: Python's reference docs, `calibration.py`);
    a merged LoRA is calibrated with the base model's inputs; `tune_steps` (with `calibrate`): then tune the
    int4 scales and zeros end to end for that many sequences of the same text (`quant.tune`).
    Atomic: `dst` appears complete or not at all.
    """
    source = open_source(src)
    if source.format == "native":
        raise InvalidArgument(f"{src} is already a converted folder")
    body, head = resolve_formats(source, format, head)
    if parts_layers(source.arch) and calibrate not in (None, False):
        raise UnsupportedModel(f"{src}: calibration (GPTQ) runs plain attention and MLP layers, not "
                               f"{source.arch.family}'s delta-rule, gated-attention or expert layers")
    if lora is not None and body == "gguf":
        raise InvalidArgument("a merged LoRA changes the weights, so GGUF blocks cannot be kept as they are: "
                              "pass --format int4, int8, bf16 or dense")
    arch = source.arch
    n = arch.layers if layers is None else int(layers)
    if not 0 < n <= arch.layers:
        raise InvalidArgument(f"--layers {n}: the model has {arch.layers} layers")
    names = canonical_names(source, n)
    adapter = None
    lora_info = None
    if lora is not None:
        from superslm.adapters import load_peft

        adapter = load_peft(lora, arch, dict(source.recipe.layer_names(hf=True)), "convert", torch.float32,
                            torch.device("cpu"))
        lora_info = {"name": Path(lora).name, "rank": adapter.rank, "scale": adapter.scale,
                     "sha256": native.sha256_file(Path(lora) / "adapter_model.safetensors")}
    calibrator = None
    if not isinstance(tune_steps, int) or tune_steps < 0:
        raise InvalidArgument(f"tune_steps must be a non-negative integer, got {tune_steps!r}")
    if tune_steps and calibrate in (None, False):
        raise InvalidArgument("--tune-steps tunes GPTQ's int4 scales: it needs --calibrate")
    if tune_steps and n < arch.layers:
        raise InvalidArgument("--tune-steps distils next-token distributions: it needs every layer (no --layers)")
    if calibrate not in (None, False):
        if body != "int4":
            raise InvalidArgument(f"calibration (GPTQ) is for --format int4, not {body}")
        from superslm.calibration import LayerCalibrator

        calibrator = LayerCalibrator(source.path, n, calibrate, int(calibration_tokens), source.parameter_count())
    rotated = rotate and (body in ("int4", "int8") or head in ("int4", "int8"))
    opts = {"format": body, "group": int(group), "rotate": rotate, "seed": int(seed), "layers": n}
    header = {"format": body, "group": int(group) if "int4" in (body, head) else None, "head": head,
              "rotation": {"seed": int(seed)} if rotated else None, "layers": n, "lora": lora_info,
              "source": {"format": source.format, "name": source.path.name, "sha256": source_sha256(source)},
              "int4_layout": INT4_PACKED, "calibration": calibrator.info if calibrator is not None else None}
    # with --layers the MTP block goes with the final norm and the head
    config = {"superslm_format": native.FORMAT_VERSION, "model_type": source.recipe.hf_types[0],
              "arch": (arch if n == arch.layers else replace(arch, mtp=0)).summary(), "layers": n,
              "source_config": _source_config(source)}
    from tqdm import tqdm

    with native.partial_folder(dst, overwrite) as tmp:
        native.write_json(tmp / native.CONFIG, config)
        _write_tokenizer(source, tmp)
        _write_schemas(schemas or {}, tmp)
        writer = _Writer(source, names, opts, adapter, calibrator)
        for i in tqdm(range(n + 1), desc=f"converting to {body}", unit="layer", disable=not progress):
            writer.layer(i) if i < n else writer.globals(head)
        if n == arch.layers and arch.mtp:
            writer.mtp()
        if tune_steps:
            header["calibration"] = dict(header["calibration"], tune=writer.tune(tune_steps, progress))
        native.write_tensors(tmp / native.WEIGHTS, writer.tensors, dict(header, linears=writer.linears))
    return Path(dst)


# --- the command ---------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    """Register the `convert` subcommand on the CLI's subparsers."""
    p = sub.add_parser("convert", help="convert a HF folder or a GGUF file into a SuperSLM folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a Hugging Face folder, a GGUF file, or a known model name (fetched once)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels and calibration (default: the cores this process may use)")
    p.add_argument("dst", help="the folder to write (written atomically)")
    p.add_argument("--format", default="auto", choices=("auto", *BODY_FORMATS),
                   help="linears' format (default: gguf for a GGUF file, int4 otherwise)")
    p.add_argument("--group", type=int, default=128, choices=(32, 64, 128, 256), help="int4 group size (default: 128)")
    p.add_argument("--head", default=None, choices=HEAD_FORMATS, help="the output head's format")
    p.add_argument("--no-rotate", action="store_true", help="no Hadamard rotation of int4/int8 weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotation's random signs")
    p.add_argument("--lora", default=None, metavar="PEFT_FOLDER", help="merge this LoRA adapter first")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (hidden states)")
    p.add_argument("--schema", action="extend", nargs="+", default=[], metavar="NAME=FILE",
                   help="ship a JSON schema under NAME (repeatable)")
    p.add_argument("--calibrate", nargs="?", const=True, default=None, metavar="TEXT_FILE",
                   help="int4 by GPTQ on calibration text (default text: Python's reference docs)")
    p.add_argument("--calibration-tokens", type=int, default=2048, metavar="N",
                   help="calibration tokens (default: 2048)")
    p.add_argument("--tune-steps", type=int, default=0, metavar="N",
                   help="with --calibrate: tune int4 scales end to end for N sequences of 512 tokens")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)


def cmd_convert(ns: argparse.Namespace) -> int:
    schemas: dict[str, str] = {}
    for item in ns.schema:
        name, sep, file = item.partition("=")
        if not sep or not name or not file:
            raise InvalidArgument(f"--schema takes NAME=FILE, not {item!r}")
        schemas[name] = file
    from superslm.hub import resolve_path

    start = time.perf_counter()
    dst = convert(resolve_path(ns.src), ns.dst, format=ns.format, group=ns.group, head=ns.head, rotate=not ns.no_rotate,
                  seed=ns.seed, lora=ns.lora, layers=ns.layers, schemas=schemas, overwrite=ns.force,
                  progress=not ns.quiet and sys.stderr.isatty(), calibrate=ns.calibrate,
                  calibration_tokens=ns.calibration_tokens, tune_steps=ns.tune_steps)
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"{dst}: {size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")
    return 0
