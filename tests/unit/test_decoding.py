"""Incremental detokenization, stop strings and what may be streamed (gateway.decoding)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends.interface import TopLogprob
from gateway.decoding import Detokenizer


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer's decode: every id is one byte."""
    return bytes(ids).decode(errors="replace")


def feed(detok: Detokenizer, data: bytes, step: int = 1) -> list[str]:
    seen = []
    for i in range(0, len(data), step):
        chunk = list(data[i : i + step])
        detok.add(chunk, [-0.5] * len(chunk))
        seen.append(detok.text)
        if detok.stopped:
            break
    return seen


def test_a_character_split_across_tokens_never_shows_half() -> None:
    detok = Detokenizer(byte_decode)
    seen = feed(detok, "héllo ✓".encode())
    assert all("\ufffd" not in text for text in seen)
    detok.finish()
    assert detok.text == "héllo ✓"
    assert len(detok.ids) == len("héllo ✓".encode()) == len(detok.logprobs)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("abc STOP def", ["STOP"], "abc "),
        ("abc STOP def", ["ST", "abc"], ""),
        ("no stop here", ["zzz"], "no stop here"),
        ("x\n\ny", ["\n\n"], "x"),
    ],
    ids=["middle", "earliest-wins", "none", "newlines"],
)
def test_stop_strings_cut_the_text_and_keep_the_sampled_tokens(
    text: str, stops: list[str], expected: str
) -> None:
    detok = Detokenizer(byte_decode, stops)
    feed(detok, text.encode())
    detok.finish()
    assert detok.text == expected
    # tokens up to the one completing the stop string were sampled and are kept
    assert len(detok.ids) >= len(expected.encode())


def test_a_stop_string_spanning_chunks_is_found() -> None:
    detok = Detokenizer(byte_decode, ["<END>"])
    feed(detok, b"hello <EN", step=3)
    assert not detok.stopped
    detok.add(list(b"D> more"), [0.0] * 7)
    assert detok.stopped and detok.text == "hello "


def test_streamable_holds_back_a_possible_stop_string_start() -> None:
    detok = Detokenizer(byte_decode, ["STOP"])
    feed(detok, b"hello ST")
    assert detok.streamable() == "hello"  # "hello ST"[: -3]: the tail may still become STOP
    assert detok.streamable(limit=2) == "he"
    detok.finish()
    assert detok.streamable() == "hello ST"


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60), st.integers(1, 7))
def test_any_text_in_any_chunking_comes_out_whole(text: str, step: int) -> None:
    detok = Detokenizer(byte_decode)
    feed(detok, text.encode(), step)
    detok.finish()
    assert detok.text == text


def test_alternatives_stay_at_their_tokens_when_only_some_chunks_have_them() -> None:
    detok = Detokenizer(byte_decode)
    detok.add([104, 105], [-0.1, -0.2])  # no alternatives: none asked for, or none sent
    detok.add([33], [-0.3], [[TopLogprob(33, -0.3), TopLogprob(46, -1.5)]])
    detok.add([10, 10], [-0.4, -0.5])
    assert detok.top_logprobs == [[], [], [TopLogprob(33, -0.3), TopLogprob(46, -1.5)], [], []]
    assert Detokenizer(byte_decode).top_logprobs == []
