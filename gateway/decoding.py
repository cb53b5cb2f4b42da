"""Turning streamed token ids into text as the client sees it.

Incremental detokenization in O(n) (the vLLM approach: decode a short window and emit the
difference, holding back an incomplete UTF-8 sequence), stop strings (generation stops at the
first match; the text is cut before it, the tokens the model sampled are kept), and how much of
the text is safe to stream now: not the tail that may still become a stop string or the start of
a tool call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.backends.interface import TopLogprob

__all__ = ["Detokenizer"]

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    """Accumulates a completion's tokens and its text (special tokens skipped)."""

    def __init__(self, decode: Decode, stop_strings: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stop_strings = [s for s in stop_strings if s]
        self._holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        # The alternatives the backend gave, an empty list per token before them that had none;
        # the rest filled in when read (top_logprobs): most turns ask for none, and a list per
        # token was ~0.35 µs of a generated token's ~2.
        self._tops: list[list[TopLogprob]] = []
        self.text = ""
        self.stopped = False  # a stop string matched: generation must end
        self._prefix_offset = 0
        self._read_offset = 0

    def add(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        tops: Sequence[list[TopLogprob]] | None = None,
    ) -> None:
        start = len(self.ids)
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        if tops:
            self._pad(start)
            self._tops.extend(tops)
        if self.stopped:
            return
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            searched_from = max(len(self.text) - self._holdback, 0)
            self.text += window[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._check_stop(searched_from)

    @property
    def top_logprobs(self) -> list[list[TopLogprob]]:
        """The alternatives at each generated token, best first (empty where none were given)."""
        self._pad(len(self.ids))
        return self._tops

    def _pad(self, count: int) -> None:
        if len(self._tops) < count:
            self._tops.extend([] for _ in range(count - len(self._tops)))

    def finish(self) -> None:
        """Generation ended: flush text held back for an incomplete UTF-8 sequence."""
        if not self.stopped and self._read_offset < len(self.ids):  # else: nothing held back
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            window = self._decode(self.ids[self._prefix_offset :])
            searched_from = max(len(self.text) - self._holdback, 0)
            self.text += window[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self.ids)
            self._check_stop(searched_from)
        self.stopped = True

    def _check_stop(self, start: int) -> None:
        hits = [i for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def streamable(self, limit: int | None = None) -> str:
        """The text that can be sent now: all of it once stopped, else without the tail that
        could still turn into a stop string, and at most ``limit`` characters."""
        end = len(self.text) if self.stopped else max(len(self.text) - self._holdback, 0)
        if not self.stop_strings:
            end = len(self.text)
        return self.text[: end if limit is None else min(end, limit)]
