"""`Tokenizer`: one face over a Hugging Face tokenizer.json or a GGUF vocabulary.

Encoding and decoding run in the Rust `tokenizers` library; this class adds what the engine needs
around it: the special ids (bos, eos, stop ids), the chat template, and the raw bytes each token
contributes to text (for grammars and the streaming detokenizer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from superslm.errors import InvalidArgument, ModelNotFound, TokenizerError, TokenOutOfRange
from superslm.tokenizer import gguf_cache
from superslm.tokenizer.gguf_vocab import build_from_gguf, bytes_to_unicode, has_lean_backend, template_processor

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: the constructor's arguments a GGUF build decides (stop_ids apart: a set)
_FACTS = ("kind", "bos_id", "eos_id", "pad_id", "unk_id", "eot_id", "eom_id", "add_bos", "add_eos", "chat_template")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path.name}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.name} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """A chat template: a string, or a list of named templates of which we take "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _decoder_kind(backend: Backend) -> str:
    """How tokens turn into bytes: "byte_level", "sentencepiece" or "other" (read off the decoder)."""
    dec = backend.decoder
    if dec is None:
        return "other"
    spec = dec.__getstate__()
    spec = spec.decode("utf-8") if isinstance(spec, bytes) else str(spec)
    if '"ByteLevel"' in spec:
        return "byte_level"
    if '"ByteFallback"' in spec or '"Metaspace"' in spec or "\u2581" in spec:
        return "sentencepiece"
    return "other"


#: texts longer than this (characters) are encoded with the GIL released
LONG_TEXT = 4096

