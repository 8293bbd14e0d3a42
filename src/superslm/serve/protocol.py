"""The OpenAI request bodies as pydantic models, and their checks beyond what types say.

Models are strict (a string is not a number, 5.0 is not an integer) and allow unknown fields, as
OpenAI clients send fields a server may not know (`metadata`, `store`, ...). Fields whose silent
omission would change the answer (`suffix`, vLLM's `use_beam_search`, ... : `REFUSED`) are refused
with a 400 instead, unless they hold their neutral value. Structured output (`response_format`,
vLLM's `guided_*` and `structured_outputs`) and tools are checked in structured.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from superslm.errors import InvalidArgument, SuperSLMError
from superslm.grammar import Constraint
from superslm.sampling import MAX_LOGPROBS, Sampling

#: most choices per request, as OpenAI's API
MAX_N = 128
#: most stop strings per request, and the longest one (characters)
MAX_STOPS, MAX_STOP_CHARS = 16, 1024
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TOKEN_KEY = re.compile(r"-?[0-9]{1,12}")
#: the seeds vLLM accepts (a signed 64-bit integer); past them a seed would wrap silently
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

#: fields (vLLM's, or OpenAI's legacy ones) that change the answer and are not implemented: a 400
#: unless absent, null or one of the neutral values listed (compared with their type: False is not 0)
REFUSED: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,),
}
#: the same, for chat only
REFUSED_CHAT: dict[str, tuple[object, ...]] = {
    "chat_template": (),
    "functions": ([],),
    "function_call": (),
}


def bad(param: str | None, message: str) -> InvalidArgument:
    """An InvalidArgument naming the request field at fault (the error body's `param`)."""
    e = InvalidArgument(message)
    e.param = param  # type: ignore[attr-defined]
    return e


def renamed(e: SuperSLMError, renames: Mapping[str, str]) -> SuperSLMError:
    """`e` naming another API's spelling of its field (the `param`, and the message's leading "field:"),
    for the endpoints that translate their bodies into a chat request."""
    param = getattr(e, "param", None)
    if param in renames:
        new = renames[param]
        e.param = new  # type: ignore[attr-defined]
        message = str(e)
        if message.startswith(param) and message[len(param):len(param) + 1] in (":", "[", "."):
            e.args = (new + message[len(param):],)
    return e


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Generate(BaseModel):
    """Fields both generation endpoints share (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # structured output: OpenAI's response_format, and vLLM's guided_* (at most one of them)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's newer spelling of guided_*: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    # vLLM's: each prompt token's logprob and the top N (completions: in each choice; chat: beside the choices)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # true: no drafts for this request on a server started with --speculative (the same tokens, one a step); the
    # spelling of vLLM's proposed per-request SamplingParams.disable_spec_decode
    disable_spec_decode: bool = False


class CompletionRequest(_Generate):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Generate):
    """POST /v1/chat/completions."""

    messages: Any
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the answer starts with the last message's content when the answer continues its role
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: OpenAI's: "none" turns a reasoning template's thinking off; the other efforts leave it to the template
    reasoning_effort: str | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered by the model's template."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, plus `truncate` (ours) or vLLM's `truncate_prompt_tokens: -1`."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = False
    truncate_prompt_tokens: int | None = None


class RerankRequest(BaseModel):
    """POST /v1/rerank (and /rerank, /v2/rerank): vLLM's, Jina's and Cohere's shape."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = None
    return_documents: bool = True
    truncate: bool = False
    truncate_prompt_tokens: int | None = None


def parse(cls: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body into `cls`; a bad body raises InvalidArgument without echoing it."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_input=False, include_url=False)[0]
        kind = err.get("type", "")
        loc = [str(x) for x in err.get("loc", ())]
        if kind == "json_invalid":
            raise bad(None, "the body is not valid JSON") from None
        if kind == "model_type" or not loc:
            raise bad(None, "the body must be a JSON object") from None
        # a union reports its member types in loc ("prompt", "str"): the field is what callers know
        param = loc[0]
        raise bad(param, f"{param}: {err.get('msg', 'invalid value')}") from None


def refuse_unsupported(req: BaseModel, refused: Mapping[str, tuple[object, ...]]) -> None:
    """A 400 naming the first field of `refused` the body sets to other than null or a neutral value."""
    extra = req.model_extra or {}
    for name, neutral in refused.items():
        value = extra.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise bad(name, f"{name}: not supported")


def check_common(req: _Generate) -> None:
    """Checks both generation endpoints need beyond types (ranges are Sampling.validate's)."""
    refuse_unsupported(req, REFUSED)
    if not 1 <= req.n <= MAX_N:
        raise bad("n", f"n: must be in [1, {MAX_N}], got {req.n}")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < 1 and req.truncate_prompt_tokens != -1:
        raise bad("truncate_prompt_tokens", "truncate_prompt_tokens: -1 or a count of tokens >= 1")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise bad("seed", f"seed: must be in [{SEED_MIN}, {SEED_MAX}]")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "stream_options: only allowed when stream is true")
    if req.logit_bias is not None:
        for key in req.logit_bias:
            if not _TOKEN_KEY.fullmatch(key):
                raise bad("logit_bias", "logit_bias: keys must be token ids")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"stop: at most {MAX_STOPS} stop strings")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"stop: stop strings must have 1 to {MAX_STOP_CHARS} characters")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix:
        raise bad("suffix", "suffix: not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad("best_of", "best_of: only best_of == n is supported")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"logprobs: must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")


#: OpenAI's reasoning efforts
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def check_chat(req: ChatRequest) -> None:
    check_common(req)
    refuse_unsupported(req, REFUSED_CHAT)
    check_continue(req.continue_final_message, req.add_generation_prompt)
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", f"reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)}")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad("top_logprobs", "top_logprobs: needs logprobs set to true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")


