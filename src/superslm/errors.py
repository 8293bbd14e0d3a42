"""Every refusal SuperSLM makes is an exception class of its own.

One class per real cause, so a caller (and the server, which maps each
class to one HTTP status and error code) can tell malformed input from a wrong lifecycle state from
content that does not match what it claims to be.
"""

from __future__ import annotations


class SuperSLMError(Exception):
    """Base class of every error SuperSLM raises on purpose."""

    #: machine-readable code, used by the server's error bodies
    code = "superslm_error"
    #: HTTP status the server answers with
    http_status = 500


# --- bad input from the caller -------------------------------------------------------------------


class InvalidArgument(SuperSLMError, ValueError):
    """An argument is malformed or out of range."""

    code = "invalid_argument"
    http_status = 400


class TokenOutOfRange(InvalidArgument):
    """A token id is negative or not below the model's vocabulary size."""

    code = "token_out_of_range"


class ContextLengthExceeded(InvalidArgument):
    """A prompt (plus the tokens asked for) does not fit in the context."""

    code = "context_length_exceeded"


# --- files and models ----------------------------------------------------------------------------


class ModelNotFound(SuperSLMError, FileNotFoundError):
    """No model at that path, and no known model of that name."""

    code = "model_not_found"
    http_status = 404


class FormatError(SuperSLMError):
    """A model file is malformed, truncated or inconsistent."""

    code = "format_error"
    http_status = 400


class GGUFError(FormatError):
    """A GGUF file is malformed: bad magic or version, counts or offsets past the file, ..."""

    code = "gguf_error"


class UnsupportedModel(SuperSLMError):
    """A model family, option or tensor type that SuperSLM does not run (the message names it)."""

    code = "unsupported_model"
    http_status = 400


class TokenizerError(SuperSLMError):
    """A tokenizer could not be built from the model's files."""

    code = "tokenizer_error"
    http_status = 400


class TemplateError(SuperSLMError):
    """A chat template failed to render, raised an exception, or tried to leave its sandbox."""

    code = "template_error"
    http_status = 400


class FetchError(SuperSLMError):
    """A known model could not be fetched (no network, the package is missing, a checksum differs)."""

    code = "fetch_error"
    http_status = 503


# --- engine state --------------------------------------------------------------------------------


class KVCacheFull(SuperSLMError):
    """The KV pool has no free page left (after evicting every evictable cached page)."""

    code = "kv_cache_full"
    http_status = 503


class UnknownRequest(SuperSLMError, KeyError):
    """No live request or sequence has that id."""

    code = "unknown_request"
    http_status = 404


class QueueFull(SuperSLMError):
    """The engine's waiting queue is full; try again later."""

    code = "queue_full"
    http_status = 503


class GrammarError(InvalidArgument):
    """A JSON schema, regex or grammar that cannot be compiled (or took too long to compile)."""

    code = "invalid_grammar"


class InternalError(SuperSLMError, AssertionError):
    """A broken internal invariant (a bug): never the caller's fault."""

    code = "internal_error"
    http_status = 500


# --- saved sequences -----------------------------------------------------------------------------


class StateError(SuperSLMError):
    """A saved sequence cannot be restored (base class of the three causes below)."""

    code = "invalid_state"
    http_status = 400


class StateCorrupted(StateError):
    """A saved sequence is truncated, corrupted or not a saved sequence at all."""

    code = "state_corrupted"


class StateVersionUnsupported(StateError):
    """A saved sequence of a format version this release cannot read (a future one)."""

    code = "state_version_unsupported"


class StateModelMismatch(StateError):
    """A saved sequence of another model (weights, format, dtype or KV layout differ)."""

    code = "state_model_mismatch"


class SequenceBusy(SuperSLMError):
    """The sequence is in the middle of a step (a layer budget left it half done); finish the step first."""

    code = "sequence_busy"
    http_status = 409


class PrefixInUse(SuperSLMError):
    """A prefix handle cannot be released while requests still use it."""

    code = "prefix_in_use"
    http_status = 409


class UnknownSchema(InvalidArgument):
    """No named schema of that name ships with the model."""

    code = "unknown_schema"


# --- adapters ------------------------------------------------------------------------------------


class AdapterMismatch(SuperSLMError):
    """A LoRA adapter that does not fit the model (shapes, layers, modules, or another base model)."""

    code = "adapter_mismatch"
    http_status = 400


class AdapterInUse(SuperSLMError):
    """An adapter cannot be unmapped while live requests use it (or used once unmapped)."""

    code = "adapter_in_use"
    http_status = 409


class ModelIntegrityError(FormatError):
    """A converted model folder that is incomplete (a stopped conversion) or was modified after it was
    written (a file missing, added, resized or with another sha256 than its manifest says)."""

    code = "model_integrity"
