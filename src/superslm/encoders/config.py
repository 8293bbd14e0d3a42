"""What a sentence-transformers or cross-encoder folder says: the BERT-family shape, the modules
(pooling, Dense, Normalize), max_seq_length and the cross-encoder's activation.

Only reads JSON; the tensors are read by `encoders.net`. The rules follow sentence-transformers:
without modules.json a folder embeds with mean pooling and no normalization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from superslm.errors import FormatError, ModelNotFound, UnsupportedModel

#: model_type -> how positions are numbered ("absolute": 0..L-1; "offset": pad_token_id + 1 ..)
FAMILIES = {"bert": "absolute", "roberta": "offset", "xlm-roberta": "offset"}

#: config.json's hidden_act -> our activation names (see net.ACTIVATIONS)
HIDDEN_ACTS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}

#: sentence-transformers' pooling modes, in the order it concatenates them
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
#: short names callers may use (`Encoder.from_model(pooling="last")`)
POOLING_ALIASES = {"last": "lasttoken", "mean_sqrt_len": "mean_sqrt_len_tokens", "weighted_mean": "weightedmean"}

#: torch activation classes a Dense module or a cross-encoder may name (by class name)
TORCH_ACTS = {"Identity": "identity", "Tanh": "tanh", "Sigmoid": "sigmoid", "ReLU": "relu", "GELU": "gelu"}

# tokenizer_config.json writes "no limit" as a huge integer
_NO_LIMIT = 10**6


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from `path`; {} when it is missing and not required."""
    if not path.is_file():
        if required:
            raise ModelNotFound(f"no {path.name} in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) and not (path.name == "modules.json" and isinstance(data, list)):
        raise FormatError(f"{path}: unexpected JSON layout")
    return data  # type: ignore[return-value]


@dataclass(frozen=True)
class BertSpec:
    """The shape of a BERT / RoBERTa / XLM-RoBERTa encoder, from config.json."""

    family: str
    vocab: int
    dim: int
    layers: int
    heads: int
    ffn: int
    act: str
    eps: float
    max_positions: int
    type_vocab: int
    #: position of the first token (0 for BERT, pad_token_id + 1 for the RoBERTa family)
    pos_offset: int
    num_labels: int
    architectures: tuple[str, ...]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can have (the position table's length less the offset)."""
        return self.max_positions - self.pos_offset

    @classmethod
    def from_config(cls, config: dict[str, Any], where: Path) -> BertSpec:
        family = str(config.get("model_type", ""))
        if family not in FAMILIES:
            raise UnsupportedModel(
                f"{where}: model_type {family!r} is not an encoder SuperSLM runs (known: {sorted(FAMILIES)}); "
                "a decoder model embeds through Encoder.from_model(superslm.load(...))"
            )
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel(f"{where}: position_embedding_type {config['position_embedding_type']!r}")
        act = str(config.get("hidden_act", "gelu"))
        if act not in HIDDEN_ACTS:
            raise UnsupportedModel(f"{where}: hidden_act {act!r} (known: {sorted(HIDDEN_ACTS)})")
        try:
            dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            spec = cls(
                family=family,
                vocab=int(config["vocab_size"]),
                dim=dim,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                ffn=int(config["intermediate_size"]),
                act=HIDDEN_ACTS[act],
                eps=float(config.get("layer_norm_eps", 1e-12)),
                max_positions=int(config.get("max_position_embeddings", 512)),
                type_vocab=int(config.get("type_vocab_size", 2)),
                pos_offset=int(config.get("pad_token_id", 1)) + 1 if FAMILIES[family] == "offset" else 0,
                num_labels=_num_labels(config),
                architectures=tuple(config.get("architectures") or ()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: config.json lacks or garbles {e}") from e
        if dim % heads:
            raise FormatError(f"{where}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
        if spec.layers < 1:
            raise FormatError(f"{where}: num_hidden_layers is {spec.layers}")
        if spec.capacity < 2:
            raise FormatError(f"{where}: max_position_embeddings {spec.max_positions} leaves no room for tokens")
        return spec


def _num_labels(config: dict[str, Any]) -> int:
    if "num_labels" in config:
        return int(config["num_labels"])
    if isinstance(config.get("id2label"), dict):
        return len(config["id2label"])
    return 2  # transformers' PretrainedConfig default


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module: a linear layer and an activation, weights in its folder."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    act: str


@dataclass(frozen=True)
class SentenceSpec:
    """How token vectors become one sentence vector: the transformer's folder, pooling, Dense, Normalize."""

    model_dir: Path
    pooling: tuple[str, ...] = ("mean",)
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    #: config_sentence_transformers.json's named prompts (text put before a text) and the default one
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def parse_pooling(value: Any, where: str) -> tuple[str, ...]:
    """Pooling modes from a string, a list of strings or a Pooling config.json (legacy boolean keys too)."""
    if isinstance(value, dict):
        if "pooling_mode" in value:
            return parse_pooling(value["pooling_mode"], where)
        modes = tuple(m for k, m in _LEGACY_POOLING.items() if value.get(k))
        return modes or ("mean",)
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items:
        raise UnsupportedModel(f"{where}: pooling mode {value!r}")
    out = []
    for m in items:
        m = POOLING_ALIASES.get(m, m) if isinstance(m, str) else m
        if m not in POOLING_MODES:
            raise UnsupportedModel(f"{where}: pooling mode {m!r} (known: {POOLING_MODES + tuple(POOLING_ALIASES)})")
        out.append(m)
    return tuple(out)


def torch_act(name: Any, where: str) -> str:
    """Our name of a torch activation written as a dotted class path ("torch.nn.modules.activation.Tanh")."""
    short = str(name).rsplit(".", 1)[-1]
    if short not in TORCH_ACTS:
        raise UnsupportedModel(f"{where}: activation {name!r} (known: {sorted(TORCH_ACTS)})")
    return TORCH_ACTS[short]


def _module_kind(entry: dict[str, Any], where: Path) -> str:
    kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
    if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
        raise UnsupportedModel(f"{where}: sentence-transformers module {entry.get('type')!r}")
    return kind


def read_sentence_spec(folder: Path) -> SentenceSpec:
    """The modules of a sentence-transformers folder (or mean pooling for a plain transformers folder)."""
    modules = read_json(folder / "modules.json", required=False)
    if not modules:
        sbert = read_json(folder / "sentence_bert_config.json", required=False)
        return SentenceSpec(folder, max_seq_length=sbert.get("max_seq_length"),
                            do_lower_case=bool(sbert.get("do_lower_case", False)))
    if not isinstance(modules, list):
        raise FormatError(f"{folder}/modules.json is not a list")
    model_dir: Path | None = None
    pooling: tuple[str, ...] | None = None
    dense: list[DenseSpec] = []
    normalize = False
    sbert: dict[str, Any] = {}
    for entry in sorted(modules, key=lambda e: int(e.get("idx", 0))):
        kind = _module_kind(entry, folder)
        sub = folder / str(entry.get("path", ""))
        if kind == "Transformer":
            if model_dir is not None or pooling is not None:
                raise UnsupportedModel(f"{folder}: a Transformer module after the first module")
            model_dir = sub
            sbert = read_json(sub / "sentence_bert_config.json", required=False)
        elif kind == "Pooling":
            cfg = read_json(sub / "config.json")
            # sentence-transformers then pools without the prompt's tokens; we always pool them all
            if not cfg.get("include_prompt", True):
                raise UnsupportedModel(f"{sub}: include_prompt false (pooling without the prompt's tokens)")
            pooling = parse_pooling(cfg, str(sub))
        elif kind == "Dense":
            cfg = read_json(sub / "config.json")
            if pooling is None or cfg.get("module_input_name", "sentence_embedding") != "sentence_embedding":
                raise UnsupportedModel(f"{sub}: a Dense module on token vectors (only after pooling is run)")
            try:
                dense.append(DenseSpec(sub, int(cfg["in_features"]), int(cfg["out_features"]),
                                       bool(cfg.get("bias", True)),
                                       torch_act(cfg.get("activation_function", "torch.nn.Tanh"), str(sub))))
            except (KeyError, TypeError, ValueError) as e:
                raise FormatError(f"{sub}/config.json lacks or garbles {e}") from e
        else:
            normalize = True
    if model_dir is None:
        raise UnsupportedModel(f"{folder}: modules.json names no Transformer module")
    if pooling is None:
        raise UnsupportedModel(f"{folder}: modules.json names no Pooling module")
    msl = sbert.get("max_seq_length")
    prompts, default = read_prompts(folder)
    return SentenceSpec(model_dir, pooling, tuple(dense), normalize,
                        int(msl) if isinstance(msl, int) else None, bool(sbert.get("do_lower_case", False)),
                        prompts, default)


def read_prompts(folder: Path) -> tuple[dict[str, str], str | None]:
    """`prompts` and `default_prompt_name` of config_sentence_transformers.json (sentence-transformers reads
    them only beside modules.json); a null prompt is "", a default that names no prompt a FormatError."""
    where = folder / "config_sentence_transformers.json"
    cfg = read_json(where, required=False)
    prompts, default = cfg.get("prompts") or {}, cfg.get("default_prompt_name")
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in prompts.items()
    ):
        raise FormatError(f"{where}: prompts must map names to strings")
    out = {k: v or "" for k, v in prompts.items()}
    if default is not None and default not in out:
        raise FormatError(f"{where}: default_prompt_name {default!r} is not one of the prompts {sorted(out)}")
    return out, default


def max_length(spec: BertSpec, folder: Path, configured: int | None) -> int:
    """The truncation length: the configured one (sentence_bert_config.json), else tokenizer_config.json's
    model_max_length, never past the position table."""
    if configured is None:
        tok = read_json(folder / "tokenizer_config.json", required=False).get("model_max_length")
        configured = int(tok) if isinstance(tok, (int, float)) and 0 < tok < _NO_LIMIT else None
    return spec.capacity if configured is None else max(1, min(int(configured), spec.capacity))


def cross_activation(config: dict[str, Any], st_config: dict[str, Any], num_labels: int, where: Path) -> str:
    """A cross-encoder's score activation, as sentence-transformers picks it: activation_fn of
    config_sentence_transformers.json (`st_config`), else config.json's sentence_transformers.activation_fn
    (or the pre-4.0 key), else sigmoid for one label and identity for more."""
    st = config.get("sentence_transformers")
    name = st_config.get("activation_fn")
    name = name or (st.get("activation_fn") if isinstance(st, dict) else None)
    name = name or config.get("sbert_ce_default_activation_function")
    # sentence-transformers ignores classes outside torch unless told to trust remote code
    if name and str(name).startswith("torch."):
        return torch_act(name, str(where))
    return "sigmoid" if num_labels == 1 else "identity"


def transformer_dir(folder: Path) -> Path:
    """The folder of a sentence-transformers model's Transformer module (the folder itself without modules.json)."""
    modules = read_json(folder / "modules.json", required=False)
    if not modules:
        return folder
    if not isinstance(modules, list):
        raise FormatError(f"{folder}/modules.json is not a list")
    for entry in modules:
        if isinstance(entry, dict) and _module_kind(entry, folder) == "Transformer":
            return folder / str(entry.get("path", ""))
    raise UnsupportedModel(f"{folder}: modules.json names no Transformer module")


def model_kind(folder: Path) -> str:
    """What a model path holds: "encoder" (a BERT-family model, embedded by `Encoder`), "cross-encoder"
    (a BERT-family sequence classifier, scored by `CrossEncoder`) or "decoder" (anything else: a GGUF
    file or a language-model folder, for `superslm.load`)."""
    if not folder.is_dir():
        return "decoder"
    model_dir = transformer_dir(folder)
    config = read_json(model_dir / "config.json", required=False)
    if str(config.get("model_type", "")) not in FAMILIES:
        return "decoder"
    if (folder / "modules.json").is_file():
        task = read_json(model_dir / "sentence_bert_config.json", required=False).get("transformer_task")
        st_type = read_json(folder / "config_sentence_transformers.json", required=False).get("model_type")
        return "cross-encoder" if task == "sequence-classification" or st_type == "CrossEncoder" else "encoder"
    archs = config.get("architectures") or []
    return "cross-encoder" if any(str(a).endswith("ForSequenceClassification") for a in archs) else "encoder"
