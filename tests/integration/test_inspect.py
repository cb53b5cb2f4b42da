"""``turnstream inspect`` (issue 11, point 5) on a known session with a fork, as a real process
against a real nats-server: the terminal view and the HTML page. Issue 18, point 4: the session's
turn tree, for a branched session (interleaved conversations and an edited history) and a linear
one (one flat path)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from schemas.events import SessionEvent
from tests.conftest import Log
from tests.helpers.sessions import TurnSpec, reward, session_events
from tests.helpers.streams import publish_events
from tests.helpers.tree_sessions import TreeTurn, tree_session

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
    """Turn 1 extends turn 0 with a tool result; turn 2 rewrites the history after turn 0's
    reply, which it keeps (a fork: it shares generated tokens)."""

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
        prompt=[*t0.context, *ids("S\n")],
        completion=ids("C2"),
        messages=[*question, t0.assistant_message, summary],
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
    assert f"trajectory {RUN}/{SESSION}/1 · turn 2 · 12 tokens, 2 generated" in out
    assert (
        "⑂ fork at turn 2: its prompt keeps 8 of turn 1's 39 context tokens and rewrites the "
        "rest: segment 1 starts here" in out
    )
    assert "[8 tokens shared with segment 0]S\nC2" in out  # only the rewritten tokens shown
    # Turn boundaries, with what each turn added, its tokens and its tool calls.
    assert "── turn 0 · weight_version 0 · finish stop · 6 prompt + 2 generated tokens ──" in out
    assert "turn 1 · weight_version 1 · finish stop · 29 prompt + 2 generated tokens · " in out
    assert "reward 0.25 ──" in out
    assert "Q: hi\nA0" in out and f"T: {HOSTILE}\nB1" in out
    assert f"→ tool: [c1] {HOSTILE}" in out and "→ user: (summary of the above)" in out
    assert '⚙ tool call lookup({"q": 1})' in out
    boundaries = [out.index(f"── turn {t} ·") for t in range(3)]
    fork = out.index("⑂ fork at")
    assert boundaries == sorted(boundaries) and boundaries[1] < fork < boundaries[2]
    # The tree: turn 1 continues turn 0, turn 2 forks from turn 1.
    assert "turn 1 · segment 0 · continues turn 0 · 8 shared + 29 prompt + 2 generated" in out
    assert "turn 2 · segment 1 · ⑂ fork of turn 1 · 8 shared + 2 prompt + 2 generated" in out


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
    assert '<p class="fork">⑂ fork at turn 2: its prompt keeps 8 of turn 1' in page
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
    assert out.count("⑂ fork at") == 1 and "segment 2 starts here" in out
    assert "turn 2 · segment 2 · ⑂ fork of turn 1" in out  # relations from the chains

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
    assert "turn 2 · parent turn 1 not in the log" in shown.stdout


# -- the turn tree (issue 18) -------------------------------------------------------------------

TREE = "s-tree"


def branched_session(tokenizer: Any) -> list[SessionEvent]:
    """Conversations A and B take turns under one system prompt (B: a new conversation from
    turn 0), and turn 5 edits A's history after turn 2, keeping turn 0's reply (a fork)."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    system = {"role": "system", "content": "be brief"}
    a, b = {"role": "user", "content": "add 2+2"}, {"role": "user", "content": "name a colour"}
    t0 = TreeTurn(-1, ids("S: be brief\nQ: add 2+2\n"), ids("A0"), [system, a], "A0")
    t1 = TreeTurn(0, ids("S: be brief\nQ: name a colour\n"), ids("B1"), [system, b], "B1", 1)

    turns = [t0, t1]

    def after(parent: int, observation: str, reply: str) -> None:
        above = turns[parent]
        tool = {"role": "tool", "content": observation}
        history = [*above.messages, above.assistant_message, tool]
        prompt = [*above.context, *ids(f"T: {observation}\n")]
        turns.append(TreeTurn(parent, prompt, ids(reply), history, reply, len(turns)))

    after(0, "4", "A2")
    after(1, "red", "B3")
    after(2, "ok", "A4")
    edited = {"role": "tool", "content": HOSTILE}
    turns.append(
        TreeTurn(
            2, [*t0.context, *ids(f"T: {HOSTILE}\n")], ids("E5"),
            [system, a, t0.assistant_message, edited], "E5", 5,
        )
    )  # fmt: skip
    rewards = [reward(0.25, turn=3, run=RUN, session=TREE)]
    return tree_session(turns, run=RUN, session=TREE, extra=rewards, final_reward=1.0)


