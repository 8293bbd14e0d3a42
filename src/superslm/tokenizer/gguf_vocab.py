"""GGUF tokenizer metadata -> a `tokenizers.Tokenizer` backend plus the special-token facts.

A GGUF stores no tokenizer.json, only llama.cpp's keys (`tokenizer.ggml.*`). We rebuild the
tokenizer the file describes: byte-level BPE ("gpt2", pre-tokenizer picked by `tokenizer.ggml.pre`)
or SentencePiece BPE with byte fallback ("llama", Gemma's whitespace handling by architecture).
The result is built to tokenize exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from superslm.errors import TokenizerError

# llama.cpp's token types (gguf TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer splits, as the original tokenizer.json files spell them ------------------------

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM = (
    "[\r\n]",
    # non-raw: a few code points are written as escapes, since NFC would fold them into others
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)
_BLOOM = (r" ?[^(\s|.,!?…。，、।۔،)]+",)


@dataclass(frozen=True)
class _PreType:
    """How one `tokenizer.ggml.pre` value splits text before the BPE merges run."""

    splits: tuple[str, ...] = ()  # regexes applied in turn, matches and gaps both kept
    digits: bool = False  # every digit its own piece first (StarCoder-style vocabularies)
    gpt2_regex: bool = False  # ByteLevel's own GPT-2 regex after the splits
    ignore_merges: bool = False  # a word already in the vocabulary is taken whole
    add_bos: bool = False  # llama.cpp's default when the file sets no add_bos_token


_GPT2_PRE = _PreType(gpt2_regex=True)
_PRE_TYPES: dict[str, _PreType] = {}
for _names, _pre in (
    (
        "default gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion granite-docling exaone4",
        _GPT2_PRE,
    ),
    (
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        _PreType(digits=True, gpt2_regex=True),
    ),
    (
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _PreType(splits=(_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    ("dbrx smaug-bpe glm4 chatglm-bpe", _PreType(splits=(_LLAMA3,))),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", _PreType(splits=(_QWEN2,))),
    ("qwen35", _PreType(splits=(_QWEN35,))),
    ("tekken", _PreType(splits=(_TEKKEN,), ignore_merges=True, add_bos=True)),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", _PreType(splits=(_GPT4O,))),
    ("deepseek-llm", _PreType(splits=_DEEPSEEK_LLM)),
    ("deepseek-coder", _PreType(splits=_DEEPSEEK_CODER)),
    ("deepseek-v3", _PreType(splits=_DEEPSEEK_V3)),
    ("falcon", _PreType(splits=_FALCON)),
    ("poro-chat bloom gpt3-finnish", _PreType(splits=_BLOOM)),
    ("viking", _PreType(splits=(*_BLOOM, r"\p{N}"))),
):
    for _name in _names.split():
        _PRE_TYPES[_name] = _pre

#: the `tokenizer.ggml.pre` values we can build
KNOWN_PRE_TYPES = frozenset(_PRE_TYPES)

# Architectures whose SentencePiece vocabulary uses Gemma's whitespace handling: spaces become "▁"
# in a normalizer (no prefix space), and tokens of only spaces are stored as real spaces.
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})

# Token texts llama.cpp treats as end-of-generation even when the file names no eot/eom id.
_EOT_TEXTS = tuple(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> [EOT] "
    "<｜end▁of▁sentence｜> <end_of_utterance>".split()
)
_EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> <|endoftext|> "
    "<|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance>".split()
)


@dataclass
class GGUFVocab:
    """What `build_from_gguf` found: the backend and the special-token facts the Tokenizer needs."""

    backend: Backend
    kind: str  # "byte_level" or "sentencepiece"
    tokens: list[str]  # the file's spelling of every token, by id
    token_type: list[int]
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    chat_template: str | None = None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _get_list(md: Mapping[str, Any], key: str) -> list[Any] | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or (not isinstance(value, Sequence) and not hasattr(value, "tolist")):
        raise TokenizerError(f"GGUF metadata {key} is not an array")
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _get_id(md: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    value = int(value)
    # llama.cpp ignores an out-of-range special id (with a warning); so do we
    return value if 0 <= value < n_vocab else None


def template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """BOS/EOS around each sequence, as transformers' update_post_processor writes it."""
    single = (f"{bos[0]}:0 " if bos else "") + "$A:0" + (f" {eos[0]}:0" if eos else "")
    pair = single + (f" {bos[0]}:1" if bos else "") + " $B:1" + (f" {eos[0]}:1" if eos else "")
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _byte_level_model(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[Backend, list[str], bool]:
    pre_name = md.get("tokenizer.ggml.pre") or "default"
    pre = _PRE_TYPES.get(pre_name)
    if pre is None:
        raise TokenizerError(
            f"unknown GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); known: {sorted(KNOWN_PRE_TYPES)}"
        )
    merges_raw = _get_list(md, "tokenizer.ggml.merges")
    if merges_raw is None:
        raise TokenizerError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    spelled: list[str] = []
    for i, tok in enumerate(tokens):
        # Added tokens stay literal (they match raw text); a normal token outside the byte alphabet
        # is respelled so the BPE model can reach it.
        if types[i] not in (CONTROL, USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        spelled.append(tok)
        if vocab.setdefault(tok, i) != i:
            raise TokenizerError(f"duplicate token {tok!r} in GGUF vocabulary (ids {vocab[tok]} and {i})")
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        cut = m.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"malformed GGUF merge {m!r}")
        merges.append((m[:cut], m[cut + 1 :]))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    backend = Backend(model)
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps += [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.gpt2_regex))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend, spelled, pre.add_bos


