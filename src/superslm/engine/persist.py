"""Saved sequences: a versioned blob of a sequence's whole state, and its reader.

Layout (version 2), all integers little-endian:

    magic   8 bytes  b"SSLMSEQ\\x00"
    version u32
    length  u64      of the JSON header
    header  JSON     model fingerprint, KV layout, the sequence's state (tokens, computed count,
                     sampler RNG and penalty counts, detokenizer and stop-string state, stats)
    kv      bytes    keys then values of the computed tokens as their pages store them: [layers, tokens,
                     kv_heads, width] (float values, or quantized rows: codes and their scale; the header's
                     `kv_format` names the page format, and a blob restores only into an engine of that format)
    extra   bytes    (version 2) the header's `extra` tensors in its order: a delta-rule model's recurrent
                     states after the computed tokens (conv, ssm)
    sha256  32 bytes of everything before it

A blob of another model, a truncated or corrupted blob, or a future version is refused with its own
error. Every released version stays readable: tests/data keeps a blob of each.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from superslm.errors import StateCorrupted, StateModelMismatch, StateVersionUnsupported

MAGIC = b"SSLMSEQ\x00"
VERSION = 2
_HEAD = struct.Struct("<8sIQ")
_DIGEST = 32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8, "uint8": torch.uint8}
#: numpy twins of the dtypes numpy has (bf16 travels as int16 bit patterns)
_NUMPY = {torch.float32: np.float32, torch.float16: np.int16, torch.bfloat16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8}


@dataclass
class SavedSequence:
    """A parsed blob: the header and the KV tensors of its computed tokens."""

    version: int
    header: dict[str, Any]
    k: torch.Tensor
    v: torch.Tensor
    #: named tensors after the KV (version 2): a delta-rule model's recurrent states
    extra: dict[str, torch.Tensor]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _raw(t: torch.Tensor) -> bytes:
    # bf16 has no numpy dtype: ship the 16-bit patterns
    t = t.contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=_NUMPY[dtype]).copy()).view(dtype).reshape(shape)


def encode(header: dict[str, Any], k: torch.Tensor, v: torch.Tensor,
           extra: dict[str, torch.Tensor] | None = None) -> bytes:
    """The blob of a sequence: header JSON plus its KV tensors and any `extra` named tensors, checksummed."""
    extra = extra or {}
    # values may be stored otherwise than keys (e.g. int8 keys beside 4-bit values): their own shape and dtype
    header = dict(header, kv_shape=list(k.shape), kv_dtype=dtype_name(k.dtype), v_shape=list(v.shape),
                  v_dtype=dtype_name(v.dtype),
                  extra=[[name, list(t.shape), dtype_name(t.dtype)] for name, t in extra.items()])
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    body = _HEAD.pack(MAGIC, VERSION, len(text)) + text + _raw(k) + _raw(v) + b"".join(_raw(t) for t in extra.values())
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes, fingerprint: str) -> SavedSequence:
    """Parse and check a blob against the model it is restored into."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise StateCorrupted("a saved sequence is bytes")
    blob = bytes(blob)
    if len(blob) < _HEAD.size + _DIGEST or blob[:8] != MAGIC:
        raise StateCorrupted("not a saved SuperSLM sequence (bad magic or too short)")
    magic, version, length = _HEAD.unpack_from(blob)
    if version > VERSION or version < 1:
        raise StateVersionUnsupported(f"saved sequence format version {version}; this release reads 1..{VERSION}")
    if hashlib.sha256(blob[:-_DIGEST]).digest() != blob[-_DIGEST:]:
        raise StateCorrupted("saved sequence checksum mismatch (truncated or corrupted)")
    end = _HEAD.size + length
    if end > len(blob) - _DIGEST:
        raise StateCorrupted("saved sequence header runs past its end")
    try:
        header = json.loads(blob[_HEAD.size : end])
        shape = tuple(int(x) for x in header["kv_shape"])
        dtype = _DTYPES[header["kv_dtype"]]
        v_shape = tuple(int(x) for x in header.get("v_shape", shape))  # blobs before v_shape: keys' layout
        v_dtype = _DTYPES[header.get("v_dtype", header["kv_dtype"])]
        extras = [(str(n), tuple(int(x) for x in s), _DTYPES[d]) for n, s, d in header.get("extra", [])]
    except (ValueError, KeyError, TypeError) as e:
        raise StateCorrupted(f"saved sequence header is malformed ({e})") from e
    if header.get("model") != fingerprint:
        raise StateModelMismatch("the sequence was saved from another model (weights, format or dtype differ)")
    if any(d < 0 for _, s, _ in extras for d in s) or min((*shape, *v_shape), default=0) < 0:
        raise StateCorrupted("saved sequence header has a negative dimension")
    size, v_size = _size(shape, dtype), _size(v_shape, v_dtype)
    sizes = [_size(s, d) for _, s, d in extras]
    if end + size + v_size + sum(sizes) != len(blob) - _DIGEST:
        raise StateCorrupted("saved sequence KV size does not match its header")
    k = _tensor(blob[end : end + size], dtype, shape)
    v = _tensor(blob[end + size : end + size + v_size], v_dtype, v_shape)
    at, out = end + size + v_size, {}
    for (name, s, d), n in zip(extras, sizes):
        out[name] = _tensor(blob[at : at + n], d, s)
        at += n
    return SavedSequence(version, header, k, v, out)


