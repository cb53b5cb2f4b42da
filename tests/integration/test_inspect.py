"""``turnstream inspect`` (issue 11, point 5) on a known session with a fork, as a real process
against a real nats-server: the terminal view and the HTML page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from schemas.events import SessionEvent
from tests.conftest import Log
from tests.helpers.sessions import TurnSpec, reward, session_events
from tests.helpers.streams import publish_events

pytestmark = pytest.mark.integration

RUN, SESSION = "r-inspect", "s-fork"
HOSTILE = "<script>alert(1)</script>"
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}


def inspect(log: Log, model: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "inspect", *args, "--log.url", log.server.url,
         "--model", str(model), "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def forked_session(tokenizer: Any, *, run: str = RUN) -> list[SessionEvent]:
    """Turn 1 extends turn 0 with a tool result; turn 2 rewrites the history (a fork)."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    question = [{"role": "user", "content": "hi"}]
    t0 = TurnSpec(
        prompt=ids("Q: hi\n"),
        completion=ids("A0"),
        logprobs=[-0.01, -3.0],
        messages=question,
        text="A0",
        weight_version=0,
        extra={"tool_calls": [CALL]},
    )
    tool = {"role": "tool", "tool_call_id": "c1", "content": HOSTILE}
    t1 = TurnSpec(
        prompt=[*t0.context, *ids(f"T: {HOSTILE}\n")],
        completion=ids("B1"),
        messages=[*question, t0.assistant_message, tool],
        text="B1",
        weight_version=1,
    )
    summary = {"role": "user", "content": "(summary of the above)"}
    t2 = TurnSpec(
        prompt=[*ids("Q: hi\n"), *ids("S\n")],
        completion=ids("C2"),
        messages=[*question, summary],
        text="C2",
        weight_version=2,
    )
    return session_events(
        [t0, t1, t2],
        run=run,
        session=SESSION,
        group="g7",
        rewards=[reward(0.25, turn=1, run=run, session=SESSION)],
        final_reward=1.5,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_the_terminal_view_shows_turns_segments_the_fork_and_rewards(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, forked_session(tokenizer))

    done = inspect(log, tiny_model_dir, tmp_path, SESSION, "--run", RUN)

    assert done.returncode == 0, done.stderr
    out = done.stdout
    header = {m[0]: m[1].strip() for m in re.findall(r"^(\w[\w ]*?)  +(.+)$", out, re.M)}
    assert header["run"] == RUN and header["session"] == SESSION and header["group"] == "g7"
    assert header["status"] == "completed" and header["reward"] == "1.5"
    assert header["turns"] == "3" and header["weight versions"] == "0, 1, 2"
    assert header["forks"] == "1" and header["trajectories"] == "2"
    assert header["rewards"] == "default=0.25 (turn 1)"
    # Segment 0 holds turns 0-1 (6 + 2 + 29 + 2 tokens), segment 1 starts with the fork.
    assert f"trajectory {RUN}/{SESSION}/0 · turns 0-1 · 39 tokens, 4 generated" in out
    assert f"trajectory {RUN}/{SESSION}/1 · turn 2 · 10 tokens, 2 generated" in out
    assert (
        "⑂ fork at turn 2: its prompt keeps 6 of turn 1's 39 context tokens and rewrites the "
        "rest: segment 1 starts here" in out
    )
    assert "[6 tokens shared with segment 0]S\nC2" in out  # only the rewritten tokens shown
    # Turn boundaries, with what each turn added, its tokens and its tool calls.
    assert "── turn 0 · weight_version 0 · finish stop · 6 prompt + 2 generated tokens ──" in out
    assert "turn 1 · weight_version 1 · finish stop · 29 prompt + 2 generated tokens · " in out
    assert "reward 0.25 ──" in out
    assert "Q: hi\nA0" in out and f"T: {HOSTILE}\nB1" in out
    assert f"→ tool: [c1] {HOSTILE}" in out and "→ user: (summary of the above)" in out
    assert '⚙ tool call lookup({"q": 1})' in out
    boundaries = [out.index(f"── turn {t} ·") for t in range(3)]
    assert boundaries == sorted(boundaries) and boundaries[1] < out.index("⑂ fork") < boundaries[2]


async def test_the_html_page_has_a_span_per_token_the_fork_and_escapes_model_text(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, forked_session(tokenizer))
    page_path = tmp_path / "view" / "session.html"

    done = inspect(log, tiny_model_dir, tmp_path, SESSION, "--html", str(page_path))

    assert done.returncode == 0, done.stderr
    assert f"wrote session {RUN}/{SESSION} (3 turns, 2 trajectories)" in done.stderr
    page = page_path.read_text()
    assert page.startswith("<!doctype html>") and "<style>" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page  # standalone
    assert "&lt;" in page and "&gt;" in page
    assert "tool: [c1] &lt;script&gt;alert(1)&lt;/script&gt;" in page  # the message, escaped
    span = r'<span class="tok gen" style="background:rgb\([\d,]+\)" title="([^"]+)">([^<]*)</span>'
    generated = re.findall(span, page)
    assert [text for _, text in generated] == ["A", "0", "B", "1", "C", "2"]
    assert generated[0][0] == "id 65 · logprob -0.0100 · p 0.990 · weight_version 0"
    assert generated[1][0] == "id 48 · logprob -3.0000 · p 0.050 · weight_version 0"
    assert generated[-1][0].endswith("weight_version 2")
    # A likely token is green, an unlikely one red.
    colours = re.findall(r'class="tok gen" style="background:rgb\((\d+),(\d+),0\)"', page)
    assert int(colours[0][1]) > int(colours[0][0]) and int(colours[1][0]) > int(colours[1][1])
    prompt = re.findall(
        r'<span class="tok prompt" title="id (\d+) · prompt \(loss_mask 0\)">', page
    )
    assert len(prompt) == 6 + 29 + 2  # segment 1 shows only the two tokens it rewrote
    assert '<p class="fork">⑂ fork at turn 2: its prompt keeps 6 of turn 1' in page
    order = [
        page.index(m) for m in ('id="turn-1"', 'id="segment-1"', 'class="fork"', 'id="turn-2"')
    ]
    assert order == sorted(order)  # the fork opens segment 1, before its first turn
    assert "<th>forks</th><td>1</td>" in page and "<th>weight versions</th><td>0, 1, 2</td>" in page


async def test_an_unknown_session_or_one_in_two_runs_is_a_clear_error(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    unknown = inspect(log, tiny_model_dir, tmp_path, "nope", "--run", RUN)
    assert unknown.returncode == 1
    assert f"session nope has no events in run {RUN} (EVENTS at {log.server.url})" in unknown.stderr

    await publish_events(log.nc, forked_session(tokenizer) + forked_session(tokenizer, run="r2"))
    ambiguous = inspect(log, tiny_model_dir, tmp_path, SESSION)
    assert ambiguous.returncode == 1
    assert (
        f"session {SESSION} has events in runs {RUN}, r2: pick one with --run" in ambiguous.stderr
    )


async def test_per_turn_samples_and_a_session_the_fold_refuses(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, forked_session(tokenizer))

    steps = inspect(log, tiny_model_dir, tmp_path, SESSION, "--run", RUN, "--per-turn")

    assert steps.returncode == 0, steps.stderr
    out = steps.stdout
    assert f"trajectory {RUN}/{SESSION}/1 · turn 1 · 39 tokens, 2 generated" in out
    assert "[8 tokens shared with segment 0]T: " in out  # turn 1 extends turn 0: no fork
    assert out.count("⑂ fork") == 1 and "segment 2 starts here" in out

    # Turn 1 never reached the log: the close says 3 turns, so the fold refuses the session.
    gap = [e for e in forked_session(tokenizer, run="r-gap") if getattr(e, "turn", None) != 1]
    await publish_events(log.nc, gap)

    shown = inspect(log, tiny_model_dir, tmp_path, SESSION, "--run", "r-gap")

    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^not folded +run=r-gap session=s-fork: missing turn", shown.stdout, re.M)
    assert re.search(r"^trajectories +- *$", shown.stdout, re.M)
    assert (
        "not folded: each turn's prompt delta and completion as stored · turns 0, 2 · "
        in shown.stdout
    )
    assert "Q: hi\nA0" in shown.stdout and "S\nC2" in shown.stdout