def linear_session(tokenizer: Any) -> list[SessionEvent]:
    """Three turns, each extending the one before, as events older than parent_turn."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    specs: list[TurnSpec] = []
    context: list[int] = []
    for t in range(3):
        prompt = [*context, *ids(f"Q{t}\n")]
        specs.append(TurnSpec(prompt=prompt, completion=ids(f"R{t}"), text=f"R{t}"))
        context = specs[-1].context
    return session_events(specs, run=RUN, session="s-line", final_reward=0.5)


def tree_lines(out: str) -> dict[int, tuple[int, str]]:
    """Each turn's line in the terminal tree: the column its label starts at, and the label."""
    found = re.finditer(r"^(.*?)(turn (\d+) · segment .*)$", out, re.M)
    return {int(m[3]): (len(m[1]), m[2]) for m in found}


class TreeNodes(HTMLParser):
    """Each li.node of the page's tree: its turn, parent and how many branch lists hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.paths = 0
        self.nodes: dict[int, tuple[int, int]] = {}  # turn -> (parent, depth)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "ul" and "branches" in classes:
            self.depth += 1
        elif tag == "ol" and "path" in classes:
            self.paths += 1
        elif tag == "li" and "node" in classes:
            a = dict(attrs)
            self.nodes[int(a["data-turn"] or "")] = (int(a["data-parent"] or ""), self.depth)

    def handle_endtag(self, tag: str) -> None:
        if tag == "ul":
            self.depth -= 1


async def test_the_tree_of_a_branched_session_in_the_terminal_and_the_page(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, branched_session(tokenizer))
    page_path = tmp_path / "tree.html"

    shown = inspect(log, tiny_model_dir, tmp_path, TREE, "--run", RUN)
    written = inspect(log, tiny_model_dir, tmp_path, TREE, "--run", RUN, "--html", str(page_path))

    assert shown.returncode == 0, shown.stderr
    assert written.returncode == 0, written.stderr
    out = shown.stdout
    assert re.search(r"^forks +1 *$", out, re.M) and re.search(r"^trajectories +3 *$", out, re.M)
    lines = tree_lines(out)
    labels = {turn: label for turn, (_, label) in lines.items()}
    assert labels[0].startswith("turn 0 · segment 0 · new conversation · 23 prompt + 2 generated")
    assert labels[1].startswith("turn 1 · segment 1 · new conversation from turn 0's prompt")
    assert labels[2].startswith("turn 2 · segment 0 · continues turn 0 · 25 shared + 5 prompt")
    assert labels[3].startswith("turn 3 · segment 1 · continues turn 1")
    assert "reward 0.25 · “tool: red”" in labels[3] and "weight_version 3" in labels[3]
    assert labels[5].startswith("turn 5 · segment 2 · ⑂ fork of turn 2 · 28 shared")
    assert labels[5].endswith(f"“tool: {HOSTILE}”")
    # 0, then two branches: {1, 3} (one path, one level) and 2, which branches into {4}, {5}.
    column = {turn: at for turn, (at, _) in lines.items()}
    assert column[0] < column[1] == column[3] == column[2] < column[4] == column[5]
    # Each segment holds its own turns, however they interleave.
    assert f"trajectory {RUN}/{TREE}/0 · turns 0, 2, 4 · " in out
    assert f"trajectory {RUN}/{TREE}/1 · turns 1, 3 · " in out
    assert f"trajectory {RUN}/{TREE}/2 · turn 5 · " in out
    assert "↳ new conversation at turn 1: its prompt shares 15 prompt tokens of turn 0's" in out
    assert "⑂ fork at turn 5: its prompt keeps 28 of turn 2's 32 context tokens" in out

    page = page_path.read_text()
    assert "<script" not in page and f"“tool: {html.escape(HOSTILE)}”</li>" in page
    tree = TreeNodes()
    tree.feed(page)
    assert tree.nodes == {0: (-1, 0), 1: (0, 1), 3: (1, 1), 2: (0, 1), 4: (2, 2), 5: (2, 2)}
    assert tree.paths == 5  # [0], [1, 3], [2], [4], [5]
    assert '<li class="node fork" id="node-5" data-turn="5" data-parent="2">' in page


async def test_a_linear_session_is_one_flat_path(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, linear_session(tokenizer))
    page_path = tmp_path / "line.html"

    shown = inspect(log, tiny_model_dir, tmp_path, "s-line", "--run", RUN)
    written = inspect(log, tiny_model_dir, tmp_path, "s-line", "--html", str(page_path))

    assert shown.returncode == 0, shown.stderr
    assert written.returncode == 0, written.stderr
    out = shown.stdout
    lines = tree_lines(out)
    assert sorted(lines) == [0, 1, 2] and len({at for at, _ in lines.values()}) == 1
    assert [label.split(" · ")[1:3] for _, label in lines.values()] == [
        ["segment 0", "new conversation"],
        ["segment 0", "continues turn 0"],
        ["segment 0", "continues turn 1"],
    ]
    assert "├──" not in out and out.count("└──") == 1  # one path, no branch
    assert f"trajectory {RUN}/s-line/0 · turns 0-2 · " in out
    assert "⑂" not in out and "↳" not in out
    tree = TreeNodes()
    tree.feed(page_path.read_text())
    assert tree.nodes == {0: (-1, 0), 1: (0, 0), 2: (1, 0)} and tree.paths == 1


# -- version boundaries (issue 37, point 6) -----------------------------------------------------

INTERRUPTED = "s-versions"
REPLY = "the first part, then more."  # 26 byte-level tokens: 17 by version 3, 9 by version 4


def interrupted_session(tokenizer: Any) -> list[SessionEvent]:
    """Turn 0 was aborted after 17 tokens by a weight update and continued on version 4; turn
    1's weights changed under it after 3 tokens to a version nobody could know (a frozen
    generation); turn 2 is one generation by one version, as every turn was before."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    reply = ids(REPLY)
    assert len(reply) == 26
    sampling = {"seed": 7, "max_tokens": 64, "continued": [{"at": 17, "seed": 123}]}
    t0 = TurnSpec(
        prompt=ids("Q: go\n"), completion=reply, messages=[{"role": "user", "content": "go"}],
        text=REPLY, weight_version=3,
        extra={"version_spans": [(3, 17), (4, 9)], "sampling": sampling},
    )  # fmt: skip
    t1 = TurnSpec(
        prompt=[*t0.context, *ids("T: ok\n")], completion=ids("frozen!!"),
        messages=[*t0.messages, t0.assistant_message, {"role": "tool", "content": "ok"}],
        text="frozen!!", weight_version=4, extra={"version_spans": [(4, 3), (None, 5)]},
    )  # fmt: skip
    t2 = TurnSpec(
        prompt=[*t1.context, *ids("T: fine\n")], completion=ids("done"),
        messages=[*t1.messages, t1.assistant_message, {"role": "tool", "content": "fine"}],
        text="done", weight_version=4,
    )  # fmt: skip
    return session_events([t0, t1, t2], run=RUN, session=INTERRUPTED, final_reward=1.0)