def _size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


#: the integer fields of a saved sequence and their least value (all below 2**62)
_COUNTS = {"max_tokens": 1, "request_max_tokens": 1, "cached": 0, "preemptions": 0, "layers_run": 0}


def _count(value: Any, least: int) -> bool:
    return type(value) is int and least <= value < 1 << 62


def check_header(header: dict[str, Any]) -> dict[str, Any]:
    """The saved sequence's state, its plain fields checked by type and range (StateCorrupted otherwise): a blob
    whose checksum was recomputed can hold anything, and what the parts' `from_state` reject comes later."""
    if not _count(header.get("page_size"), 1):
        raise StateCorrupted(f"saved sequence page_size is {header.get('page_size')!r}")
    st = header.get("sequence")
    if not isinstance(st, dict):
        raise StateCorrupted("saved sequence has no state")
    for name, least in _COUNTS.items():
        if not _count(st.get(name), least):
            raise StateCorrupted(f"saved sequence field {name} is {st.get(name)!r}")
    for name in ("prompt", "output"):
        ids = st.get(name)
        if not isinstance(ids, list) or not all(_count(t, 0) for t in ids):
            raise StateCorrupted(f"saved sequence {name} is not a list of token ids")
    if not st["prompt"]:
        raise StateCorrupted("saved sequence has an empty prompt")
    if len(st["output"]) >= st["max_tokens"] or st["max_tokens"] > st["request_max_tokens"]:
        raise StateCorrupted(f"saved sequence has {len(st['output'])} of max_tokens {st['max_tokens']} (of the "
                             f"request's {st['request_max_tokens']})")
    if st["cached"] > len(st["prompt"]) + len(st["output"]):
        raise StateCorrupted(f"saved sequence cached {st['cached']} tokens of {len(st['prompt'])} + output")
    if st.get("salt") is not None and not isinstance(st["salt"], str):
        raise StateCorrupted("saved sequence salt is not text")
    for name in ("sampler", "decoder", "stops"):
        if not isinstance(st.get(name), dict):
            raise StateCorrupted(f"saved sequence {name} state is missing")
    return st


def sequence_state(seq: Any) -> dict[str, Any]:
    """The plain-data state of an engine Sequence (everything but its KV)."""
    req = seq.request
    return {
        "prompt": list(seq.prompt),
        "output": list(seq.output),
        "max_tokens": seq.max_tokens,
        "request_max_tokens": req.max_tokens,
        "salt": req.salt,
        # the adapter by name and content: restore() needs the same one handed back
        "adapter": None if req.adapter is None else {"name": req.adapter.name,
                                                      "fingerprint": req.adapter.fingerprint},
        "cached": seq.cached,
        "preemptions": seq.preemptions,
        "layers_run": seq.layers_run,
        "sampler": seq.sampler.state(),
        "decoder": seq.decoder.state(),
        "stops": seq.stops.state(),
        "grammar": seq.grammar.state() if seq.grammar is not None else None,
        "anti": seq.anti.state() if seq.anti is not None else None,
        # prompt_logprobs not yet delivered: [token, logprob, rank, [[id, logprob], ...]] per position (or None)
        "prompt_logprobs": None if seq.prompt_logprobs is None else [
            None if lp is None else [lp.token, lp.logprob, lp.rank, [list(t) for t in lp.top]]
            for lp in seq.prompt_logprobs],
    }


def prompt_logprobs_from_state(data: Any) -> list[Any] | None:
    """`sequence_state`'s prompt_logprobs back as TokenLogprobs (None: delivered, or never asked for)."""
    from superslm.sampling import TokenLogprobs

    if data is None:
        return None
    return [None if x is None else TokenLogprobs(int(x[0]), float(x[1]), int(x[2]),
                                                 tuple((int(i), float(v)) for i, v in x[3])) for x in data]
