"""The `superslm` command: info, generate, chat, serve, embed, convert, bench, list, pull, rm."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from superslm.errors import SuperSLMError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a GGUF file, a Hugging Face folder or a known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="float32 or bfloat16 (default: a GGUF on the CPU runs its quantized blocks with bf16 "
                        "activations; dense weights are fp32 on the CPU, bf16 on a GPU; either value dequantizes a "
                        "GGUF to dense weights of that type)")
    add_threads_arg(p)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """`--threads N`: the CPU kernels' threads (default: the cores this process may use)."""
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (default: the cores this process may use)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--context", type=int, default=None, help="context length of the engine")


def _sampling(ns: argparse.Namespace) -> Any:
    from superslm.sampling import Sampling

    return Sampling(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, seed=ns.seed)


def cmd_info(ns: argparse.Namespace) -> int:
    import superslm

    model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype)
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


def cmd_generate(ns: argparse.Namespace) -> int:
    import superslm
    from superslm.engine import Request

    model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype)
    engine = model.engine(slots=1, context=model.checked_context(ns.context))
    if ns.prompt_file is not None:
        text = Path(ns.prompt_file).read_text(encoding="utf-8")
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
    if ns.timings and times:
        first = times[0] - start
        print(f"prompt {len(prompt)} tokens in {first:.3f} s ({len(prompt) / first:.1f} tok/s); answer {n} tokens "
              f"in {end - start:.3f} s ({max(n - 1, 0) / max(end - times[0], 1e-9):.1f} tok/s after the first)",
              file=sys.stderr)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    import superslm
    from superslm.engine import Request

    model = superslm.load(ns.model, device=ns.device, dtype=ns.dtype)
    if model.chat_template is None:
        print(f"superslm: error: {model.name} has no chat template (a base model?): use `superslm generate -p TEXT`",
              file=sys.stderr)
        return 2
    engine = model.engine(slots=1, context=model.checked_context(ns.context))
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    messages: list[dict[str, str]] = list(system)
    print("superslm chat: type a message, or /exit (Ctrl-D) to leave, /reset to start over; Ctrl-C stops a reply.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            print("(the conversation is cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = _fitting_prompt(model, engine, messages, len(system))
            reply, end, _ = _stream(engine, Request(prompt=prompt, max_tokens=ns.max_tokens, sampling=_sampling(ns)),
                                 interruptible=True)
        except SuperSLMError as e:
            messages.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # before the reply started (the prompt was being built): no reply to keep
            messages.pop()
            print("\n(stopped)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
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
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    gen = sub.add_parser("generate", help="continue a prompt, streaming the text to stdout")
    _model_args(gen)
    _sampling_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="the prompt; - reads it from standard input")
    src.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    gen.add_argument("--timings", action="store_true",
                     help="print the prompt's and the answer's tokens and speed to stderr at the end")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat that keeps the conversation")
    _model_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.set_defaults(func=cmd_chat)

    # other layers' subcommands; each module imports its heavy dependencies only when run
    from superslm.bench import add_parser as add_bench
    from superslm.cache_cli import add_parsers as add_cache
    from superslm.convert import add_parser as add_convert
    from superslm.embed_cli import add_parser as add_embed
    from superslm.serve.cli import add_parser as add_serve

    add_serve(sub)
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