def check_continue(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """continue_final_message extends the last message: a new turn's header after it is a contradiction
    (vLLM's 400 too)."""
    if continue_final_message and add_generation_prompt:
        raise bad("continue_final_message",
                  "continue_final_message: cannot be combined with add_generation_prompt (set it to false)")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the template wants them; text parts are joined. Raises InvalidArgument."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages: must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages", f"{where}: must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad("messages", f"{where}.role: must be one of {sorted(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad("messages", f"{where}.content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            if role != "assistant":
                raise bad("messages", f"{where}.content: missing")
            content = ""
        elif not isinstance(content, str):
            raise bad("messages", f"{where}.content: must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


def to_sampling(req: _Generate, logprobs: int | None, seed_offset: int, grammar: Constraint | None = None,
                after: int | None = None) -> Sampling:
    """The engine's Sampling for one choice (choice i of a seeded request gets seed + i), its
    output constrained by `grammar` when given (from the token after `after`, when given)."""
    try:
        return Sampling(
            temperature=req.temperature,
            top_k=0 if req.top_k == -1 else req.top_k,  # vLLM's -1 means "off", as our 0
            top_p=req.top_p,
            min_p=req.min_p,
            seed=None if req.seed is None else req.seed + seed_offset,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=dict(req.logit_bias) if req.logit_bias else None,
            logprobs=logprobs,
            # echo with logprobs returns the prompt tokens' logprobs too (as vLLM: prompt_logprobs = logprobs)
            prompt_logprobs=max(req.prompt_logprobs or 0, logprobs)
            if isinstance(req, CompletionRequest) and req.echo and logprobs is not None else req.prompt_logprobs,
            stop=req.stop if req.stop is not None else (),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=tuple(req.bad_words or ()),
            grammar=grammar,
            after=after if grammar is not None else None,
        )
    except InvalidArgument as e:
        raise bad(param_of(str(e)), str(e)) from None


def param_of(message: str, renames: Mapping[str, str] | None = None) -> str | None:
    """The field a Sampling message names ("top_p: must be ..." -> "top_p")."""
    m = re.match(r"([a-z_]+)(\[[^\]]*\])?:", message)
    if not m:
        return None
    return (renames or {}).get(m.group(1), m.group(1))