async def test_a_turn_shows_where_its_version_changed_and_why(
    log: Log, tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    await publish_events(log.nc, interrupted_session(tokenizer))
    page_path = tmp_path / "versions.html"

    shown = inspect(log, tiny_model_dir, tmp_path, INTERRUPTED, "--run", RUN)
    written = inspect(log, tiny_model_dir, tmp_path, INTERRUPTED, "--html", str(page_path))

    assert shown.returncode == 0, shown.stderr
    assert written.returncode == 0, written.stderr
    out = shown.stdout
    assert re.search(r"^weight versions +3, 4 *$", out, re.M)
    continued = "versions 3→4 at token 17 (continued after an abort)"
    frozen = "versions 4→? (unknown) at token 3 (the weights changed under it)"
    assert f"── turn 0 · weight_version 3 · {continued} · finish stop · 6 prompt + 26 " in out
    assert f"── turn 1 · weight_version 4 · {frozen} · finish stop · " in out
    # A turn of one generation by one version reads as it always did.
    assert "── turn 2 · weight_version 4 · finish stop · 8 prompt + 4 generated tokens ──" in out
    labels = {turn: label for turn, (_, label) in tree_lines(out).items()}
    assert f"26 generated tokens · weight_version 3 · {continued} · finish stop" in labels[0]
    assert f"weight_version 4 · {frozen} · finish stop" in labels[1]
    assert "weight_version 4 · finish stop" in labels[2] and "versions" not in labels[2]
    # The boundary is drawn among the tokens, where it falls.
    assert f"Q: go\n{REPLY[:17]}⟨v3→v4⟩{REPLY[17:]}" in out
    assert "T: ok\nfro⟨v4→v?⟩zen!!" in out and "T: fine\ndone" in out

    page = page_path.read_text()
    assert "<script" not in page
    assert f"{continued} · finish stop" in page and f"{html.escape(frozen)} · finish" in page
    titles = re.findall(r'<span class="tok gen"[^>]* title="([^"]+)">', page)
    versions = [title.rsplit("weight_version ", 1)[1] for title in titles]
    assert versions == ["3"] * 17 + ["4"] * 9 + ["4"] * 3 + ["? (unknown)"] * 5 + ["4"] * 4
    generated = re.findall(r'<span class="(tok gen|boundary)"[^>]*>([^<]*)</span>', page)
    marks = [(at, text) for at, (kind, text) in enumerate(generated) if kind == "boundary"]
    assert marks == [(17, "⟨v3→v4⟩"), (26 + 1 + 3, "⟨v4→v?⟩")]