def _spm_merges(tokens: list[str], vocab: dict[str, int], scores: list[float] | None) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    Ranked best-first by the merged token's score (file order when `scores` is None: Gemma's scores
    do not follow its merge order), then by longer left piece, as transformers ranks them.
    """
    merges: list[tuple[str, str]] = []
    owners: list[int] = []
    for i, tok in enumerate(tokens):
        # longest left piece first, so file order needs no sort
        for k in range(len(tok) - 1, 0, -1):
            left = tok[:k]
            if left in vocab:
                right = tok[k:]
                if right in vocab:
                    merges.append((left, right))
                    owners.append(i)
    if scores is not None:
        order = sorted(
            range(len(merges)),
            key=lambda j: (-scores[owners[j]], -len(merges[j][0]), -len(merges[j][1])),
        )
        merges = [merges[j] for j in order]
    return merges


def _gemma_spelling(tokens: list[str]) -> list[str]:
    """A token of only spaces is stored with real spaces, but looked up as "▁"s."""
    return ["▁" * len(t) if " " in t and not t.strip(" ") else t for t in tokens]


def _ids_of(tokens: list[str]) -> dict[str, int]:
    """{token: id}; TokenizerError naming the first token spelled twice."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if vocab.setdefault(tok, i) != i:
            raise TokenizerError(f"duplicate token {tok!r} in GGUF vocabulary (ids {vocab[tok]} and {i})")
    return vocab


def _sentencepiece_model(md: Mapping[str, Any], tokens: list[str], unk_id: int | None) -> tuple[Backend, list[str]]:
    gemma = md.get("general.architecture") in _GEMMA_ARCHS
    if gemma:
        tokens = _gemma_spelling(tokens)
    vocab = _ids_of(tokens)
    scores = None
    if not gemma:
        scores = _get_list(md, "tokenizer.ggml.scores")
        if scores is not None and len(scores) != len(tokens):
            raise TokenizerError(f"GGUF has {len(scores)} token scores for {len(tokens)} tokens")
    merges = _spm_merges(tokens, vocab, scores)
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
    else:
        add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
        )
        if add_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, tokens


def has_lean_backend(md: Mapping[str, Any]) -> bool:
    """Whether `build_from_gguf(md, lean=True)` builds the plain-Python backend (a Gemma vocabulary)."""
    return md.get("tokenizer.ggml.model") == "llama" and md.get("general.architecture") in _GEMMA_ARCHS


