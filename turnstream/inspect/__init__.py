"""``turnstream inspect``: one session's turns and trajectories, in the terminal or as HTML.

``command`` reads the session from the log, folds it as the worker does and renders it; what it
renders is pure: ``view`` (the view model of one session), ``tree`` (its turn tree: forks,
branches, continuations), ``text`` (the words for messages, tool calls and numbers).
"""

from __future__ import annotations

from turnstream.inspect.command import (
    InspectCommand,
    SessionNotFound,
    html_tree,
    render_html,
    render_terminal,
    terminal_tree,
    token_texts,
)
from turnstream.inspect.text import first_words, message_text, number, printable, tool_call_text
from turnstream.inspect.tree import (
    BRANCH,
    CONTINUES,
    FORK,
    NEW_FROM,
    NOT_FOLDED,
    ROOT,
    Relation,
    TreeNode,
    TreePath,
    node_text,
    relation_text,
    tree_nodes,
    tree_paths,
)
from turnstream.inspect.view import (
    SegmentView,
    SessionView,
    Token,
    TurnView,
    agent_text,
    heat,
    segment_title,
    session_view,
    shared_text,
    start_text,
    token_title,
    turn_title,
)

__all__ = [
    "BRANCH",
    "CONTINUES",
    "FORK",
    "NEW_FROM",
    "NOT_FOLDED",
    "ROOT",
    "InspectCommand",
    "Relation",
    "SegmentView",
    "SessionNotFound",
    "SessionView",
    "Token",
    "TreeNode",
    "TreePath",
    "TurnView",
    "agent_text",
    "first_words",
    "heat",
    "html_tree",
    "message_text",
    "node_text",
    "number",
    "printable",
    "relation_text",
    "render_html",
    "render_terminal",
    "segment_title",
    "session_view",
    "shared_text",
    "start_text",
    "terminal_tree",
    "token_texts",
    "token_title",
    "tool_call_text",
    "tree_nodes",
    "tree_paths",
    "turn_title",
]
