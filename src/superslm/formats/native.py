"""SuperSLM's own model folder (what `superslm convert` writes): the files, their manifest, atomicity.

A converted folder holds

    config.json         {"superslm_format": 1, "model_type", "arch", "layers", "source_config"}
    model.safetensors   every tensor (64-byte aligned), memory-mapped at load; `__metadata__["superslm"]` is the
                        versioned JSON header (format, group size, rotation seed, source sha256, and
                        per linear the metadata its runtime format needs to rebuild it)
    tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja (as present)
    schemas/NAME.json   named JSON schemas
    manifest.json       size and sha256 of every other file; written last

This module knows files, not models: it writes a folder atomically (`partial_folder`: everything goes
into a hidden sibling that is renamed into place once its manifest is written, so a stopped
conversion never leaves a folder at the destination) and reads one back verified (`read_folder`:
a missing manifest, a missing, extra, resized or modified file is a FormatError).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from superslm.errors import FormatError, InvalidArgument, ModelIntegrityError, ModelNotFound

#: version of the folder layout and header; a reader refuses other versions
FORMAT_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
#: key of the JSON header in the safetensors `__metadata__`
HEADER_KEY = "superslm"
_PARTIAL = ".partial-"
#: ".NAME.partial-PID-HEX8", as partial_folder names them
_PARTIAL_NAME = re.compile(r"^\..+\.partial-(\d+)-[0-9a-f]{8}$")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_native(path: str | Path) -> bool:
    """Whether `path` is a folder written by `superslm convert` (complete or not: its config says so)."""
    cfg = Path(path) / CONFIG
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and "superslm_format" in data


# --- writing --------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    """JSON with sorted keys and a trailing newline (stable bytes, stable hashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


#: safetensors dtype names of the dtypes we store
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
#: every tensor starts at a multiple of this many bytes of the file (so of the memory map): the int8
#: CPU kernel segfaults on codes that are only 8-byte aligned (measured, torch 2.13)
ALIGN = 64
#: names of the filler tensors that keep that alignment (safetensors allows no holes between tensors)
PAD_PREFIX = "__pad__."


def _entry(dtype: str, shape: list[int], offset: int, nbytes: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> None:
    """One safetensors file, `header` as JSON in its metadata, every tensor ALIGN-aligned (readable by
    any safetensors reader; the filler tensors are named PAD_PREFIX + n)."""
    entries: dict[str, Any] = {"__metadata__": {HEADER_KEY: json.dumps(dict(header, superslm_format=FORMAT_VERSION),
                                                                     sort_keys=True)}}
    data: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise InvalidArgument(f"tensor {name}: dtype {t.dtype} cannot be stored")
        pad = -offset % ALIGN
        if pad:
            entries[f"{PAD_PREFIX}{len(data)}"] = _entry("U8", [pad], offset, pad)
            data.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        t = t.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        entries[name] = _entry(_ST_DTYPES[t.dtype], list(t.shape), offset, nbytes)
        data.append(t)
        offset += nbytes
    js = json.dumps(entries, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % ALIGN)  # whitespace padding: the data section starts aligned too
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(js)))
        f.write(js)
        for t in data:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def _files(folder: Path) -> list[str]:
    """Relative paths of the folder's files (dotfiles ignored), the manifest excluded."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != MANIFEST and not any(part.startswith(".") for part in rel.split("/")):
            out.append(rel)
    return out


def write_manifest(folder: Path) -> dict[str, Any]:
    """Hash every file of `folder` (synced to disk first) into its manifest.json; returns the manifest."""
    files = {}
    for rel in _files(folder):
        path = folder / rel
        with path.open("rb") as f:
            os.fsync(f.fileno())
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"superslm_format": FORMAT_VERSION, "files": files}
    write_json(folder / MANIFEST, manifest)
    with (folder / MANIFEST).open("rb") as f:
        os.fsync(f.fileno())
    return manifest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_partials(dst: Path) -> list[Path]:
    """Partial folders beside `dst` (of any destination in its folder) left by conversions whose process is
    gone (killed, crashed): a killed conversion's folder goes with the next one there, whatever its target."""
    out = []
    for p in dst.parent.glob(f".*{_PARTIAL}*"):
        m = _PARTIAL_NAME.match(p.name)
        if m is not None and p.is_dir() and not _pid_alive(int(m.group(1))):
            out.append(p)
    return out


