"""superslm.sampling.stops: stop strings over streamed text pieces.

The reference is a direct character-level definition: walk the full text one character at a time
and stop at the first position where some stop string ends (the longest one if several end
there); the output is the text before it.
"""

from __future__ import annotations

import json
import random

import pytest

from superslm.errors import InvalidArgument
from superslm.sampling import StopChecker


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """(text before the first stop string to complete, that stop string) by a character walk."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)  # same end: the one that starts first
            return text[: end - len(s)], s
    return text, None


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str | None, str]:
    """Feed pieces; return (emitted per push, stopped, stop string, flushed text)."""
    checker = StopChecker(stops)
    emitted = []
    stopped, which = False, None
    for piece in pieces:
        res = checker.push(piece)
        emitted.append(res.text)
        if res.stopped:
            stopped, which = True, res.stop
    return emitted, stopped, which, checker.flush()


def test_no_stop_strings_pass_through() -> None:
    emitted, stopped, _, rest = run([], ["a", "", "bc", "ST"])
    assert emitted == ["a", "", "bc", "ST"] and not stopped and rest == ""


def test_stop_split_across_pieces() -> None:
    emitted, stopped, which, _ = run(["STOP"], ["abc ST", "O", "P tail"])
    assert emitted == ["abc ", "", ""] and stopped and which == "STOP"


def test_prefix_that_is_not_a_stop_is_released() -> None:
    emitted, stopped, _, rest = run(["</end>"], ["a</e", "n", "x", "yz"])
    assert emitted == ["a", "", "</enx", "yz"] and not stopped and rest == ""


def test_held_tail_is_flushed_at_the_end() -> None:
    emitted, stopped, _, rest = run(["</end>"], ["hello </en"])
    assert emitted == ["hello "] and not stopped and rest == "</en"


def test_several_stop_strings_first_to_end_wins() -> None:
    # "b" completes before "abc" does, whether the text arrives at once or char by char
    for pieces in (["xabc"], ["x", "a", "b", "c"]):
        emitted, stopped, which, _ = run(["abc", "b"], pieces)
        assert "".join(emitted) == "xa" and which == "b"
    # same end: the longer one (starting first) wins
    emitted, _, which, _ = run(["bc", "abc"], ["xxabcyy"])
    assert emitted == ["xx"] and which == "abc"


def test_stop_at_the_very_start() -> None:
    emitted, stopped, which, rest = run(["<|im_end|>"], ["<|im_end|>more"])
    assert emitted == [""] and stopped and which == "<|im_end|>" and rest == ""


def test_pushes_after_stop_return_nothing() -> None:
    checker = StopChecker(["."])
    assert checker.push("Hi. there").text == "Hi"
    res = checker.push("more")
    assert res.text == "" and res.stopped and res.stop == "."
    assert checker.flush() == ""


def test_multibyte_characters() -> None:
    emitted, stopped, which, _ = run(["。", "🙂!"], ["日本", "語", "🙂", "?と", "き。", "後"])
    assert "".join(emitted) == "日本語🙂?とき" and which == "。"
    emitted, stopped, which, _ = run(["🙂!"], ["a🙂", "!"])
    assert emitted == ["a", ""] and which == "🙂!"
    emitted, stopped, _, rest = run(["éclair"], ["un é", "cl", "at"])
    assert emitted == ["un ", "", "éclat"] and not stopped and rest == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(InvalidArgument, match=r"stop\[1\]"):
        StopChecker(["ok", ""])


def test_state_round_trip_mid_stream() -> None:
    stops = ["ENDING", "x!"]
    text = "the ENDIN stuff x! more"
    a = StopChecker(stops)
    out_a = [a.push(c).text for c in text[:9]]
    b = StopChecker.from_state(json.loads(json.dumps(a.state())))
    assert b.held == a.held == "ENDIN"
    rest_a = [a.push(c) for c in text[9:]]
    rest_b = [b.push(c) for c in text[9:]]
    assert rest_a == rest_b
    assert "".join(out_a) + "".join(r.text for r in rest_b) == reference(text, stops)[0] == "the ENDIN stuff "


def word(rnd: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rnd.choice(alphabet) for _ in range(rnd.randint(lo, hi)))


@pytest.mark.parametrize("seed", range(6))
def test_any_chunking_matches_reference(seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = "ab c\né日"
    for _ in range(150):
        stops = [word(rnd, alphabet, 1, 4) for _ in range(rnd.randint(1, 3))]
        text = word(rnd, alphabet, 0, 30)
        cuts = sorted(rnd.sample(range(len(text) + 1), k=min(len(text) + 1, rnd.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        emitted, stopped, which, rest = run(stops, pieces)
        want, want_stop = reference(text, stops)
        assert "".join(emitted) + rest == want, (stops, pieces)
        assert (stopped, which) == (want_stop is not None, want_stop), (stops, pieces)
        # nothing emitted so far ever contains a stop string
        so_far = ""
        for piece in emitted:
            so_far += piece
            assert not any(s in so_far for s in stops)


@pytest.mark.parametrize("seed", range(4))
def test_unchecked_pieces_then_checked_as_vllm(seed: int) -> None:
    """min_tokens: the first pieces pass unchecked; from then on a stop string counts when it ends in the new
    piece, even where it starts in the unchecked text (vLLM searches back len(stop) - 1 characters). Which stop
    ends the text and where: the first occurrence ending at or after the first checked character."""
    rnd = random.Random(seed)
    for _ in range(200):
        stops = [word(rnd, "ab", 1, 3) for _ in range(rnd.randint(1, 2))]
        pieces = [word(rnd, "ab", 0, 3) for _ in range(rnd.randint(1, 8))]
        free = rnd.randint(0, len(pieces))
        c, emitted, stopped = StopChecker(stops), "", None
        for i, piece in enumerate(pieces):
            r = c.push(piece, check=i >= free)
            emitted += r.text
            if r.stopped:
                stopped = r.stop
                break
        unchecked = len("".join(pieces[:free]))
        text = "".join(pieces)
        ends = [(text.find(s, max(0, unchecked - len(s) + 1)) + len(s), s) for s in stops
                if text.find(s, max(0, unchecked - len(s) + 1)) >= 0]
        if not ends:
            assert stopped is None and emitted + c.flush() == text
            continue
        end, stop = min(ends, key=lambda e: (e[0], e[0] - len(e[1])))
        start = end - len(stop)
        assert stopped == stop, (stops, pieces, free)
        assert emitted == text[: max(start, unchecked)]  # what passed unchecked stays
        # a round trip through state() in the middle changes nothing
        again = StopChecker.from_state(json.loads(json.dumps(c.state())))
        assert again.push("ab").stopped
