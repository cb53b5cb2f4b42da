"""The words ``turnstream inspect`` uses for messages, tool calls and numbers. Pure.

Both renderers (terminal, HTML) and both view models (the turn tree, the segments) take their
text from here, so every place says the same. Everything that comes from the agent or the model
goes through ``printable``: a terminal escape in model output is shown, not obeyed.

>>> message_text({"role": "user", "content": [{"type": "text", "text": "hi"}]})
'user: hi'
>>> first_words("user: one two three four five six seven eight nine ten", 4)
'user: one two three …'

An image (issue 39) is shown where it sits: in a message, by its size, digest and the prompt
tokens that stand for it (``image_text``); among the tokens, as that one mark in place of its
placeholder tokens (``turnstream.inspect.view.prompt_items``).

>>> ref = ImageRef("1a2b3c4d" * 8, offset=120, length=256, width=640, height=480)
>>> image_text(ref)
'[image 640x480 sha256:1a2b3c4d… 256 tokens at 120..375]'
>>> from schemas.images import image_part
>>> turn = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[0] * 400, completion_ids=[],
...     logprobs=[], images=[ref], new_messages=[{"role": "user", "content": [
...     image_part(ref.sha256, 640, 480), {"type": "text", "text": "what is this?"}]}])
>>> new_message_texts(turn)
['user: [image 640x480 sha256:1a2b3c4d… 256 tokens at 120..375] what is this?']
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

from schemas.events import JSON, TurnCompleted
from schemas.images import ImageRef, part_digest

__all__ = [
    "first_words",
    "image_text",
    "message_text",
    "new_message_texts",
    "number",
    "printable",
    "tool_call_text",
    "version_marks",
    "version_story",
]

_SHOWN_CHARS = 300  # of each message's content


def printable(text: str) -> str:
    """``text`` with control characters (a terminal escape in model output) made visible."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def image_text(ref: ImageRef) -> str:
    """An image where it sits: its size, digest (short) and its placeholder tokens."""
    return (
        f"[image {ref.width}x{ref.height} sha256:{ref.sha256[:8]}… {ref.length} tokens at "
        f"{ref.offset}..{ref.end - 1}]"
    )


def _part_text(part: object, refs: list[ImageRef]) -> str:
    digest = part_digest(part)
    if digest is None:
        return str(part.get("text", part)) if isinstance(part, dict) else str(part)
    ref = next((r for r in refs if r.sha256 == digest), None)
    if ref is None:  # its tokens are not the turn's own (in a prefix it shares)
        assert isinstance(part, dict)
        return f"[image {part.get('width')}x{part.get('height')} sha256:{digest[:8]}…]"
    refs.remove(ref)
    return image_text(ref)


def new_message_texts(turn: TurnCompleted) -> list[str]:
    """The turn's new messages, each image by its own tokens (``turn.images``, in order)."""
    refs = list(turn.images)
    return [message_text(message, refs) for message in turn.new_messages]


def message_text(message: JSON, images: list[ImageRef] | None = None) -> str:
    """One line of a message; its images with their tokens where ``images`` (the refs of its
    turn not yet shown, taken in order) has them."""
    content: Any = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        refs = images if images is not None else []
        content = " ".join(_part_text(part, refs) for part in content)
    text = content if isinstance(content, str) else json.dumps(content)
    if message.get("tool_call_id"):
        text = f"[{message['tool_call_id']}] {text}"
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + f"… ({len(text)} chars)"
    return printable(f"{message.get('role', '?')}: {text}")


def first_words(text: str, words: int, max_chars: int = 60) -> str:
    """The first ``words`` words of ``text`` on one line, at most ``max_chars`` long."""
    split = text.split()
    shown = " ".join(split[:words])
    if len(shown) > max_chars:
        shown = shown[: max_chars - 1].rstrip()
    elif len(split) <= words:
        return shown
    return f"{shown} …"


def tool_call_text(call: JSON) -> str:
    function = call.get("function") or {}
    return printable(f"tool call {function.get('name', '?')}({function.get('arguments', '')})")


def version_story(turn: TurnCompleted) -> list[str]:
    """How a turn's tokens came to be, where not in one go by one version (issue 37): each
    version boundary (the token it falls before, and whether the gateway continued the turn
    there after an abort or the weights changed under a running generation), each continuation
    that kept the version, and a version nobody could know. [] for a turn of one generation by
    one version, which is shown as it always was.

    >>> t = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1], completion_ids=[2] * 26,
    ...                   logprobs=[0.0] * 26, weight_version=3, version_spans=[(3, 17), (4, 9)],
    ...                   sampling={"continued": [{"at": 17, "seed": 123}]})
    >>> version_story(t)
    ['versions 3→4 at token 17 (continued after an abort)']
    """
    continued = [at for at, _ in turn.continuations()]
    spans = turn.version_spans or []
    story: list[str] = []
    if len(spans) == 1 and spans[0][0] is None:
        story.append("version ? (unknown)")
    boundaries: set[int] = set()
    at = 0
    for (before, count), (after, _) in pairwise(spans):
        at += count
        if before == after:
            continue
        boundaries.add(at)
        how = "continued after an abort" if at in continued else "the weights changed under it"
        story.append(f"versions {_version(before)}→{_version(after)} at token {at} ({how})")
    story.extend(
        f"continued after an abort at token {at} (same version)"
        for at in continued
        if at not in boundaries
    )
    return story


def version_marks(turn: TurnCompleted) -> dict[int, str]:
    """The marks to draw among a turn's completion tokens: before the token at each version
    boundary (``⟨v3→v4⟩``, ``?`` where unknown) and each continuation point (``⟨continued⟩``).
    {} for a turn of one generation by one version."""
    marks = {at: "⟨continued⟩" for at, _ in turn.continuations()}
    spans = turn.version_spans or []
    at = 0
    for (before, count), (after, _) in pairwise(spans):
        at += count
        if before != after:
            marks[at] = f"⟨v{_short(before)}→v{_short(after)}⟩"
    return marks


def _version(version: int | None) -> str:
    return "? (unknown)" if version is None else str(version)


def _short(version: int | None) -> str:
    return "?" if version is None else str(version)
