"""`superslm embed`: sentence vectors (or cross-encoder scores) for texts, as JSON lines.

    superslm embed "first text" "second text"                 # all-MiniLM-L6-v2, one JSON line per text
    superslm embed --model FOLDER --file texts.txt --output vectors.npy
    superslm embed --model CROSS_ENCODER --rerank "a query" "doc one" "doc two"
    superslm embed --model model.gguf --pooling last "text"   # a decoder model, last-token pooling

Texts come from the arguments, else --file, else stdin: one text per line, blank lines included, so
that the output's index is the line's (a newline at the end of the input ends the last line).
--output writes exactly the path given (no ".npy" is added).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from superslm.errors import InvalidArgument


def add_parser(sub: Any) -> None:
    """Register the `embed` subcommand on the CLI's subparsers."""
    p = sub.add_parser("embed", help="sentence vectors or cross-encoder scores for texts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="the texts (or use --file)")
    p.add_argument("--model", "-m", default="all-minilm-l6-v2",
                   help="a sentence-transformers or cross-encoder folder, a decoder model, or a known name "
                        "(default: all-minilm-l6-v2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 (the default) or bfloat16")
    p.add_argument("--file", "-f", default=None, help="read texts from this file, one per line ('-': stdin)")
    p.add_argument("--batch", type=int, default=32, help="texts per forward pass (default: 32)")
    p.add_argument("--no-truncate", action="store_true", help="refuse texts longer than max_seq_length")
    # None, not "last": an encoder folder then refuses --pooling given at all (see _check_options)
    p.add_argument("--pooling", default=None, help="decoder models: last or mean (default: last)")
    p.add_argument("--normalize", action="store_true", help="decoder models: L2-normalize the vectors")
    p.add_argument("--rerank", metavar="QUERY", default=None,
                   help="with a cross-encoder: score the texts against QUERY, best first")
    p.add_argument("--top", type=int, default=None, help="with --rerank: print the best TOP only")
    p.add_argument("--output", "-o", default=None,
                   help="write the vectors to this file instead, in .npy format (the path as given)")
    p.add_argument("--info", action="store_true", help="print the model's pooling, dimension and limits, then exit")
    p.set_defaults(func=cmd_embed)


def _texts(ns: argparse.Namespace) -> list[str]:
    if ns.texts:
        return list(ns.texts)
    if ns.file and ns.file != "-":
        try:
            text = Path(ns.file).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidArgument(f"cannot read {ns.file}: {e}") from e
    else:
        text = sys.stdin.read()
    return split_lines(text)


def split_lines(text: str) -> list[str]:
    r"""One text per line, empty ones kept (indices stay line numbers); a final newline adds no line.
    Only "\n" splits (text mode has made "\r\n" one); str.splitlines would also split at \f, \u2028, ..."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _check_options(ns: argparse.Namespace, kind: str) -> None:
    """Refuse options that do nothing for this model kind, rather than ignore them."""
    if ns.rerank is not None and kind != "cross-encoder":
        raise InvalidArgument(f"--rerank needs a cross-encoder; {ns.model} is {_a(kind)} model")
    if kind == "cross-encoder" and ns.rerank is None and not ns.info:
        raise InvalidArgument(f"{ns.model} is a cross-encoder: pass --rerank QUERY")
    if kind != "decoder":
        for given, flag in ((ns.pooling is not None, "--pooling"), (ns.normalize, "--normalize")):
            if given:
                raise InvalidArgument(f"{flag} applies to decoder models only; {ns.model} is {_a(kind)} model "
                                      "(its folder sets pooling and normalization)")
    if ns.top is not None and ns.rerank is None:
        raise InvalidArgument("--top needs --rerank")
    if ns.output is not None and ns.rerank is not None:
        raise InvalidArgument("--output writes vectors; --rerank prints scores")


def _load(ns: argparse.Namespace) -> Any:
    import superslm
    from superslm.encoders import CrossEncoder, Encoder, model_kind

    kind = model_kind(ns.model)
    _check_options(ns, kind)
    if kind == "cross-encoder":
        return CrossEncoder.load(ns.model, device=ns.device, dtype=ns.dtype)
    if kind == "decoder":
        model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype)
        return Encoder.from_model(model, pooling=ns.pooling or "last", normalize=ns.normalize)
    return Encoder.load(ns.model, device=ns.device, dtype=ns.dtype)


def cmd_embed(ns: argparse.Namespace) -> int:
    model = _load(ns)
    if ns.info:
        print(json.dumps(model.info(), indent=2))
        return 0
    texts = _texts(ns)
    truncate = not ns.no_truncate
    if ns.rerank is not None:
        for index, score in model.rank(ns.rerank, texts, top=ns.top, batch=ns.batch, truncate=truncate):
            print(json.dumps({"index": index, "score": score}))
        return 0
    vectors = model.embed_batch(texts, batch=ns.batch, truncate=truncate)
    if ns.output:
        import numpy as np

        # np.save(path) would add ".npy" to a path without it, and the message would name another file
        with open(ns.output, "wb") as f:
            np.save(f, vectors.numpy())
        print(f"wrote {tuple(vectors.shape)} float32 to {ns.output}", file=sys.stderr)
        return 0
    for i, v in enumerate(vectors.tolist()):
        sys.stdout.write(json.dumps({"index": i, "embedding": v}) + "\n")
    return 0
