"""``turnstream inspect``: one session's turns and trajectories, in the terminal or as HTML.

    turnstream inspect SESSION [--run R] [--html FILE] [--log.url nats://HOST:4222] [--model DIR]

The session's events are read back from EVENTS (``--log.url``, or the ``stack.json`` of the
``turnstream up`` running on ``--data-dir``) and folded exactly as the fold worker folds them
(``consumers.worker.fold_session``), so what is shown is what the shards and the trainer get:

- a header: run, session, group, status, final reward, turns, weight versions, forks, rewards;
- the turn tree (``turnstream.inspect.tree``): every turn under its parent, with its segment,
  whether it continues its parent, forks from it or starts a new conversation, the tokens it
  shares and adds, weight_version, finish reason, reward and the first words of its newest
  message; a chain of only children is drawn at one level, so a linear session is one path;
- per trajectory (segment): its turns, whose conversation it is (the agent its client named,
  its kind, parent agent, request class; a side call; a client gone), and what starts it (a
  fork, a new conversation) marked, with the tokens its first turn shares with its parent's
  context collapsed;
- per turn: its boundary (index, weight_version, where its versions meet when its weights
  were updated while it was generated, finish reason, per-turn reward), the messages
  it added, prompt tokens dimmed (loss_mask 0), generated tokens (loss_mask 1) coloured by their
  sampling probability (red: unlikely, green: likely), its tool calls. An image is shown where
  it sits, in its message and among the tokens in place of its placeholder tokens:
  ``[image 640x480 sha256:1a2b3c4d… 256 tokens at 120..375]`` (``turnstream.inspect.text``).

Tokens are decoded one by one with the model's tokenizer (``--model``; unset: the stack's, else
the built-in tiny model). ``--html FILE`` writes the same view as one standalone page (inline CSS,
no script, every text escaped: token text is model output), each token a span whose tooltip
gives its id, logprob and weight_version. Without ``--run`` the session is looked up in every run.
"""

from __future__ import annotations

import asyncio
import html
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import CliPositionalArg, SettingsConfigDict
from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from eventlog.reader import read_session_messages
from schemas.codec import Codec
from schemas.errors import TurnstreamError
from schemas.events import TurnCompleted
from schemas.ids import ID_PATTERN
from schemas.images import ImageRef
from schemas.trust import VettedSession, vet_session
from turnstream.inspect.text import (
    image_text,
    new_message_texts,
    printable,
    tool_call_text,
    version_marks,
)
from turnstream.inspect.tree import FORK, ROOT, TreeNode, TreePath, node_text
from turnstream.inspect.view import (
    SessionView,
    Token,
    agent_text,
    heat,
    prompt_items,
    segment_title,
    session_view,
    shared_text,
    start_text,
    token_title,
    turn_title,
)
from turnstream.stack.event_log import open_log
from turnstream.stack.settings import ServiceSettings
from turnstream.stack.stack_file import join_stack, stack_file_path

__all__ = [
    "InspectCommand",
    "SessionNotFound",
    "html_tree",
    "render_html",
    "render_terminal",
    "terminal_tree",
    "token_texts",
]


class SessionNotFound(TurnstreamError):
    """No event of the session in the log."""


# -- terminal ---------------------------------------------------------------------------------


