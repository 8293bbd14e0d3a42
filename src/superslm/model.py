"""`superslm.load` and `Model`: a model file or folder read into a forward pass and a tokenizer."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from superslm import hub
from superslm.devices import DTYPES, pick_device, pick_dtype  # noqa: F401  (re-exported)
from superslm.errors import InvalidArgument, TemplateError
from superslm.hub import resolve_path  # noqa: F401  (re-exported)
from superslm.models.arch import Arch
from superslm.models.loader import Source, materialize, open_source
from superslm.models.parts import PIECES
from superslm.models.transformer import Transformer

if TYPE_CHECKING:
    from superslm.engine.engine import Engine
    from superslm.tokenizer import ChatTemplate, Tokenizer

class Model:
    """A loaded language model: its Arch, tokenizer, chat template and forward pass."""

    def __init__(self, source: Source, net: Transformer, tokenizer: Tokenizer, name: str) -> None:
        self.source = source
        self.arch: Arch = source.arch
        self.net = net
        self.tokenizer = tokenizer
        self.name = name
        self._template: ChatTemplate | None = None
        self._fingerprint: str | None = None
        self._schemas: dict[str, Any] | None = None

    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.dtype

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end a generation: the tokenizer's and the config's eos ids."""
        return frozenset(self.tokenizer.stop_ids) | frozenset(self.arch.eos_ids)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The chat rendered by the model's own template, ready to encode.

        continue_final_message: the prompt ends inside the last message, right after its content (as
        transformers' apply_chat_template: a marker after the content, cut with what follows), so that the
        answer continues it (an assistant prefill); it excludes add_generation_prompt. Raises InvalidArgument
        for that pair or a last message without text, TemplateError when the template drops the marker."""
        from superslm.tokenizer import ChatTemplate

        if continue_final_message and add_generation_prompt:
            raise InvalidArgument("continue_final_message: cannot be combined with add_generation_prompt")
        if self.tokenizer.chat_template is None:
            raise TemplateError(f"{self.name} has no chat template")
        if self._template is None:
            self._template = ChatTemplate(
                self.tokenizer.chat_template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
            )
        text = self._template.render(
            _tag_final(messages) if continue_final_message else messages, tools=tools,
            add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **extra,
        )
        return _cut_at_tag(text) if continue_final_message else text

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """The chat prompt as token ids (the template writes its own bos where it has one)."""
        text = self.chat_prompt(messages, **kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def checked_context(self, context: int | None, allow_long: bool = False) -> int | None:
        """A context asked for by a user (the CLI's --context), refused past the positions the model was
        trained for (its config's, rope scaling included), as vLLM refuses a longer max_model_len: the answers
        there are noise, and a 100,000-token context on an 8k model ran for minutes. `allow_long` (the CLI's
        --allow-long-context) lets it through with a warning on stderr. None: the engine's default."""
        if context is not None and context > self.arch.context:
            if not allow_long:
                raise InvalidArgument(f"a context of {context} is past the {self.arch.context} positions {self.name} "
                                      "was trained for (--allow-long-context runs it anyway)")
            print(f"superslm: warning: a context of {context} is past the {self.arch.context} positions {self.name} "
                  "was trained for: answers past them are likely noise", file=sys.stderr)
        return context

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja, as a tokenizer_config's chat_template) instead of the model's own:
        a base model has none. Raises TemplateError where it does not compile."""
        from superslm.tokenizer import ChatTemplate

        compiled = ChatTemplate(template, self.tokenizer.bos_token or "", self.tokenizer.eos_token or "")
        self.tokenizer.chat_template = template
        self._template = compiled

    def engine(self, slots: int = 8, context: int | None = None, **kwargs: Any) -> Engine:
        """An engine running up to `slots` sequences of at most `context` tokens (see Engine)."""
        from superslm.engine.engine import Engine

        return Engine(self, slots=slots, context=context, **kwargs)

    def adapter(self, folder: str | Path) -> Any:
        """Map a PEFT LoRA adapter folder onto this model (refused with AdapterMismatch if it does not fit);
        requests name it with `Request(adapter=...)`; `adapter.unmap()` releases it."""
        from superslm.adapters import load_peft

        names = self.source.recipe.layer_names(hf=True)
        return load_peft(folder, self.arch, dict(names), self.fingerprint, self.dtype, self.device)

    def tool_calls(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str | None, list]:
        """Parse model text back into (content, OpenAI-style tool calls [{"name", "arguments"}]) in the
        model's own format (Hermes/Qwen <tool_call>, Llama 3 JSON, or a generic JSON fallback)."""
        from superslm.grammar import parse_tool_calls

        return parse_tool_calls(text, tools)

    def schemas(self) -> dict[str, Any]:
        """The named JSON schemas shipped with the model (`schemas/NAME.json` in its folder)."""
        if self._schemas is None:
            from superslm.grammar import load_schemas

            folder = self.source.path if self.source.path.is_dir() else None
            self._schemas = load_schemas(folder) if folder is not None else {}
        return self._schemas

    @property
    def fingerprint(self) -> str:
        """sha256 of the Arch and every weight as computed (format and dtype included); saved
        sequences carry it so they are restored only into the model they came from."""
        if self._fingerprint is None:
            import hashlib
            import json

            h = hashlib.sha256(json.dumps(self.arch.summary(), sort_keys=True, default=str).encode())
            rows = self.net.embed_rows
            for name, t in list(self.net.named_parameters()) + list(self.net.named_buffers()):
                if name == "embed_weight" and rows is not None:
                    # embeddings read from the file per step hash as the dense table they stand for
                    h.update(f"{name}:{self.net.dtype}:{(rows.vocab, rows.dim)}".encode())
                    for r in range(0, rows.vocab, 8192):
                        part = rows(torch.arange(r, min(r + 8192, rows.vocab)))
                        h.update(part.contiguous().view(torch.uint8).numpy().tobytes())
                    continue
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                data = t.detach().contiguous().cpu()
                h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def info(self) -> dict[str, Any]:
        """What `superslm info` prints (a converted folder adds how it was made: its header's conversion)."""
        made = {}
        if self.source.format == "native":
            header = self.source.config.get("header", {})
            made = {"converted": {k: header.get(k) for k in ("format", "group", "head", "rotation", "calibration",
                                                             "lora", "source") if header.get(k) is not None}}
        return {
            "name": self.name,
            "path": str(self.source.path),
            "format": self.source.format,
            "arch": self.arch.summary(),
            "layers": layer_kinds(self.arch),
            "parameters": self.source.parameter_count(),
            "block_types": self.source.block_types(),
            "linears": _linear_summary(self.net),
            "vocab": self.tokenizer.vocab_size,
            "bos_id": self.tokenizer.bos_id,
            "stop_ids": sorted(self.stop_ids),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "chat_template": self.chat_template,
            **made,
        }


def layer_kinds(a: Any) -> str:
    """What the layers are, for `superslm info`: e.g. "24: 18 gated delta rule, 6 attention; dense MLP"."""
    mixers = [f"{a.mixers.count(m)} {name}" for m, name in (("delta", "gated delta rule"), ("attention",
              "gated attention" if a.attn_gate else "attention")) if m in a.mixers]
    e, sparse = a.experts, sum(a.moe_layers)
    if e is None or not sparse:
        mlp = "dense MLP"
    else:
        shared = f" and a shared expert of {e.shared_ffn}" if e.shared_ffn else ""
        where = "every layer" if sparse == a.layers else f"{sparse} layers (the rest dense)"
        mlp = f"{e.count} experts of {e.ffn}, top {e.top_k}{shared}, on {where}"
    mtp = f"; MTP: {a.mtp} layer{'s' if a.mtp > 1 else ''} (draft logits, models/mtp.py)" if a.mtp else ""
    return f"{a.layers}: {', '.join(mixers)}; {mlp}{mtp}"


def _linear_summary(net: Transformer) -> dict[str, int]:
    """How the linears run: {format description: count} (dense ones as their dtype)."""
    from superslm.quant import linear_summary

    return linear_summary(net)


def load_tokenizer(source: Source) -> Tokenizer:
    from superslm.tokenizer import Tokenizer

    if source.is_hf or source.format == "native":
        return Tokenizer.from_folder(source.path)
    from superslm.tokenizer.gguf_cache import cache_key
    from superslm.tokenizer.gguf_vocab import has_lean_backend

    md = source.gguf.metadata
    cache = None
    # a small vocabulary builds faster than it reads; a Gemma one gets the lean backend, never cached
    if len(md.get("tokenizer.ggml.tokens", ())) >= 32768 and not has_lean_backend(md):
        cache = hub.cache_dir() / "tokenizers" / cache_key(source.gguf.metadata_digest())
    return Tokenizer.from_gguf(md, cache=cache)


QUANTS = ("auto", "none", "gguf", "int4", "int8", "bf16")


#: weights `quantize_from_source` takes from a GGUF file's blocks (linears, head, embedding rows)
_BLOCK_LINEARS = frozenset({*PIECES, "head", "embed"})


def load(
    path_or_name: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    layers: int | None = None,
    quant: str | None = "auto",
    expert_slots: int | None = None,
) -> Model:
    """Load a GGUF file, a Hugging Face folder, a folder written by `superslm convert`, a known model
    name (None: the default model) or `hf:OWNER/REPO[/FOLDER][@REVISION]` (fetched and converted once,
    `superslm.hf_fetch`; `quant` picks the conversion's format).

    `device` defaults to cuda when present, else cpu. `quant` chooses how linears run:
    "auto" runs a GGUF file's blocks as they are on the CPU (Q4_0/Q4_1/Q4_K as packed int4, other
    block types in their nearest format, bf16 activations) unless `dtype` is given, and runs everything
    else dense; "gguf" forces that; "int4"/"int8"/"bf16" re-quantize every linear (int8 head);
    None/"none" keeps dense weights of `dtype` (fp32 on the CPU, bf16 on a GPU: the exact path).
    A converted folder runs its stored formats ("auto"; None/"none" dequantizes them to dense).
    With `layers`, only the first layers are kept (hidden states, no logits).
    `expert_slots`: a mixture-of-experts model keeps that many experts of each block on `device` and reads the
    others from host memory when its router picks them (for a GPU whose memory does not hold every expert;
    `Engine.expert_cache()` counts hits, misses and read ms). The net is built on the CPU first.
    """
    if quant not in QUANTS and quant is not None:
        raise InvalidArgument(f"unknown quant {quant!r} (known: {QUANTS})")
    if isinstance(path_or_name, str) and path_or_name.startswith("hf:"):
        from superslm.hf_fetch import fetch_converted

        path = fetch_converted(path_or_name, quant=quant)
    else:
        path = resolve_path(path_or_name)
    dev = pick_device(device)
    if expert_slots is not None and (isinstance(expert_slots, bool) or not isinstance(expert_slots, int)
                                     or expert_slots < 1):
        raise InvalidArgument(f"expert_slots must be a positive integer, got {expert_slots!r}")
    # with an expert cache the experts must not all land on the device: build on the CPU, then move
    build = torch.device("cpu") if expert_slots is not None else dev
    source = open_source(path)
    tokenizer = load_tokenizer(source)
    if source.format == "native":
        # a converted folder: linears built from their stored formats, nothing re-quantized
        from superslm.converted import converted_net

        net = converted_net(source, dev, dtype, layers, quant, build_on=build)
        quant = None
    else:
        plain = source.recipe.parts.plain(source.arch)
        if quant == "auto":
            native = source.format == "gguf" and dev.type == "cpu" and dtype is None
            quant = "gguf" if native else None
        dt = torch.bfloat16 if quant not in (None, "none") and dtype is None else pick_dtype(dtype, dev)
        # GGUF blocks run as they are: their dense copies would only be built to be dropped (other parts' linears
        # are loaded dense too, for those the blocks cannot give as they are: experts, column-moving fixes)
        skip = frozenset()
        if quant == "gguf":
            from superslm.quant.swap import block_pieces

            n = source.arch.layers if layers is None else min(layers, source.arch.layers)
            skip = _BLOCK_LINEARS if plain else block_pieces(source, n) | {"head", "embed"}
        net = Transformer(source.arch, materialize(source, dt, build, layers, skip), layers)
    if quant == "gguf":
        from superslm.quant import quantize_from_source

        quantize_from_source(net, source)  # drops the file's pages and freed heap as it goes
    elif quant in ("int4", "int8", "bf16"):
        from superslm.quant import quantize_linears

        quantize_linears(net, body=quant, head="int8" if quant != "bf16" else "bf16")
    if expert_slots is not None:
        net.use_expert_cache(expert_slots, dev)
    name = str(path_or_name) if path_or_name is not None and not Path(str(path_or_name)).exists() else path.name
    return Model(source, net, tokenizer, name or hub.DEFAULT_MODEL)


#: transformers' marker: put after the last message's content, rendered, then cut away with what follows it
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages with CONTINUE_TAG after the last message's text content (its last text part for parts)."""
    if not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("content") is None:
        raise InvalidArgument("continue_final_message: the last message has no content to continue")
    last = dict(messages[-1])
    content = last["content"]
    if isinstance(content, str):
        last["content"] = content + CONTINUE_TAG
    elif isinstance(content, list | tuple):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] += CONTINUE_TAG
                break
        else:
            raise InvalidArgument("continue_final_message: the last message has no text to continue")
        last["content"] = parts
    else:
        raise InvalidArgument("continue_final_message: the last message's content is not text")
    return [*messages[:-1], last]


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to CONTINUE_TAG (trailing spaces dropped where the template trimmed the tag's)."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise TemplateError("continue_final_message: the chat template does not write the last message's content")
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
