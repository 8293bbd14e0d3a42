"""A GGUF file's tokenizer, kept once built: the backend's tokenizer.json beside the special-token facts.

Building Gemma 3's 262k-piece vocabulary means deriving 515k merges in Python (~1.2 s, and ~60 MB of
freed small objects the process keeps); reading the built tokenizer.json back takes ~0.5 s and leaves
only the Rust tokenizer. The loader names the folder by the metadata section's digest (formats.gguf)
and `BUILD`, so a changed file or a changed builder never meets an old entry.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer as Backend

#: bump when gguf_vocab builds a different tokenizer from the same metadata
BUILD = 1
_FACTS = "facts.json"
_BACKEND = "tokenizer.json"


def cache_key(metadata_digest: str) -> str:
    """The entry's folder name: the metadata, this builder and the tokenizers library that wrote it."""
    return f"{metadata_digest[:32]}-b{BUILD}-t{tokenizers.__version__}"


def read(folder: Path) -> tuple[Backend, dict[str, Any]] | None:
    """(backend, facts) of a complete entry, or None (absent, partial or unreadable: rebuild it)."""
    try:
        facts = json.loads((folder / _FACTS).read_text(encoding="utf-8"))
        if facts.get("build") != BUILD:
            return None
        return Backend.from_file(str(folder / _BACKEND)), facts
    except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt, never an error
        return None


def write(folder: Path, backend: Backend, facts: dict[str, Any]) -> None:
    """Store an entry atomically (a temporary folder renamed into place); a failure only skips the cache."""
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
        backend.save(str(tmp / _BACKEND))
        # facts last: an entry without them is never read
        (tmp / _FACTS).write_text(json.dumps({**facts, "build": BUILD}), encoding="utf-8")
        if folder.exists():  # a damaged entry (read() refused it): replace it
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        tmp = None
    except OSError:
        pass  # read-only or full disk, or another process stored it first: the next load builds again
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
