"""The `superslm` command: info, generate, chat, serve, embed, convert, bench, list, pull, rm."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from superslm.errors import SuperSLMError
from superslm.memory import freeze_heap


def _model_args(p: argparse.ArgumentParser, template: bool = False) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file, a Hugging Face folder or a known name (default: SmolLM2-135M-Instruct)")
    if template:
        add_template_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16 (default: a GGUF on the CPU runs its quantized blocks with bf16 "
                        "activations; dense weights are fp32 on the CPU, bf16 on a GPU; either value dequantizes a "
                        "GGUF to dense weights of that type)")
    p.add_argument("--expert-slots", type=int, default=None, metavar="N",
                   help="a mixture-of-experts model keeps N experts of each block on the device and reads the "
                        "others from host memory when chosen (for a GPU that cannot hold them all)")
    add_threads_arg(p)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """`--threads N` (`-t`): the CPU kernels' threads (default: the cores this process may use)."""
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads for the kernels (default: the cores this process may use)")


def add_template_arg(p: argparse.ArgumentParser) -> None:
    """`--chat-template FILE`: a Jinja chat template instead of the model's (a base model has none)."""
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's own (a base model has none)")


def add_context_args(p: argparse.ArgumentParser, *aliases: str) -> None:
    """`--context N` (`-c`, and `aliases`) and `--allow-long-context`."""
    p.add_argument("--context", "-c", *aliases, type=int, default=None, dest="context",
                   help="tokens per sequence, prompt and answer (default: the model's, at most 4096)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="allow a context past the positions the model was trained for (with a warning)")


def apply_template(model: Any, path: str | None) -> None:
    """The --chat-template file, if given, as the model's chat template."""
    if path is not None:
        model.use_chat_template(Path(path).read_text(encoding="utf-8"))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens whose "
                   "probabilities add up to this (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the most likely one (default: 0, off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling noise (default: a fresh one)")
    add_context_args(p)
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print the load time and each answer's prefill and decode speed to stderr")


def _sampling(ns: argparse.Namespace) -> Any:
    from superslm.sampling import Sampling

    return Sampling(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, seed=ns.seed)


def cmd_info(ns: argparse.Namespace) -> int:
    import superslm

    model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype, expert_slots=ns.expert_slots)
    info = model.info()
    if ns.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    template = info.pop("chat_template")
    arch = info.pop("arch")
    for k, v in info.items():
        print(f"{k:14} {v}")
    print("arch")
    for k, v in arch.items():
        print(f"  {k:16} {v}")
    print("chat_template" + ("\n" + template if template else "  (none)"))
    return 0


def _stream(engine: Any, request: Any, interruptible: bool = False,
            first_token: Callable[[], None] | None = None) -> tuple[str, str, int]:
    """Runs one request, writing its text to stdout as it comes; returns its whole text, how it ended and its
    number of tokens. `interruptible`: Ctrl-C cancels the request (its text so far is kept, the end is
    "cancelled"). `first_token` is called when the first token comes."""
    rid = engine.add(request)
    out, end, count = [], "", 0
    try:
        while engine.busy():
            for p in engine.advance():
                if p.id == rid:
                    if p.tokens and not count and first_token is not None:
                        first_token()
                    count += len(p.tokens)
                    if p.text:
                        sys.stdout.write(p.text)
                        sys.stdout.flush()
                        out.append(p.text)
                    end = p.end or end
    except KeyboardInterrupt:
        if not interruptible:
            raise
        engine.cancel(rid)
        while engine.busy():
            engine.advance()
        end = "cancelled"
    return "".join(out), end, count


def _load(ns: argparse.Namespace) -> Any:
    """The model --model names, with --chat-template applied; --verbose prints the load time."""
    import superslm

    t = time.perf_counter()
    model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype, expert_slots=getattr(ns, "expert_slots", None))
    apply_template(model, getattr(ns, "chat_template", None))
    freeze_heap()  # the command keeps this model to its end
    if getattr(ns, "verbose", False):
        print(f"loaded {model.name} in {time.perf_counter() - t:.2f} s ({model.device}, "
              f"{str(model.dtype).removeprefix('torch.')}, {model.arch.layers} layers)", file=sys.stderr)
    return model


