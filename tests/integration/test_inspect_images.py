"""``turnstream inspect`` shows where a conversation's images sit (issue 39, point 5): in the
messages that hold them and among the prompt tokens, in place of their placeholder tokens, in
the terminal and on the page. A real process against a real nats-server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from schemas.images import content_digest
from tests.conftest import Log
from tests.helpers.image_sessions import png, with_images
from tests.helpers.sessions import append_only, session_events
from tests.helpers.streams import publish_events
from tests.integration.test_inspect import inspect

pytestmark = pytest.mark.integration

RUN, SESSION = "r-seeing", "s-seeing"
SHOT, LATER = png(3, 64, 48), png(4, 20, 30)


async def test_images_are_shown_in_their_messages_and_in_place_of_their_tokens(
    log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Turn 0's first two prompt tokens stand for SHOT; turn 2's first new one for LATER.
    events = session_events(append_only(3, prompt0=(1, 2, 3, 4)), run=RUN, session=SESSION)
    events = with_images(events, {0: SHOT}, tokens=2)
    events = with_images(events, {2: LATER})
    await publish_events(log.nc, events)
    shot, later = content_digest(SHOT)[:8], content_digest(LATER)[:8]
    prefix_2 = 4 + 2 + (1 + 2)  # turn 2's new prompt starts after turns 0 and 1's context

    done = inspect(log, tiny_model_dir, tmp_path, SESSION, "--run", RUN)

    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"→ user: [image 64x48 sha256:{shot}… 2 tokens at 0..1] obs 0" in out
    assert f"→ tool: [image 20x30 sha256:{later}… 1 tokens at {prefix_2}..{prefix_2}] obs 2" in out
    # Among the tokens: the mark once, then the prompt's other tokens; not the placeholders.
    token_lines = [
        line for line in out.splitlines() if line.startswith(f"[image 64x48 sha256:{shot}")
    ]
    assert len(token_lines) == 1
    assert "── turn 0 · weight_version 0 · finish stop · 4 prompt + 2 generated tokens ──" in out

    page = tmp_path / "seeing.html"
    done = inspect(log, tiny_model_dir, tmp_path, SESSION, "--run", RUN, "--html", str(page))
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    spans = re.findall(
        r'<span class="image" title="image/png sha256:([0-9a-f]{64})">([^<]*)</span>', text
    )
    assert [(d, t) for d, t in spans] == [
        (content_digest(SHOT), f"[image 64x48 sha256:{shot}… 2 tokens at 0..1]"),
        (
            content_digest(LATER),
            f"[image 20x30 sha256:{later}… 1 tokens at {prefix_2}..{prefix_2}]",
        ),
    ]
    # The two placeholder tokens of SHOT are not drawn as tokens: turn 0 shows 2 prompt spans.
    turn_0 = text[text.index('id="turn-0"') : text.index('id="turn-1"')]
    assert turn_0.count('class="tok prompt"') == 2