class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Build it with `Tokenizer.from_folder` (a Hugging Face folder) or `Tokenizer.from_gguf`
    (a GGUF file's metadata); the constructor takes an already configured `tokenizers.Tokenizer`.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        kind: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        stop_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.kind = kind or _decoder_kind(backend)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.eot_id = eot_id
        self.eom_id = eom_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        stops = set(stop_ids) | {i for i in (eos_id, eot_id, eom_id) if i is not None}
        self.stop_ids: frozenset[int] = frozenset(i for i in stops if 0 <= i < self.vocab_size)
        added = backend.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._all_bytes: list[bytes] | None = None
        # SentencePiece byte-fallback tokens <0xNN> (the streaming detokenizer treats runs of them apart)
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if self.kind == "sentencepiece" else ()
        self.byte_fallback_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None and i not in added)
        self._pieces: dict[int, str] = {}

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], cache: str | Path | None = None, lean: bool = True) -> Tokenizer:
        """Build the tokenizer a GGUF file describes, from its metadata (`GGUFFile(path).metadata`).

        Supports `tokenizer.ggml.model` "gpt2" (byte-level BPE; the split regex is chosen by
        `tokenizer.ggml.pre`, an unknown one is refused) and "llama" (SentencePiece BPE with byte
        fallback; Gemma architectures get Gemma's whitespace handling). Raises TokenizerError.
        `cache`: a folder for this metadata (the loader names it by `GGUFFile.metadata_digest()` and
        `gguf_cache.cache_key`): read when complete, else written after the build.
        `lean`: a Gemma vocabulary runs on `spm_bpe.SentencePieceBPE` (plain Python, ~8 MB where
        `tokenizers` takes ~100 MB for Gemma 3; built in well under a second, so never cached); False
        keeps the `tokenizers` backend (what `superslm convert` saves as tokenizer.json).
        """
        lean = lean and has_lean_backend(metadata)
        folder = None if cache is None or lean else Path(cache)
        hit = None if folder is None else gguf_cache.read(folder)
        if hit is not None:
            backend, facts = hit
            return cls(backend, **{k: facts.get(k) for k in _FACTS}, stop_ids=facts.get("stop_ids", ()))
        v = build_from_gguf(metadata, lean=lean)
        facts = {k: getattr(v, k) for k in _FACTS}
        if folder is not None:
            gguf_cache.write(folder, v.backend, {**facts, "stop_ids": sorted(v.stop_ids)})
        return cls(v.backend, **facts, stop_ids=v.stop_ids)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face folder.

        Reads tokenizer.json (required), and where present tokenizer_config.json,
        special_tokens_map.json, generation_config.json and chat_template.jinja/.json.
        Raises ModelNotFound for a missing folder, TokenizerError for unusable files.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelNotFound(f"no folder at {folder}")
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"cannot load {path}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        smap = _read_json(folder / "special_tokens_map.json")
        gen = _read_json(folder / "generation_config.json")

        def special_id(name: str) -> int | None:
            text = _token_text(config.get(name)) or _token_text(smap.get(name))
            return backend.token_to_id(text) if text is not None else None

        bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
        pad_id, unk_id = special_id("pad_token"), special_id("unk_token")
        gen_eos = gen.get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or [] if isinstance(i, int)]
        if bos_id is None and isinstance(gen.get("bos_token_id"), int):
            bos_id = gen["bos_token_id"]
        if eos_id is None and gen_eos_ids:
            eos_id = gen_eos_ids[0]
        if pad_id is None and isinstance(gen.get("pad_token_id"), int):
            pad_id = gen["pad_token_id"]

        if backend.post_processor is None:
            # no post-processor in tokenizer.json: the config's flags say what to add
            add_bos = bool(config.get("add_bos_token")) and bos_id is not None
            add_eos = bool(config.get("add_eos_token")) and eos_id is not None
            bos_text = backend.id_to_token(bos_id) if add_bos and bos_id is not None else None
            eos_text = backend.id_to_token(eos_id) if add_eos and eos_id is not None else None
            backend.post_processor = template_processor(
                (bos_text, bos_id) if bos_text is not None and bos_id is not None else None,
                (eos_text, eos_id) if eos_text is not None and eos_id is not None else None,
            )
        else:
            # tokenizer.json's post-processor decides (transformers 5 ignores the config's flags then);
            # read what it adds off an empty text
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
            add_eos = eos_id is not None and probe[-1:] == [eos_id] and (len(probe) > 1 or not add_bos)

        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _pick_template(_read_json(folder / "chat_template.json").get("chat_template"))
        if template is None:
            template = _pick_template(config.get("chat_template"))
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            unk_id=unk_id,
            stop_ids=gen_eos_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=template,
        )

    # --- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the model's BOS/EOS are added as configured.

        Special tokens written in the text (like "<|im_start|>") become their ids either way.
        """
        if not isinstance(text, str):
            raise InvalidArgument(f"text must be a str, not {type(text).__name__}")
        if len(text) > LONG_TEXT:
            # the Rust library's encode holds the GIL throughout (a 4 MB chat stalled a server's every other
            # request for seconds); its encode_batch releases it, with the same ids
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` over many texts at once (parallel in the Rust library)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise InvalidArgument(f"texts must be str, not {type(t).__name__}")
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        try:
            out = [int(i) for i in ids]
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"token ids must be integers: {e}") from e
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            bad = next(i for i in out if not 0 <= i < self.vocab_size)
            raise TokenOutOfRange(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; broken UTF-8 comes out as U+FFFD."""
        return self.backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """decode([token_id]) with special tokens kept, remembered per id: the streaming detokenizer
        decodes the last emitted token again at every step (its context for the next)."""
        text = self._pieces.get(token_id)
        if text is None:
            self._check_ids([token_id])  # remembers ids of the vocabulary only
            text = self._pieces[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    # --- vocabulary -----------------------------------------------------------------------------

    def id_to_token(self, i: int) -> str:
        """The vocabulary's spelling of token `i` (e.g. "Ġthe", "▁the", "<0x0A>")."""
        tok = self.backend.id_to_token(self._check_ids([i])[0])
        if tok is None:
            raise TokenOutOfRange(f"token id {i} has no token")
        return tok

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it, or None."""
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, or None."""
        return self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, or None."""
        return self.backend.id_to_token(self.eos_id) if self.eos_id is not None else None

    def _bytes_of(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode("utf-8")
        tok = self.backend.id_to_token(i)
        if tok is None:
            return b""
        if self.kind == "byte_level":
            inv = _byte_decoder()
            if all(c in inv for c in tok):
                return bytes(inv[c] for c in tok)
            return tok.encode("utf-8")
        if self.kind == "sentencepiece":
            m = _BYTE_TOKEN.fullmatch(tok)
            if m:
                return bytes([int(m.group(1), 16)])
            return tok.replace("\u2581", " ").encode("utf-8")
        return self.backend.decode([i], skip_special_tokens=False).encode("utf-8")

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` contributes to text.

        A byte-fallback token <0xNN> gives that byte, "▁" gives a space, byte-level BPE tokens give
        their bytes (a piece of a UTF-8 character possibly), added tokens their text.
        """
        i = self._check_ids([i])[0]
        if self._all_bytes is not None:
            return self._all_bytes[i]
        return self._bytes_of(i)

    def all_token_bytes(self) -> list[bytes]:
        """`token_bytes(i)` for every id, computed once (for grammar engines)."""
        if self._all_bytes is None:
            self._all_bytes = [self._bytes_of(i) for i in range(self.vocab_size)]
        return self._all_bytes

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    if not _BYTE_DECODER:
        _BYTE_DECODER.update({c: b for b, c in bytes_to_unicode().items()})
    return _BYTE_DECODER
