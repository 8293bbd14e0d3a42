"""Chat templates: a model's Jinja template, rendered in a sandbox as transformers renders it.

Templates come with model files, so they are untrusted code: they run in jinja2's immutable
sandbox, see only plain JSON data, and any reach for an unsafe attribute fails loudly. A render has a
budget (lines of template code run, seconds, the size of what `*` and `**` build), so a template's loops
cannot hold a server's worker for good.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from superslm.errors import InvalidArgument, SuperSLMError, TemplateError

if TYPE_CHECKING:  # jinja2 is imported with the first template (plain generation never needs it)
    import jinja2

#: the most lines of template code one render runs (a chat of 100 messages takes a few thousand) and its seconds
RENDER_STEPS = 2_000_000
RENDER_SECONDS = 5.0
#: the longest string or list a template's `*` may build, and the largest power its `**` may compute
MAX_REPEAT = 1 << 20
MAX_POWER_BITS = 4096


class _Budget:
    """A trace function for one render (this thread only): counts the lines run in template code (jinja
    compiles a template to Python whose frames are named "<template>") and ends the render past its budget."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + RENDER_SECONDS

    def call(self, frame: Any, event: str, arg: Any) -> Any:
        return self.line if frame.f_code.co_filename == "<template>" else None

    def line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.steps += 1
            if self.steps > RENDER_STEPS or not self.steps & 1023 and time.monotonic() > self.deadline:
                raise TemplateError(f"chat template ran past its budget ({RENDER_STEPS:,} steps or "
                                    f"{RENDER_SECONDS:g} s)")
        return self.line


# Names a message's reasoning may come under; templates (Qwen3's, gpt-oss') read one or another.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    import jinja2.ext
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class _StrictSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, but an unsafe attribute raises at once instead of rendering as ""."""

        intercepted_binops = frozenset({"*", "**"})

        def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            # a string or list repeated, or a power, can take all memory or time in one line of template
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                        raise SecurityError(f"a template may not build a sequence of {len(seq) * n:,} items")
            elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and abs(left).bit_length() * right > MAX_POWER_BITS:
                raise SecurityError("a template may not compute a power that large")
            return super().call_binop(context, operator, left, right)

    class _SafeNamespace(Namespace):
        """`namespace()` that refuses underscore names (no route to CPython internals through it)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a template may not set the underscore name {name!r} on a namespace")

    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _make_dict
    env.globals["namespace"] = _SafeNamespace
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` in plain JSON types only: what the template sees has no methods to abuse."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise InvalidArgument(f"{where}: {type(value).__name__} is not plain JSON data")


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidArgument("messages must be a list of message dicts")
    out = []
    for k, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidArgument(f"messages[{k}] must be a dict, not {type(msg).__name__}")
        if not isinstance(msg.get("role"), str):
            raise InvalidArgument(f"messages[{k}] needs a string 'role'")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidArgument(f"messages[{k}].content must be a string, a list of parts or null")
        msg = _plain(msg, f"messages[{k}]")
        reasoning = next((msg[f] for f in _REASONING_FIELDS if msg.get(f) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template (compiled once per distinct source, process-wide).

    `render` matches transformers' `apply_chat_template(..., tokenize=False)` for the same
    template and inputs.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise InvalidArgument("a chat template must be a string")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (and `tools`, as JSON schemas).

        `enable_thinking` is passed only when not None, so a template's own default holds;
        `extra` reaches the template as variables (e.g. documents, date_string). Raises
        InvalidArgument for malformed messages and TemplateError when the template fails, calls
        raise_exception, or reaches outside its sandbox.
        """
        chat = _check_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
                raise InvalidArgument("tools must be a list of JSON-schema dicts")
            for k, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise InvalidArgument(f"tools[{k}] must be a dict (a JSON schema)")
            tools = _plain(tools, "tools")
        # transformers always passes documents (None when absent); templates test `documents is not none`
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,
        }
        context.update({k: _plain(v, k) for k, v in extra.items()})
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        from jinja2 import TemplateError as JinjaError  # imported already: the template was compiled
        from jinja2.exceptions import SecurityError

        budget, before = _Budget(), sys.gettrace()
        sys.settrace(budget.call)
        try:
            return self._template.render(
                messages=chat, tools=tools, add_generation_prompt=bool(add_generation_prompt), **context
            )
        except SuperSLMError:
            raise
        except SecurityError as e:
            raise TemplateError(f"chat template tried to leave its sandbox: {e}") from e
        except JinjaError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # a template is code: any failure in it is the template's
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        finally:
            sys.settrace(before)

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