def _timings(prompt_tokens: int, start: float, first: float | None, end: float, n: int) -> str:
    if first is None:
        return f"prompt {prompt_tokens} tokens; no answer token"
    return (f"prompt {prompt_tokens} tokens in {first - start:.3f} s ({prompt_tokens / max(first - start, 1e-9):.1f} "
            f"tok/s); answer {n} tokens in {end - start:.3f} s ({max(n - 1, 0) / max(end - first, 1e-9):.1f} tok/s "
            "after the first)")


def cmd_generate(ns: argparse.Namespace) -> int:
    from superslm.engine import Request

    model = _load(ns)
    engine = model.engine(slots=1, context=model.checked_context(ns.context, ns.allow_long_context))
    if ns.prompt_file is not None:
        text = sys.stdin.read() if ns.prompt_file == "-" else Path(ns.prompt_file).read_text(encoding="utf-8")
    else:
        text = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    if ns.chat:
        prompt: Any = model.chat_tokens([{"role": "user", "content": text}])
    else:
        prompt = model.tokenizer.encode(text)
    start = time.perf_counter()
    times: list[float] = []
    _, _, n = _stream(engine, Request(prompt=prompt, max_tokens=ns.max_tokens, sampling=_sampling(ns)),
                      first_token=lambda: times.append(time.perf_counter()))
    end = time.perf_counter()
    sys.stdout.write("\n")
    if ns.timings or ns.verbose:
        print(_timings(len(prompt), start, times[0] if times else None, end, n), file=sys.stderr)
    return 0


CHAT_HELP = """commands: /system [TEXT] (show or set the system message), /reset (start over), /save FILE,
/load FILE (the conversation as JSON), /stats (tokens and speed), /help, /exit (or Ctrl-D); Ctrl-C stops a reply;
a conversation past the context drops its oldest messages (it says how many) and goes on"""


def _read_chat(path: str) -> list[dict[str, str]]:
    """A conversation saved by /save: {"messages": [{"role", "content"}, ...]} (InvalidArgument otherwise)."""
    from superslm.errors import InvalidArgument

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot read a conversation from {path}: {e}") from e
    messages = data.get("messages") if isinstance(data, dict) else None
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
        and isinstance(m["content"], str) for m in messages)  # fmt: skip
    if not ok:
        raise InvalidArgument(f'{path} is no saved conversation: it needs {{"messages": [{{"role", "content"}}]}}')
    return messages  # type: ignore[return-value]