@contextlib.contextmanager
def partial_folder(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty hidden folder next to `dst`; on a clean exit write its manifest and rename it to
    `dst` (replacing an existing `dst` only with `overwrite`); on an exception remove it.

    Stale partial folders of `dst` (their process is gone) are removed first: a stopped conversion
    is redone, never resumed or loaded.
    """
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise InvalidArgument(f"{dst} already exists (pass overwrite / --force to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    for p in stale_partials(dst):
        shutil.rmtree(p, ignore_errors=True)
    tmp = dst.parent / f".{dst.name}{_PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        write_manifest(tmp)
        old = None
        if overwrite and dst.exists():
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            dst.rename(old)
        try:
            tmp.rename(dst)
        except OSError as e:
            if dst.exists():  # another conversion finished first: keep theirs
                raise InvalidArgument(f"{dst} appeared while converting (another conversion?)") from e
            raise
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:  # --force over a file (or a link): rmtree would leave it, hidden, beside the new folder
                with contextlib.suppress(OSError):
                    old.unlink()
        with contextlib.suppress(OSError):  # make the rename itself durable
            fd = os.open(dst.parent, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- reading --------------------------------------------------------------------------------------


@dataclass
class NativeFolder:
    """A verified converted folder: its config, the weights' JSON header and memory-mapped tensors."""

    path: Path
    config: dict[str, Any]
    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]


def verify_folder(folder: str | Path) -> dict[str, Any]:
    """Check every file of `folder` against its manifest (size and sha256); returns the manifest.
    FormatError names the first problem: no manifest (a stopped conversion), a file missing, added,
    resized or modified."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ModelIntegrityError(f"{folder}: incomplete conversion (no {MANIFEST}); run `superslm convert` again")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        version = manifest["superslm_format"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: malformed manifest ({e})") from e
    if version != FORMAT_VERSION:
        raise FormatError(f"{folder}: converted folder format {version!r}, this SuperSLM reads {FORMAT_VERSION}")
    if not isinstance(files, dict):
        raise FormatError(f"{path}: malformed manifest (files is not an object)")
    extra = sorted(set(_files(folder)) - set(files))
    if extra:
        raise ModelIntegrityError(f"{folder}: file {extra[0]} is not part of the conversion (not in {MANIFEST})")
    for rel, want in sorted(files.items()):
        p = folder / rel
        if not p.is_file():
            raise ModelIntegrityError(f"{folder}: {rel} is missing (listed in {MANIFEST})")
        try:
            size, digest = int(want["size"]), str(want["sha256"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: malformed entry for {rel} ({e})") from e
        if p.stat().st_size != size:
            raise ModelIntegrityError(f"{folder}: {rel} has {p.stat().st_size} bytes, the manifest says {size}")
        if sha256_file(p) != digest:
            raise ModelIntegrityError(f"{folder}: {rel} was modified (sha256 differs from {MANIFEST})")
    return manifest


def read_folder(folder: str | Path, verify: bool = True) -> NativeFolder:
    """Open a converted folder: verified against its manifest (unless `verify` is False), config and
    header parsed, tensors memory-mapped (no copy: they share the file's pages)."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFound(f"no converted model folder at {folder}")
    manifest = verify_folder(folder) if verify else {}
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{folder / CONFIG}: unreadable ({e})") from e
    if not isinstance(config, dict) or config.get("superslm_format") != FORMAT_VERSION:
        raise FormatError(f"{folder / CONFIG}: not a converted folder of format {FORMAT_VERSION}")
    try:
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            header = json.loads((f.metadata() or {})[HEADER_KEY])
            tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(PAD_PREFIX)}
    except FormatError:
        raise
    except Exception as e:  # safetensors raises its own error types; a missing key or bad JSON too
        raise FormatError(f"{folder / WEIGHTS}: not a converted weights file ({e})") from e
    if not isinstance(header, dict) or header.get("superslm_format") != FORMAT_VERSION:
        raise FormatError(f"{folder / WEIGHTS}: header of another format version")
    # a file written elsewhere may be unaligned: copy only those tensors (ours never are)
    tensors = {k: t if t.data_ptr() % ALIGN == 0 else t.clone() for k, t in tensors.items()}
    return NativeFolder(folder, config, header, tensors, manifest)