def build_from_gguf(md: Mapping[str, Any], lean: bool = False) -> GGUFVocab:
    """Build the tokenizer a GGUF file's metadata describes (see `Tokenizer.from_gguf`).

    `lean`: a Gemma vocabulary gets the plain-Python `spm_bpe.SentencePieceBPE` backend (same tokens,
    ~8 MB instead of ~100 MB for Gemma 3; it cannot be saved as tokenizer.json)."""
    model_name = md.get("tokenizer.ggml.model")
    if model_name is None:
        raise TokenizerError("GGUF metadata has no tokenizer (tokenizer.ggml.model missing)")
    tokens = _get_list(md, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
    n = len(tokens)
    types = _get_list(md, "tokenizer.ggml.token_type") or [NORMAL] * n
    if len(types) != n:
        raise TokenizerError(f"GGUF has {len(types)} token types for {n} tokens")
    types = [int(t) for t in types]

    bos_id = _get_id(md, "tokenizer.ggml.bos_token_id", n)
    eos_id = _get_id(md, "tokenizer.ggml.eos_token_id", n)
    unk_id = _get_id(md, "tokenizer.ggml.unknown_token_id", n)
    pad_id = _get_id(md, "tokenizer.ggml.padding_token_id", n)
    eot_id = _get_id(md, "tokenizer.ggml.eot_token_id", n)
    eom_id = _get_id(md, "tokenizer.ggml.eom_token_id", n)

    lean = lean and has_lean_backend(md)
    backend: Any = None
    if lean:
        spelled = _gemma_spelling(tokens)
        add_bos_default = True
        kind = "sentencepiece"
    elif model_name == "gpt2":
        backend, spelled, add_bos_default = _byte_level_model(md, tokens, types)
        kind = "byte_level"
    elif model_name == "llama":
        backend, spelled = _sentencepiece_model(md, tokens, unk_id)
        add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary
        kind = "sentencepiece"
    else:
        raise TokenizerError(f"unsupported GGUF tokenizer model {model_name!r} (tokenizer.ggml.model)")

    # Control tokens (and the named ones) are special: matched whole in text, dropped by
    # skip_special_tokens. User-defined ones (like "<think>") are matched whole but kept.
    named = {i for i in (bos_id, eos_id, unk_id, pad_id) if i is not None}
    special = [i for i in range(n) if types[i] == CONTROL or i in named]
    user = [i for i in range(n) if types[i] == USER_DEFINED and i not in named and spelled[i] == tokens[i]]
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if lean:
        from superslm.tokenizer.spm_bpe import SentencePieceBPE

        _ids_of(spelled)  # the backend's own table keeps ids by piece: each must be unique
        backend = SentencePieceBPE(spelled, special, user, unk_id, bos_id if add_bos else None,
                                   eos_id if add_eos else None)
    else:
        backend.add_special_tokens([AddedToken(spelled[i], normalized=False, special=True) for i in special])
        backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])
        if backend.get_vocab_size(with_added_tokens=True) != n:
            raise TokenizerError("GGUF vocabulary does not map one-to-one onto token ids")
        backend.post_processor = template_processor(
            (spelled[bos_id], bos_id) if add_bos and bos_id is not None else None,
            (spelled[eos_id], eos_id) if add_eos and eos_id is not None else None,
        )

    # llama.cpp finds end-of-turn tokens by their text when the file names none, and stops on
    # every token spelled like one (Gemma's files name no <end_of_turn>, yet a turn ends with it)
    index = {t: i for i, t in enumerate(tokens) if t in _EOG_TEXTS or t in _EOT_TEXTS}
    if eot_id is None:
        eot_id = next((index[t] for t in _EOT_TEXTS if t in index), None)
    if eom_id is None:
        eom_id = index.get("<|eom_id|>")
    stops = {i for t, i in index.items() if t in _EOG_TEXTS}
    stops |= {i for i in (eos_id, eot_id, eom_id) if i is not None}

    template = md.get("tokenizer.chat_template")
    return GGUFVocab(
        backend=backend,
        kind=kind,
        tokens=list(spelled),
        token_type=types,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=unk_id,
        pad_id=pad_id,
        eot_id=eot_id,
        eom_id=eom_id,
        add_bos=add_bos,
        add_eos=add_eos,
        stop_ids=frozenset(stops),
        chat_template=template if isinstance(template, str) else None,
    )