def render_terminal(view: SessionView) -> list[RenderableType]:
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    for key, value in view.header():
        header.add_row(key, Text(value))
    legend = Text("tokens: ")
    legend.append("prompt (loss_mask 0)", style="dim")
    legend.append(", generated (loss_mask 1) by probability: ")
    for p in (0.05, 0.3, 0.6, 0.9):
        legend.append(f" p≈{p} ", style=_token_style(math.log(p)))
        legend.append(" ")
    parts: list[RenderableType] = [header, legend]
    if view.tree:
        parts.append(Rule(Text("turn tree", style="bold"), align="left"))
        parts.append(terminal_tree(view))
    for segment in view.segments:
        parts.append(Rule(Text(segment_title(segment), style="bold"), align="left"))
        if (agent := agent_text(segment)) is not None:
            parts.append(Text(agent, style="bold green"))
        if (start := start_text(segment)) is not None:
            parts.append(Text(start, style="bold magenta" if segment.fork else "bold blue"))
        for index, turn in enumerate(segment.turns):
            parts.append(Text(f"── {turn_title(turn)} ──", style="bold cyan"))
            for line in new_message_texts(turn.event):
                parts.append(Text(f"  → {line}", style="italic"))
            tokens = Text()
            if index == 0 and segment.shared:
                tokens.append(shared_text(segment), style="dim italic")
            for item in prompt_items(turn):
                if isinstance(item, ImageRef):
                    tokens.append(image_text(item), style="bold reverse blue")
                else:
                    tokens.append(item.text, style=Style(dim=True))
            marks = version_marks(turn.event)
            for at, token in enumerate(turn.completion):
                if at in marks:
                    tokens.append(marks[at], style="bold reverse magenta")
                tokens.append(token.text, style=_token_style(token.logprob))
            parts.append(tokens)
            for call in turn.event.tool_calls:
                parts.append(Text(f"  ⚙ {tool_call_text(call)}", style="yellow"))
    return parts


def terminal_tree(view: SessionView) -> Tree:
    """The turn tree: each path (a chain of only children) one node of the rich tree, its turns
    one line each; a turn with several children opens one branch per child below its path."""
    root = Tree(Text(f"session {view.run}/{view.session}", style="bold"), guide_style="dim")
    # Iterative: a deep tree (a retry of every turn) must not exhaust Python's recursion.
    pending: list[tuple[Tree, TreePath]] = [(root, path) for path in reversed(view.tree)]
    while pending:
        under, path = pending.pop()
        lines = Text("\n").join(
            Text(node_text(node), style=_NODE_STYLES.get(node.relation, "")) for node in path.nodes
        )
        lines.no_wrap, lines.overflow = True, "ellipsis"  # one line per turn, whatever the width
        branch = under.add(lines)
        pending.extend((branch, child) for child in reversed(path.branches))
    return root


_NODE_STYLES = {FORK: "magenta", ROOT: "bold"}


def _token_style(logprob: float) -> Style:
    r, g, b = heat(logprob)
    return Style(color="black", bgcolor=f"rgb({r},{g},{b})")


