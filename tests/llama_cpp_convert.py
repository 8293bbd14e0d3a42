"""llama.cpp's own HF -> GGUF converter, for tests: taken once from the llama-cpp-python source distribution on
PyPI (convert_hf_to_gguf.py, its conversion/ package and the gguf-py it ships with) into the superslm cache.

Our tiny test tokenizers are byte-level BPEs that llama.cpp's table of pre-tokenizer hashes does not know:
the converter is run with that lookup answering "default" (the tokenizer is not what these tests check).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from superslm import hub

VERSION = "0.3.36"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

_RUN = """
import sys
sys.path.insert(0, {gguf!r}); sys.path.insert(0, {root!r})
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def converter() -> Path:
    """The folder holding convert_hf_to_gguf.py (fetched from PyPI and unpacked on first use)."""
    root = hub.cache_dir() / f"llama.cpp-{VERSION}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        partial = Path(tempfile.mkdtemp(dir=root.parent, prefix=root.name + ".partial-"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rest = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rest and any(rest == p or rest.startswith(p) for p in _PARTS) and (m.isfile() or m.isdir()):
                    m.name = rest
                    tar.extract(m, partial, filter="data")
        try:
            os.replace(partial, root)  # whole or not at all: a half-unpacked converter is never used
        except OSError:
            if not (root / "convert_hf_to_gguf.py").is_file():  # another process won the race, else a real error
                raise
    return root


def convert(folder: Path, out: Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """llama.cpp's GGUF of a HF folder, written to `out` (`extra`: more converter options, e.g. --no-mtp)."""
    root = converter()
    code = _RUN.format(gguf=str(root / "gguf-py"), root=str(root), script=str(root / "convert_hf_to_gguf.py"),
                       args=[str(folder), "--outfile", str(out), "--outtype", outtype, *extra])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{res.stderr[-3000:]}")
    return out
