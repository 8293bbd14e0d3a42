"""`hf:OWNER/REPO[/PATH][@REVISION]`: a Hugging Face Hub repository fetched and converted once.

The repository (only what a model needs: config, safetensors, tokenizer and template files, or
the one GGUF file PATH names) is downloaded through huggingface_hub into its usual cache, then
converted (`superslm.convert`) into

    $SUPERSLM_CACHE/hf/OWNER--REPO[--PATH]/COMMIT/FORMAT_KEY

atomically (a stopped conversion is redone). `refs/REVISION` next to the commits records which
commit a branch or tag resolved to, so later runs load the conversion without the network (and
without the hub cache). Online, a branch is resolved again and a new commit converted once.

huggingface_hub is an optional dependency (the `hub` extra: pip install 'superslm[hub]').
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from superslm import hub
from superslm.errors import FetchError, InvalidArgument

PREFIX = "hf:"
#: files of a model folder we download (PATH/ prefixed for a sub-folder)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
               "model.safetensors", "model.safetensors.index.json", "model-*.safetensors")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: quant= of `superslm.load` -> the conversion's format (None/"none": dense, as the source holds it)
_FORMAT_OF_QUANT = {"auto": "auto", "gguf": "gguf", "int4": "int4", "int8": "int8", "bf16": "bf16",
                    "none": "dense", None: "dense"}


@dataclass(frozen=True)
class HubModel:
    """A parsed `hf:` name."""

    repo: str  # OWNER/REPO
    path: str  # a sub-folder or a .gguf file inside the repository ("" for the root)
    revision: str  # a branch, a tag or a commit

    @property
    def key(self) -> str:
        """The cache folder name of the repository (and path)."""
        return "--".join([*self.repo.split("/"), *([self.path.replace("/", "--")] if self.path else [])])

    def patterns(self) -> list[str]:
        if self.path.endswith(".gguf"):
            return [self.path]
        prefix = f"{self.path}/" if self.path else ""
        return [prefix + f for f in MODEL_FILES]


def parse(name: str) -> HubModel:
    """`hf:OWNER/REPO[/PATH][@REVISION]` -> HubModel (InvalidArgument when malformed)."""
    if not name.startswith(PREFIX):
        raise InvalidArgument(f"{name!r} is not an hf: name")
    body, at, revision = name[len(PREFIX):].partition("@")
    parts = body.split("/")
    if len(parts) < 2 or not all(_PART.fullmatch(p) and ".." not in p for p in parts):
        raise InvalidArgument(f"{name!r}: expected hf:OWNER/REPO[/FOLDER or /FILE.gguf][@REVISION]")
    if at and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", revision) or ".." in revision:
        raise InvalidArgument(f"{name!r}: malformed revision {revision!r}")
    return HubModel("/".join(parts[:2]), "/".join(parts[2:]), revision or "main")


def format_key(format: str, group: int = 128, head: str | None = None, rotate: bool = True, seed: int = 0) -> str:
    """The cache folder name of one conversion's options (the folder format's version included)."""
    from superslm.formats.native import FORMAT_VERSION

    parts = [f"v{FORMAT_VERSION}", format]
    if format in ("auto", "int4"):
        parts.append(f"g{group}")
    if format in ("auto", "int4", "int8"):
        parts.append(f"rot{seed}" if rotate else "norot")
    if head is not None:
        parts.append(f"head-{head}")
    return "-".join(parts)


def cache_root() -> Path:
    """Where converted hub models live: $SUPERSLM_CACHE/hf (see superslm.hub.cache_dir)."""
    return hub.cache_dir() / "hf"


def _snapshot(model: HubModel, offline: bool, progress: bool) -> Path:
    """The local snapshot folder of the repository at `model.revision` (downloaded if needed)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError as e:
        raise FetchError("hf: models need huggingface_hub: pip install 'superslm[hub]'") from e
    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        return Path(snapshot_download(model.repo, revision=model.revision, allow_patterns=model.patterns(),
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None, local_files_only=offline))
    except Exception as e:  # huggingface_hub's errors: offline, not cached, not found, HTTP
        raise FetchError(f"could not fetch {model.repo}@{model.revision}: {type(e).__name__}: {e}") from e
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()


def _write_ref(path: Path, commit: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ref-")
    with os.fdopen(fd, "w") as f:
        f.write(commit)
    os.replace(tmp, path)  # atomic: a reader sees the old commit or the new one


def fetch_converted(
    name: str,
    quant: str | None = "auto",
    group: int = 128,
    head: str | None = None,
    rotate: bool = True,
    seed: int = 0,
    progress: bool | None = None,
    offline: bool | None = None,
) -> Path:
    """The converted folder of an `hf:` name, fetched and converted on first use.

    `quant` (as `superslm.load`'s) picks the format: auto (gguf for a GGUF file, else int4),
    gguf, int4, int8, bf16, or None/"none" (dense). `offline` (default: huggingface_hub's
    HF_HUB_OFFLINE) never touches the network: the recorded conversion of the revision is used,
    else the hub cache. Raises FetchError when neither has it. `progress` (default: when stderr is a
    terminal) shows huggingface_hub's download bars and the conversion's.
    """
    model = parse(name)
    progress = sys.stderr.isatty() if progress is None else progress
    if quant not in _FORMAT_OF_QUANT:
        raise InvalidArgument(f"unknown quant {quant!r} for an hf: model")
    fmt = _FORMAT_OF_QUANT[quant]
    if offline is None:
        try:
            from huggingface_hub import constants

            offline = bool(getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)())
        except ImportError:
            offline = False
    root = cache_root() / model.key
    fkey = format_key(fmt, group, head, rotate, seed)
    ref = root / "refs" / model.revision.replace("/", "%2F")
    recorded = ref.read_text().strip() if ref.is_file() else ""
    if _COMMIT.fullmatch(model.revision):
        recorded = model.revision
    # a pinned commit, or offline: the conversion we made before is the answer, no hub needed
    if recorded and (offline or recorded == model.revision) and (root / recorded / fkey).is_dir():
        return root / recorded / fkey
    snapshot = _snapshot(model, offline, progress)
    commit = snapshot.name
    dst = root / commit / fkey
    if not dst.is_dir():
        src = snapshot / model.path if model.path else snapshot
        if not src.exists():
            raise FetchError(f"{model.repo}@{commit} has no {model.path or 'model files'}")
        from superslm.convert import convert

        try:
            convert(src, dst, format=fmt, group=group, head=head, rotate=rotate, seed=seed, progress=progress)
        except InvalidArgument:
            if not dst.is_dir():  # not "another process converted it first"
                raise
    if model.revision != commit:
        _write_ref(ref, commit)
    return dst
