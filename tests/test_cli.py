"""The `superslm` command as a user runs it: info, generate, chat (a subprocess each)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import build_hf_model


def superslm(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "superslm.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_info_of_gguf(smollm2_gguf: Path) -> None:
    r = superslm("info", str(smollm2_gguf), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["arch"]["family"] == "llama" and info["arch"]["layers"] == 30
    assert info["block_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert 130e6 < info["parameters"] < 140e6
    assert "<|im_start|>" in info["chat_template"] and "converted" not in info
    text = superslm("info", str(smollm2_gguf)).stdout
    assert "rotary_dim" in text and "Q4_1" in text


def test_generate_default_model_answers(smollm2_gguf: Path) -> None:
    r = superslm("generate", "--model", str(smollm2_gguf), "--chat", "--prompt", "What is 2+2?", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout


def test_generate_known_name_and_sampling(smollm2_gguf: Path) -> None:
    # the known name resolves to the cached fetch (no network once fetched)
    args = ["generate", "--model", "smollm2", "-p", "Once upon a time", "--max-tokens", "8",
            "--temperature", "0.8", "--seed", "3"]
    a, b = superslm(*args), superslm(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and len(a.stdout.strip()) > 0


def test_chat_keeps_the_conversation(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path)
    r = superslm("chat", "--model", str(tmp_path), "--max-tokens", "4", stdin="hello\nand again\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") >= 2  # one streamed answer line per message


@pytest.mark.parametrize("args", [["info", "/no/such/model"], ["generate", "-m", "nope-model", "-p", "x"],
                                  ["generate", "--device", "meta", "-p", "x"], ["serve", "--port", "99999"],
                                  ["serve", "--max-waiting", "-1"], ["convert", "/no/such/model", "/proc/no/such"]])
def test_errors_are_clear(args: list[str]) -> None:
    r = superslm(*args)
    assert r.returncode == 2
    assert "error:" in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr


def test_version_threads_and_the_readme_names() -> None:
    r = superslm("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("superslm ")
    import torch

    import superslm as lib

    assert lib.DampedGreedy is lib.sampling.DampedGreedy  # the README's Sampling(damped=DampedGreedy())
    before = torch.get_num_threads()
    try:
        assert lib.set_threads(1) == 1 and torch.get_num_threads() == 1
        assert lib.set_threads() == len(os.sched_getaffinity(0))
        for bad in (0, -2, 1.5, True):
            with pytest.raises(lib.errors.InvalidArgument):
                lib.set_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_threads_and_a_positional_model_on_every_command(tmp_path: Path) -> None:
    """Each command takes --threads (the kernels' threads, as llama.cpp's -t), and serve takes its model as
    the other commands do, without --model."""
    from superslm.cli import build_parser

    build_hf_model("llama", tmp_path)
    parser = build_parser()
    for argv in (["generate", "-p", "x"], ["chat"], ["serve"], ["info"], ["convert", "a", "b"]):
        assert parser.parse_args([*argv, "--threads", "1"]).threads == 1, argv
    assert parser.parse_args(["serve", str(tmp_path)]).models_pos == [str(tmp_path)]
    r = superslm("generate", "--model", str(tmp_path), "-p", "hi", "--max-tokens", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    bad = superslm("generate", "--model", str(tmp_path), "-p", "hi", "--threads", "0")
    assert bad.returncode == 2 and "threads must be a positive integer" in bad.stderr


def test_chat_as_people_keep_it_open(tmp_path: Path) -> None:
    """/reset says so; a conversation longer than the context drops its oldest turns instead of failing every
    later message; a base model (no template) is refused at start, not at every message."""
    build_hf_model("llama", tmp_path)
    chat = ["chat", "--model", str(tmp_path), "--max-tokens", "6", "--context", "96"]
    lines = "".join(f"message number {i} with some words in it\n" for i in range(12))
    r = superslm(*chat, stdin=lines + "/reset\nagain\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "error:" not in r.stderr and "(dropped the" in r.stderr and "(the conversation is cleared)" in r.stderr
    assert r.stdout.count("\n") >= 13  # every message answered
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    base = superslm("chat", "--model", str(tmp_path), stdin="hello\n")
    assert base.returncode == 2 and "no chat template" in base.stderr and "superslm generate" in base.stderr


def test_ctrl_c_stops_a_reply_and_keeps_the_chat(tmp_path: Path) -> None:
    import signal
    import time

    build_hf_model("llama", tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a context far past the tiny model's 512 positions: the reply cannot end before the signal comes (at 512 a
    # loaded machine saw it end first)
    proc = subprocess.Popen([sys.executable, "-m", "superslm.cli", "chat", "--model", str(tmp_path), "--max-tokens",
                             "100000", "--context", "50000", "--allow-long-context"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"tell me everything\n")
    proc.stdin.flush()
    proc.stdout.read(3)  # input()'s "> ", then the reply's first character: the reply has started
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    out, err = proc.communicate(b"/reset\n/exit\n", timeout=300)  # the chat goes on after the stop
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"(stopped)" in err and b"(the conversation is cleared)" in err and b"Traceback" not in err


def test_a_context_past_the_trained_positions_is_refused(tmp_path: Path) -> None:
    """--context 100000 on an 8k model was accepted and ran for minutes of noise; the tiny model has 512."""
    build_hf_model("llama", tmp_path)
    for cmd in (["generate", "-p", "hi"], ["chat"]):
        r = superslm(*cmd, "--model", str(tmp_path), "--context", "100000", stdin="hi\n")
        assert r.returncode == 2 and "past the 512 positions" in r.stderr, r.stderr
    ok = superslm("generate", "-p", "hi", "--model", str(tmp_path), "--context", "512", "--max-tokens", "2")
    assert ok.returncode == 0, ok.stderr


def test_generate_reads_its_prompt_from_stdin_or_a_file_and_prints_timings(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path / "m")
    base = ["generate", "--model", str(tmp_path / "m"), "--max-tokens", "4", "--temperature", "0"]
    direct = superslm(*base, "-p", "Once upon a time")
    piped = superslm(*base, "-p", "-", stdin="Once upon a time")
    (tmp_path / "p.txt").write_text("Once upon a time")
    filed = superslm(*base, "--prompt-file", str(tmp_path / "p.txt"), "--timings")
    assert direct.returncode == piped.returncode == filed.returncode == 0, filed.stderr
    assert direct.stdout == piped.stdout == filed.stdout and direct.stdout.strip()
    assert re.search(r"prompt \d+ tokens in [\d.]+ s \([\d.]+ tok/s\); answer 4 tokens in", filed.stderr), filed.stderr
    both = superslm(*base, "-p", "x", "--prompt-file", str(tmp_path / "p.txt"))
    assert both.returncode == 2 and "not allowed with" in both.stderr


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_commands_save_load_system_stats(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path / "m")
    saved = tmp_path / "talk.json"
    script = (f"/system Answer briefly.\n/system\nhello there\n/stats\n/save {saved}\n/reset\n/stats\n"
              f"/load {saved}\n/stats\n/load {tmp_path / 'missing.json'}\n/frobnicate\n/help\n/exit\n")
    r = superslm("chat", "--model", str(tmp_path / "m"), "-n", "3", "-c", "128", "-t", "1", stdin=script)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "(system message set)" in err and "(system: Answer briefly.)" in err
    stats = re.findall(r"\(conversation: (\d+) messages, (\d+) of 128 context tokens; (.*)\)", err)
    assert [s[0] for s in stats] == ["3", "1", "3"], err  # system + user + reply; after /reset the system alone
    assert "last reply: prompt" in stats[0][2] and "tok/s" in stats[0][2]
    assert stats[0][1] == stats[2][1] and int(stats[1][1]) < int(stats[0][1])
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["messages"][1]["content"] == "hello there"
    assert "cannot read a conversation" in err and "(unknown command /frobnicate" in err and "/save FILE" in err
    assert not list(tmp_path.glob(".*.partial"))  # written whole, no leftover


def test_a_chat_template_file_and_a_long_context_when_asked(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "t.jinja").write_text(CHATML)
    base = superslm("chat", "--model", str(tmp_path / "m"), stdin="hello\n")
    assert base.returncode == 2 and "--chat-template" in base.stderr
    r = superslm("chat", "--model", str(tmp_path / "m"), "--chat-template", str(tmp_path / "t.jinja"), "-n", "2",
                 stdin="hello\n/exit\n")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    g = superslm("generate", "--model", str(tmp_path / "m"), "--chat-template", str(tmp_path / "t.jinja"), "--chat",
                 "-p", "hi", "-n", "2", "-c", "1024", "--allow-long-context", "--verbose")
    assert g.returncode == 0, g.stderr
    assert "warning: a context of 1024 is past the 512 positions" in g.stderr
    assert re.search(r"loaded \S+ in [\d.]+ s", g.stderr) and "tok/s after the first" in g.stderr
    (tmp_path / "bad.jinja").write_text("{% for %}")
    bad = superslm("chat", "--model", str(tmp_path / "m"), "--chat-template", str(tmp_path / "bad.jinja"))
    assert bad.returncode == 2 and "superslm: error:" in bad.stderr and "Traceback" not in bad.stderr


def test_every_option_has_help_and_says_its_default() -> None:
    import argparse

    from superslm.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"superslm {name} {a.option_strings or a.dest} has no help"
            if a.default not in (None, False, [], argparse.SUPPRESS) and not a.required:
                assert "default" in a.help, f"superslm {name} {a.option_strings}: its default {a.default!r} unsaid"
    serve = sub.choices["serve"].parse_args(["--max-model-len", "300", "--max-num-seqs", "3", "-t", "1"])
    assert (serve.context, serve.slots, serve.threads) == (300, 3, 1)  # vLLM's names


class _Terminal:
    """`superslm` in a pseudo-terminal, as a person runs it: what it prints (`seen`, all of it in `transcript`)."""

    def __init__(self, argv: list[str]) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat, on the terminal
            os.execve(sys.executable, argv, dict(os.environ, PYTHONUNBUFFERED="1", TERM="xterm"))
        self.seen, self.transcript = bytearray(), bytearray()

    def read(self, timeout: float) -> None:
        import select

        if select.select([self.fd], [], [], timeout)[0]:
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                raise AssertionError(f"the chat ended: {bytes(self.transcript[-2000:])!r}") from None
            self.seen.extend(data)
            self.transcript.extend(data)

    def until(self, token: bytes, timeout: float = 120) -> None:
        """Wait for `token`; what came before it and the token itself are consumed."""
        import time

        deadline = time.monotonic() + timeout
        while token not in self.seen:
            assert time.monotonic() < deadline, f"no {token!r} in {bytes(self.seen[-2000:])!r}"
            self.read(0.5)
        del self.seen[: self.seen.index(token) + len(token)]

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        assert os.WIFEXITED(status)
        return os.WEXITSTATUS(status)

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.close(self.fd)


def test_chat_in_a_terminal_recalls_history_and_survives_ctrl_c(tmp_path: Path) -> None:
    """In a pseudo-terminal, as a person runs it: Ctrl-C (the terminal's, a SIGINT) stops a reply and the chat goes
    on; the up arrow recalls the last line (readline); the conversation saved after has both turns."""
    import time

    build_hf_model("llama", tmp_path / "m")
    saved = tmp_path / "talk.json"
    # a context far past the tiny model's 512 positions: its replies run long enough to be stopped
    term = _Terminal([sys.executable, "-m", "superslm.cli", "chat", "--model", str(tmp_path / "m"), "-n", "100000",
                      "-c", "50000", "--allow-long-context", "-t", "1"])
    try:
        term.until(b"> ")
        term.write(b"tell me everything\r")
        term.until(b"tell me everything\r\n")  # the terminal's echo; the reply streams after it
        deadline = time.monotonic() + 60
        while len(term.seen) < 3 and time.monotonic() < deadline:  # its first characters: the reply runs
            term.read(0.2)
        term.write(b"\x03")  # Ctrl-C
        term.until(b"(stopped)\r\n> ")  # then the prompt (a "> " inside a reply is no prompt)
        term.write(b"\x1b[A\r")  # the up arrow: the last line again
        term.until(b"tell me everything")
        time.sleep(0.3)
        term.write(b"\x03")
        term.until(b"(stopped)\r\n> ")
        time.sleep(0.5)  # readline has the terminal
        term.write(b"\x03")  # Ctrl-C at the prompt: the chat stays
        term.until(b"Ctrl-D or /exit leaves")
        term.write(f"/save {saved}\r".encode())
        term.until(b"(saved 4 messages")
        term.write(b"/exit\r")
        assert term.wait() == 0
    finally:
        term.close()
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == messages[2]["content"] == "tell me everything"


def test_chat_in_a_terminal_drops_the_oldest_turns_when_the_context_is_full(tmp_path: Path) -> None:
    """In a pseudo-terminal, a conversation longer than a 96-token context: the chat says it dropped the oldest
    messages (as the README and --help say) and answers every message; none fails."""
    build_hf_model("llama", tmp_path / "m")
    term = _Terminal([sys.executable, "-m", "superslm.cli", "chat", "--model", str(tmp_path / "m"), "-n", "6",
                      "-c", "96", "-t", "1"])
    try:
        term.until(b"> ")
        for i in range(10):
            term.write(f"message number {i} with some words in it\r".encode())
            term.until(f"message number {i} with some words in it\r\n".encode())  # the echo, then the reply
            term.until(b"\r\n> ")
        term.write(b"/exit\r")
        assert term.wait() == 0
    finally:
        term.close()
    out = bytes(term.transcript)
    assert b"(dropped the" in out and b"oldest messages to fit the 96-token context)" in out
    assert b"error:" not in out and b"Traceback" not in out