def _write_chat(path: str, messages: list[dict[str, str]]) -> None:
    """The conversation as JSON, written whole or not at all (a temporary file renamed over the target)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.partial")
    tmp.write_text(json.dumps({"messages": messages}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(target)


def cmd_chat(ns: argparse.Namespace) -> int:
    from superslm.engine import Request

    model = _load(ns)
    if model.chat_template is None:
        print(f"superslm: error: {model.name} has no chat template (a base model?): give one with --chat-template "
              "FILE, or use `superslm generate -p TEXT`", file=sys.stderr)
        return 2
    engine = model.engine(slots=1, context=model.checked_context(ns.context, ns.allow_long_context))
    # Ctrl-C is how a reply stops: a process started with SIGINT ignored (a shell's background job, a service
    # manager) would otherwise inherit that and let the reply run to its end
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    messages: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []
    last = ""
    print("superslm chat: type a message; /help lists the commands; Ctrl-C stops a reply, Ctrl-D leaves.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt: the line is dropped, the chat stays (as Ollama's)
            print("\n(Ctrl-D or /exit leaves)", file=sys.stderr)
            continue
        word, _, arg = line.strip().partition(" ")
        if word in ("/exit", "/quit"):
            return 0
        if word == "/help":
            print(CHAT_HELP, file=sys.stderr)
            continue
        if word == "/reset":
            messages = [m for m in messages if m["role"] == "system"]
            print("(the conversation is cleared)", file=sys.stderr)
            continue
        if word == "/system":
            if arg.strip():
                messages = [{"role": "system", "content": arg.strip()}] + [m for m in messages if m["role"] != "system"]
                print("(system message set)", file=sys.stderr)
            else:
                current = next((m["content"] for m in messages if m["role"] == "system"), None)
                print(f"(system: {current})" if current else "(no system message)", file=sys.stderr)
            continue
        if word in ("/save", "/load"):
            if not arg.strip():
                print(f"({word} needs a file name)", file=sys.stderr)
                continue
            try:
                if word == "/save":
                    _write_chat(arg.strip(), messages)
                    print(f"(saved {len(messages)} messages to {arg.strip()})", file=sys.stderr)
                else:
                    messages = _read_chat(arg.strip())
                    print(f"(loaded {len(messages)} messages from {arg.strip()})", file=sys.stderr)
            except (SuperSLMError, OSError) as e:
                print(f"error: {e}", file=sys.stderr)
            continue
        if word == "/stats":
            used = len(model.chat_tokens(messages)) if messages else 0
            print(f"(conversation: {len(messages)} messages, {used} of {engine.context} context tokens; "
                  f"{last or 'no reply yet'})", file=sys.stderr)
            continue
        if word.startswith("/"):
            print(f"(unknown command {word}; /help lists them)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        keep = sum(1 for m in messages if m["role"] == "system")
        try:
            prompt = _fitting_prompt(model, engine, messages, keep)
            start, times = time.perf_counter(), []
            reply, end, n = _stream(engine, Request(prompt=prompt, max_tokens=ns.max_tokens, sampling=_sampling(ns)),
                                    interruptible=True, first_token=lambda t=times: t.append(time.perf_counter()))
        except SuperSLMError as e:
            messages.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # before the reply started (the prompt was being built): no reply to keep
            messages.pop()
            print("\n(stopped)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        last = "last reply: " + _timings(len(prompt), start, times[0] if times else None, time.perf_counter(), n)
        if ns.verbose:
            print(f"({last})", file=sys.stderr)
        if end == "cancelled":
            print("(stopped)", file=sys.stderr)
        elif end == "length" and len(prompt) + len(model.tokenizer.encode(reply, False)) >= engine.context - 1:
            print(f"(the reply reached the end of the {engine.context}-token context; older turns are dropped "
                  "from the next prompt, or use --context)", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


def _fitting_prompt(model: Any, engine: Any, messages: list[dict[str, str]], keep: int) -> list[int]:
    """The chat's prompt ids, the oldest turns after the first `keep` messages (the system one) dropped from
    `messages` until it leaves room for an answer in the context; the user is told what was dropped."""
    dropped = 0
    while True:
        prompt = model.chat_tokens(messages)
        if len(prompt) < engine.context * 3 // 4 or len(messages) - keep <= 1:
            break
        del messages[keep : keep + 2]  # the oldest user message and its answer
        dropped += 2
    if dropped:
        print(f"(dropped the {dropped} oldest messages to fit the {engine.context}-token context)", file=sys.stderr)
    return prompt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="superslm", description=__doc__)
    from superslm import __version__

    p.add_argument("--version", action="version", version=f"superslm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print a model's Arch, parameters, block types and template")
    info.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as --model")
    _model_args(info)
    info.add_argument("--json", action="store_true", help="print it as JSON")
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="continue a prompt, streaming the text to stdout")
    _model_args(gen, template=True)
    _sampling_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="the prompt; - reads it from standard input")
    src.add_argument("--prompt-file", "-f", help="read the prompt from this file (- : standard input)")
    gen.add_argument("--timings", action="store_true",
                     help="print the prompt's and the answer's tokens and speed to stderr at the end (--verbose "
                          "adds the load time)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat that keeps the conversation",
                          description="An interactive chat. " + CHAT_HELP)
    _model_args(chat, template=True)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message (default: none; /system sets one later)")
    chat.set_defaults(func=cmd_chat)

    # other layers' subcommands; each module imports its heavy dependencies only when run
    from superslm.bench import add_parser as add_bench
    from superslm.cache_cli import add_parsers as add_cache
    from superslm.convert import add_parser as add_convert
    from superslm.embed_cli import add_parser as add_embed
    from superslm.ray.cli import add_parsers as add_ray
    from superslm.serve.cli import add_parser as add_serve

    add_serve(sub)
    add_ray(sub)  # serve's --replicas and ray-deploy (Ray itself is imported only when they run)
    add_embed(sub)
    add_convert(sub)
    add_bench(sub)
    add_cache(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if getattr(ns, "model_pos", None) and ns.model is None:
        ns.model = ns.model_pos
    try:
        if ns.command != "bench" and hasattr(ns, "threads"):  # bench sets each peer's own threads
            from superslm.devices import set_threads

            set_threads(ns.threads)
        return int(ns.func(ns) or 0)
    except SuperSLMError as e:
        print(f"superslm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the command cannot read or write (a convert target under /proc, a full disk)
        print(f"superslm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