# -- HTML -------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table.header th { text-align: left; padding-right: 1.5em; }
.segment { border-top: 2px solid #888; margin-top: 1.5em; padding-top: 0.5em; }
.fork { color: #a0a; font-weight: bold; }
.turn-head { color: #077; font-weight: bold; margin-top: 0.8em; }
.message { font-style: italic; color: #555; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.6; }
.tok { border-radius: 2px; }
.tok.prompt { color: #999; }
.tok.gen { color: #000; }
.shared { color: #999; font-style: italic; }
.start { color: #36c; font-weight: bold; }
ul.tree, ul.branches { list-style: none; padding-left: 1.2em; border-left: 1px dotted #aaa; }
ol.path { list-style: none; padding-left: 0; margin: 0.3em 0; }
li.node { font-family: ui-monospace, monospace; font-size: 0.9em; white-space: pre-wrap; }
li.node.fork { color: #a0a; }
li.node.root { font-weight: bold; }
.boundary { color: #fff; background: #a0a; font-weight: bold; border-radius: 2px; }
.tool-call { color: #850; font-family: ui-monospace, monospace; }
.image { color: #fff; background: #36c; border-radius: 2px; }
"""


def render_html(view: SessionView) -> str:
    """One standalone page: inline CSS, no script, every text escaped."""
    e = html.escape
    out = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>turnstream inspect {e(view.run)}/{e(view.session)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>session {e(view.run)}/{e(view.session)}</h1>",
        '<table class="header">',
        *(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in view.header()),
        "</table>",
        '<p class="legend">prompt tokens grey (loss_mask 0); generated tokens (loss_mask 1) '
        "coloured by probability, red (unlikely) to green (likely); hover a token for its id, "
        "logprob and weight_version; a turn continued after an abort, or whose weights changed "
        "under it, is marked where its version changes.</p>",
    ]
    if view.tree:
        out.append('<section class="turn-tree"><h2>turn tree</h2>')
        out.extend(html_tree(view.tree))
        out.append("</section>")
    for segment in view.segments:
        out.append(f'<section class="segment" id="segment-{segment.segment}">')
        out.append(f"<h2>{e(segment_title(segment))}</h2>")
        if (agent := agent_text(segment)) is not None:
            out.append(f'<p class="agent">{e(agent)}</p>')
        if (start := start_text(segment)) is not None:
            out.append(f'<p class="{"fork" if segment.fork else "start"}">{e(start)}</p>')
        for index, turn in enumerate(segment.turns):
            out.append(f'<div class="turn" id="turn-{turn.event.turn}">')
            out.append(f'<div class="turn-head">{e(turn_title(turn))}</div>')
            for line in new_message_texts(turn.event):
                out.append(f'<div class="message">→ {e(line)}</div>')
            shared = (
                f'<span class="shared">{e(shared_text(segment))}</span>'
                if index == 0 and segment.shared
                else ""
            )
            marks = version_marks(turn.event)
            spans = "".join(map(_prompt_span, prompt_items(turn))) + "".join(
                (f'<span class="boundary">{e(marks[at])}</span>' if at in marks else "")
                + _token_span(token)
                for at, token in enumerate(turn.completion)
            )
            out.append(f'<div class="tokens">{shared}{spans}</div>')
            out.extend(
                f'<div class="tool-call">⚙ {e(tool_call_text(c))}</div>'
                for c in turn.event.tool_calls
            )
            out.append("</div>")
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def html_tree(tree: list[TreePath]) -> list[str]:
    """The turn tree as nested lists: ``ul.tree`` of paths, each path an ``ol.path`` of its
    turns (``li.node``, data-turn and data-parent), then a ``ul.branches`` when it branches."""
    out = ['<ul class="tree">']
    # An explicit stack of what is left to write: a path, or the tags that close one.
    pending: list[TreePath | str] = [*reversed(tree)]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        out.append('<li class="branch"><ol class="path">')
        out.extend(_node_item(node) for node in item.nodes)
        out.append("</ol>")
        if item.branches:
            out.append('<ul class="branches">')
            pending.append("</ul></li>")
            pending.extend(reversed(item.branches))
        else:
            out.append("</li>")
    out.append("</ul>")
    return out


def _node_item(node: TreeNode) -> str:
    classes = " ".join(["node", *(("fork",) if node.relation == FORK else ()),
                        *(("root",) if node.relation == ROOT else ())])  # fmt: skip
    return (
        f'<li class="{classes}" id="node-{node.turn}" data-turn="{node.turn}" '
        f'data-parent="{node.parent}">{html.escape(node_text(node))}</li>'
    )


def _prompt_span(item: Token | ImageRef) -> str:
    if isinstance(item, ImageRef):
        title = html.escape(f"{item.mime or 'image'} sha256:{item.sha256}", quote=True)
        return f'<span class="image" title="{title}">{html.escape(image_text(item))}</span>'
    return _token_span(item)


def _token_span(token: Token) -> str:
    title = html.escape(token_title(token), quote=True)
    text = html.escape(token.text)
    if not token.generated:
        return f'<span class="tok prompt" title="{title}">{text}</span>'
    r, g, b = heat(token.logprob)
    return (
        f'<span class="tok gen" style="background:rgb({r},{g},{b})" title="{title}">{text}</span>'
    )


# -- I/O --------------------------------------------------------------------------------------


async def read_vetted(
    settings: ServiceSettings, run: str | None, session: str
) -> tuple[str, VettedSession]:
    """The session's events from the log, vetted as the fold worker vets them, and its run."""
    stream = settings.log.names.events
    async with open_log(settings, name="turnstream-inspect") as event_log:
        stored = await read_session_messages(event_log.js, run, session, stream=stream)
        url = event_log.url
    runs = sorted({message.subject.split(".")[2] for message in stored})
    if not runs:
        where = f"run {run}" if run is not None else "any run"
        raise SessionNotFound(
            f"session {session} has no events in {where} ({stream} at {url}): check the "
            f"session id, --run and --log.url"
        )
    if len(runs) > 1:
        raise TurnstreamError(
            f"session {session} has events in runs {', '.join(runs)}: pick one with --run"
        )
    codec = Codec(max_payload=settings.log.max_payload)
    return runs[0], vet_session(stored, codec)


def token_texts(tokenizer: Any, ids: Iterable[int]) -> dict[int, str]:
    """Each distinct id decoded on its own (special tokens kept)."""
    distinct = sorted(set(ids))
    texts: Sequence[str] = tokenizer.batch_decode([[i] for i in distinct])
    return {i: printable(text) for i, text in zip(distinct, texts, strict=True)}


class InspectCommand(ServiceSettings):
    """Show one session's turns and trajectories: loss mask, logprobs, forks, rewards.

    Terminal view by default; --html FILE writes the same view as one standalone page."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream inspect")

    session: CliPositionalArg[str] = Field(description="the session id")
    run: str = Field(
        "default",
        pattern=f"^{ID_PATTERN}$",
        description="the session's run; unset: whichever run holds the session",
    )
    html: Path | None = Field(None, description="write the view as a standalone HTML page here")
    model: Path | None = Field(
        None,
        description="model dir whose tokenizer decodes the tokens; unset: the stack's, else "
        "the built-in tiny model",
    )
    per_turn: bool = Field(False, description="fold every turn into its own sample")

    def cli_cmd(self) -> None:
        settings, stack = join_stack(self)
        if settings.log.url is None:
            raise TurnstreamError(
                f"inspect needs the log's URL: --log.url nats://HOST:4222 (or "
                f"TURNSTREAM_LOG__URL), or a running `turnstream up` on this data dir "
                f"({stack_file_path(self.data_dir)} names none)"
            )
        run = self.run if "run" in self.model_fields_set else None  # else: any run
        found, vetted = asyncio.run(read_vetted(settings, run, self.session))
        model = self.model or (Path(stack.model_dir) if stack and stack.model_dir else None)
        ids = [int(i) for e in vetted.events if isinstance(e, TurnCompleted)
               for i in (*e.prompt_ids.tolist(), *e.completion_ids.tolist())]  # fmt: skip
        decode = token_texts(_tokenizer(model, self.data_dir), ids)
        view = session_view(found, self.session, vetted, decode, per_turn=self.per_turn)
        if self.html is not None:
            try:
                self.html.parent.mkdir(parents=True, exist_ok=True)
                self.html.write_text(render_html(view), encoding="utf-8")
            except OSError as exc:
                raise TurnstreamError(f"cannot write the HTML view to {self.html}: {exc}") from exc
            folded = len(view.result.trajectories) if view.result is not None else 0
            Console(stderr=True).print(
                f"wrote session {found}/{self.session} ({len(view.turns)} turns, "
                f"{folded} trajectories) to {self.html}",
                markup=False,
            )
            return
        Console().print(Group(*render_terminal(view)))


def _tokenizer(model: Path | None, data_dir: Path) -> Any:
    from gateway.templates import load_tokenizer  # slow to import: only once the session is found

    if model is None:
        from gateway.model import ensure_tiny_model

        model = ensure_tiny_model(data_dir / "models")
    return load_tokenizer(model)
