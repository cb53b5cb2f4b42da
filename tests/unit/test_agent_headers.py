"""The agent identity read from a request's headers (issue 35, point 2): Claude Code's, Codex's
and turnstream's own, with the header sets the real CLIs sent
(``../shared/agent-clis/subagents/README.md``: runs cc_bg, cc_hints, codex_v1, codex_v2,
codex_v1nest), written out as the gateway receives them (ASGI: lowercase names, latin-1 text)."""

from __future__ import annotations

import json

import pytest
from starlette.datastructures import Headers

from gateway.core.agents import MAIN_AGENT, AgentIdentity
from gateway.errors import InvalidRequest, error_spec
from gateway.http.agent_headers import MAX_AGENT_ID, MAX_LABEL, agent_identity

# -- Claude Code 2.1.328 ---------------------------------------------------------------------

CC_SESSION = "5d0c0b8e-2f55-4c1a-9d0e-7f3b8f1f4e21"
CC_COMMON = {  # what every agent of the session sends alike
    "x-claude-code-session-id": CC_SESSION,
    "anthropic-version": "2023-06-01",
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.328 (external, sdk-cli)",
}

# cc_bg: main, a fork and a general-purpose agent, no hint headers (#1-#7)
CC_BG_MAIN = {**CC_COMMON}
CC_BG_FORK = {**CC_COMMON, "x-claude-code-agent-id": "a9e64a5ca0980ef44"}
CC_BG_FRESH = {**CC_COMMON, "x-claude-code-agent-id": "adfda152c31bc96cc"}

# cc_hints: CLAUDE_CODE_GATEWAY_HINT_HEADERS=1, the fresh agent spawns a nested one
CC_HINT_MAIN = {
    **CC_COMMON,
    "x-claude-code-request-class": "main",
    "x-claude-code-prompt-id": "9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d",
    "x-claude-1p-request-class": "main",
}
CC_HINT_FORK = {
    **CC_COMMON,
    "x-claude-code-agent-id": "aafda217384dee935",
    "x-claude-code-request-class": "subagent",
    "x-claude-code-agent-type": "fork",
    "x-claude-code-prompt-id": "9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d",
    "x-claude-1p-request-class": "blocking-subagent",
}
CC_HINT_FRESH = {
    **CC_COMMON,
    "x-claude-code-agent-id": "a2ffa0b1d8f26260c",
    "x-claude-code-request-class": "subagent",
    "x-claude-code-agent-type": "general-purpose",
    "x-claude-code-prompt-id": "9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d",
    "x-claude-1p-request-class": "blocking-subagent",
}
CC_HINT_NESTED = {
    **CC_HINT_FRESH,
    "x-claude-code-agent-id": "add8ff39237bbe646",
    "x-claude-code-parent-agent-id": "a2ffa0b1d8f26260c",
}

# -- Codex CLI 0.169.0 ------------------------------------------------------------------------


def codex(thread: str, metadata: dict[str, object], parent: str | None = None) -> dict[str, str]:
    """A Codex request's identity headers: the session is the root thread's uuid."""
    session = metadata["session_id"]
    headers = {
        "session-id": str(session),
        "thread-id": thread,
        "x-client-request-id": thread,
        "x-codex-window-id": f"{thread}:0",
        "x-codex-turn-metadata": json.dumps(metadata, separators=(",", ":")),
        "originator": "codex_exec",
        "user-agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)",
    }
    if parent is not None:
        headers["x-codex-parent-thread-id"] = parent
        headers["x-openai-subagent"] = "collab_spawn"
    return headers


def root_metadata(root: str, turn: str) -> dict[str, object]:
    return {
        "session_id": root,
        "thread_id": root,
        "agent_name": "/root",
        "turn_id": turn,
        "root_turn_id": turn,
        "history_initialization": "new",
        "thread_source": "user",
        "request_kind": "turn",
        "turn_trigger": "exec",
    }


def sub_metadata(
    root: str, root_turn: str, thread: str, turn: str, parent: str, parent_turn: str, **more: str
) -> dict[str, object]:
    return {
        "session_id": root,
        "thread_id": thread,
        "agent_name": "/root",
        "turn_id": turn,
        "root_turn_id": root_turn,
        "thread_source": "subagent",
        "parent_thread_id": parent,
        "parent_turn_id": parent_turn,
        "subagent_kind": "thread_spawn",
        **more,
    }


V1_ROOT, V1_ROOT_TURN = (
    "01a2138a-c2b9-7773-878e-cff37039929a",
    "01a2138a-c2db-7f61-a349-257ff536cd69",
)
V1_FORK, V1_FRESH = "01a2138b-0a11-7e42-9b1c-3c5d29a64a50", "01a2138b-0a12-7c03-8d4e-52b1e19b87e8"
CODEX_V1_ROOT = codex(V1_ROOT, root_metadata(V1_ROOT, V1_ROOT_TURN))
CODEX_V1_FORK = codex(
    V1_FORK,
    sub_metadata(V1_ROOT, V1_ROOT_TURN, V1_FORK, "01a2138b-0a3c-7d2e-a5f1-6b7c8d23340a",
                 V1_ROOT, V1_ROOT_TURN, history_initialization="warm_fork"),
    parent=V1_ROOT,
)  # fmt: skip
CODEX_V1_FRESH = codex(
    V1_FRESH,
    sub_metadata(V1_ROOT, V1_ROOT_TURN, V1_FRESH, "01a2138b-0a3d-7b9a-9e02-1d4f6a05c986",
                 V1_ROOT, V1_ROOT_TURN, history_initialization="new"),
    parent=V1_ROOT,
)  # fmt: skip

V2_ROOT, V2_ROOT_TURN = (
    "01a2139c-1b2a-7c3d-8e4f-5a6b7c4f6de5",
    "01a2139c-1b4e-7f80-a1b2-c3d4e5a3d326",
)
V2_FORK, V2_FRESH = "01a2139d-2c3b-7d4e-9f50-6b7c8d1d1d52", "01a2139d-2c3c-7e5f-8061-7c8d9ecef27f"
CODEX_V2_ROOT = codex(V2_ROOT, root_metadata(V2_ROOT, V2_ROOT_TURN))
CODEX_V2_FORK = codex(
    V2_FORK,
    sub_metadata(V2_ROOT, V2_ROOT_TURN, V2_FORK, "01a2139d-2c5a-7a1b-b2c3-d4e5f67a4170", V2_ROOT,
                 V2_ROOT_TURN, history_initialization="warm_fork", agent_name="/root/fork"),
    parent=V2_ROOT,
)  # fmt: skip
CODEX_V2_FRESH = codex(
    V2_FRESH,
    sub_metadata(V2_ROOT, V2_ROOT_TURN, V2_FRESH, "01a2139d-2c5b-7b2c-83d4-e5f6a759ac2a", V2_ROOT,
                 V2_ROOT_TURN, history_initialization="new", agent_name="/root/fresh1"),
    parent=V2_ROOT,
)  # fmt: skip

# codex_v1nest: the fresh sub-agent (…8f87fa) spawns a nested one (…8745ba)
NEST_ROOT, NEST_ROOT_TURN = (
    "01a213a0-aa01-7b02-8c03-d4e5f61fb9d6",
    "01a213a0-aa20-7c21-9d22-e3f4a51e89b1",
)
NEST_FRESH, NEST_FRESH_TURN = (
    "01a213a1-bb01-7c02-8d03-e4f5a68f87fa",
    "01a213a1-bb20-7d21-8e22-f3a4b53bf851",
)
NEST_CHILD = "01a213a2-cc01-7d02-9e03-f4a5b68745ba"
CODEX_NEST_CHILD = codex(
    NEST_CHILD,
    sub_metadata(NEST_ROOT, NEST_ROOT_TURN, NEST_CHILD, "01a213a2-cc20-7e21-8f22-a3b4c5196309",
                 NEST_FRESH, NEST_FRESH_TURN, history_initialization="new"),
    parent=NEST_FRESH,
)  # fmt: skip


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (CC_BG_MAIN, AgentIdentity(MAIN_AGENT, kind="main", source="claude_code")),
        # Without the hint headers a sub-agent does not say whether it is a fork: its tokens will.
        (CC_BG_FORK, AgentIdentity("a9e64a5ca0980ef44", parent=MAIN_AGENT, source="claude_code")),
        (CC_BG_FRESH, AgentIdentity("adfda152c31bc96cc", parent=MAIN_AGENT, source="claude_code")),
        (
            CC_HINT_MAIN,
            AgentIdentity(MAIN_AGENT, kind="main", request_class="main", source="claude_code",
                          prompt_id="9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d"),
        ),
        (
            CC_HINT_FORK,
            AgentIdentity("aafda217384dee935", parent=MAIN_AGENT, kind="fork", type="fork",
                          request_class="subagent", source="claude_code",
                          prompt_id="9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d"),
        ),
        (
            CC_HINT_FRESH,
            AgentIdentity("a2ffa0b1d8f26260c", parent=MAIN_AGENT, kind="fresh",
                          type="general-purpose", request_class="subagent", source="claude_code",
                          prompt_id="9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d"),
        ),
        (
            CC_HINT_NESTED,
            AgentIdentity("add8ff39237bbe646", parent="a2ffa0b1d8f26260c", kind="fresh",
                          type="general-purpose", request_class="subagent", source="claude_code",
                          prompt_id="9b7c1e55-0a43-4f1e-8a2d-6e0c2f39320d"),
        ),
        (
            CODEX_V1_ROOT,
            AgentIdentity(V1_ROOT, kind="main", request_class="main", source="codex",
                          prompt_id=V1_ROOT_TURN),
        ),
        (
            CODEX_V1_FORK,  # v1's agent_name is /root for every agent: no type
            AgentIdentity(V1_FORK, parent=V1_ROOT, kind="fork", request_class="subagent",
                          source="codex", prompt_id=V1_ROOT_TURN),
        ),
        (
            CODEX_V1_FRESH,
            AgentIdentity(V1_FRESH, parent=V1_ROOT, kind="fresh", request_class="subagent",
                          source="codex", prompt_id=V1_ROOT_TURN),
        ),
        (
            CODEX_V2_ROOT,
            AgentIdentity(V2_ROOT, kind="main", request_class="main", source="codex",
                          prompt_id=V2_ROOT_TURN),
        ),
        (
            CODEX_V2_FORK,
            AgentIdentity(V2_FORK, parent=V2_ROOT, kind="fork", type="/root/fork",
                          request_class="subagent", source="codex", prompt_id=V2_ROOT_TURN),
        ),
        (
            CODEX_V2_FRESH,
            AgentIdentity(V2_FRESH, parent=V2_ROOT, kind="fresh", type="/root/fresh1",
                          request_class="subagent", source="codex", prompt_id=V2_ROOT_TURN),
        ),
        (
            CODEX_NEST_CHILD,  # its parent is the sub-agent that spawned it, not the root
            AgentIdentity(NEST_CHILD, parent=NEST_FRESH, kind="fresh", request_class="subagent",
                          source="codex", prompt_id=NEST_ROOT_TURN),
        ),
    ],
    ids=[
        "cc_bg main", "cc_bg fork", "cc_bg fresh", "cc_hints main", "cc_hints fork",
        "cc_hints fresh", "cc_hints nested", "codex_v1 root", "codex_v1 fork", "codex_v1 fresh",
        "codex_v2 root", "codex_v2 fork", "codex_v2 fresh", "codex_v1nest nested",
    ],
)  # fmt: skip
def test_the_clis_captured_headers_name_their_agents(
    headers: dict[str, str], expected: AgentIdentity
) -> None:
    assert agent_identity(headers) == expected
    assert agent_identity(Headers(headers=headers)) == expected  # Starlette's, as routes pass


def test_a_client_that_sends_no_identity_has_none() -> None:
    plain = {"content-type": "application/json", "authorization": "Bearer k", "x-session-id": "s"}

    assert agent_identity(plain) is None
    assert agent_identity({}) is None
    # Codex's thread id alone (no session-id) is not Codex's identity; empty values are absent.
    assert agent_identity({"thread-id": V1_ROOT}) is None
    assert agent_identity({"x-claude-code-agent-id": "  ", "x-turnstream-agent": ""}) is None


def test_codex_thread_id_falls_back_to_the_client_request_id() -> None:
    headers = {k: v for k, v in CODEX_V1_FORK.items() if k != "thread-id"}

    identity = agent_identity(headers)

    assert identity is not None and (identity.id, identity.parent) == (V1_FORK, V1_ROOT)


def test_codex_resumed_root_is_main_and_a_bad_turn_metadata_is_ignored() -> None:
    resumed = {**root_metadata(V1_ROOT, V1_ROOT_TURN), "history_initialization": "cold_resume"}
    identity = agent_identity(codex(V1_ROOT, resumed))
    assert identity is not None and identity.kind == "main"

    for broken in ("{not json", "[1, 2]", '"text"', "[" * 5000, '{"agent_name": 7}'):
        headers = {**CODEX_V1_FRESH, "x-codex-turn-metadata": broken}
        identity = agent_identity(headers)
        # Still the thread and its parent; only what the metadata would have said is missing.
        assert identity is not None
        assert (identity.id, identity.parent, identity.source) == (V1_FRESH, V1_ROOT, "codex")
        assert (identity.kind, identity.type, identity.prompt_id) == ("", "", "")


# -- turnstream's own headers -----------------------------------------------------------------


def test_turnstream_headers_name_any_clients_agents_and_take_precedence() -> None:
    headers = {
        **CC_HINT_FORK,  # a Claude Code request relabelled by a proxy in front of the gateway
        "x-turnstream-agent": "critic-1",
        "x-turnstream-parent-agent": "planner",
        "x-turnstream-agent-kind": "fresh",
        "x-turnstream-request-class": "compaction",
    }

    identity = agent_identity(headers)

    assert identity == AgentIdentity(
        "critic-1", parent="planner", kind="fresh", request_class="compaction", source="turnstream"
    )
    assert identity.side
    root = agent_identity({"x-turnstream-agent": "solo"})
    assert root == AgentIdentity("solo", kind="main", source="turnstream")


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"x-turnstream-parent-agent": "main"}, "x-turnstream-parent-agent"),
        ({**CC_BG_FORK, "x-turnstream-parent-agent": "main"}, "x-turnstream-parent-agent"),
        ({"x-turnstream-request-class": "compaction"}, "x-turnstream-request-class"),
        ({"x-turnstream-agent-kind": "fork"}, "x-turnstream-agent-kind"),
    ],
)
def test_turnstream_agent_headers_naming_no_agent_are_refused(
    headers: dict[str, str], named: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        agent_identity(headers)

    assert refused.value.param == "x-turnstream-agent"
    assert named in str(refused.value)
    assert error_spec(refused.value).status == 400


def test_turnstream_labels_alone_relabel_a_clis_request() -> None:
    """A proxy in front of Claude Code marks a compaction call without renaming the agent."""
    headers = {**CC_HINT_FRESH, "x-turnstream-request-class": "compaction"}

    identity = agent_identity(headers)

    assert identity is not None and identity.side
    assert (identity.id, identity.kind, identity.source) == (
        "a2ffa0b1d8f26260c", "fresh", "claude_code",
    )  # fmt: skip
    relabelled = agent_identity({**CODEX_V1_FRESH, "x-turnstream-agent-kind": "fork"})
    assert relabelled is not None and (relabelled.kind, relabelled.request_class) == (
        "fork", "subagent",
    )  # fmt: skip


# -- hostile values ---------------------------------------------------------------------------

TS_PARENT, CC_PARENT = "x-turnstream-parent-agent", "x-claude-code-parent-agent-id"


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"x-turnstream-agent": "a" * (MAX_AGENT_ID + 1)}, "x-turnstream-agent"),
        ({"x-turnstream-agent": "a\x7fb"}, "x-turnstream-agent"),
        ({"x-turnstream-agent": "a", TS_PARENT: "p\tq"}, TS_PARENT),
        ({**CC_COMMON, "x-claude-code-agent-id": "a" * 500}, "x-claude-code-agent-id"),
        ({**CC_HINT_NESTED, CC_PARENT: "\x00"}, CC_PARENT),
        ({**CODEX_V1_FORK, "thread-id": "t\x1bx"}, "thread-id"),
        ({**CODEX_V1_FORK, "x-codex-parent-thread-id": "p" * 129}, "x-codex-parent-thread-id"),
        # UTF-8 "—" read as latin-1 holds C1 controls; read as UTF-8 it is printable (below).
        ({"x-turnstream-agent": "a\x85b"}, "x-turnstream-agent"),
        # An agent its own parent: a cycle in the tree.
        ({"x-turnstream-agent": "x", TS_PARENT: "x"}, TS_PARENT),
        ({**CC_COMMON, "x-claude-code-agent-id": MAIN_AGENT}, "x-claude-code-agent-id"),
        ({**CODEX_V1_FORK, "x-codex-parent-thread-id": V1_FORK}, "x-codex-parent-thread-id"),
    ],
    ids=[
        "too long", "DEL", "tab in the parent", "cc too long", "cc NUL parent", "codex ESC",
        "codex parent too long", "C1 control", "own parent", "cc sub-agent named main",
        "codex own parent",
    ],
)  # fmt: skip
def test_an_unusable_agent_id_is_a_400_naming_its_header(
    headers: dict[str, str], param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        agent_identity(headers)

    assert refused.value.param == param
    assert param in str(refused.value)
    assert error_spec(refused.value).status == 400


def test_an_id_of_exactly_the_limit_is_taken() -> None:
    identity = agent_identity({"x-turnstream-agent": "a" * MAX_AGENT_ID})
    assert identity is not None and len(identity.id) == MAX_AGENT_ID


def test_utf8_header_values_are_read_as_the_client_wrote_them() -> None:
    # What ASGI hands over for the UTF-8 bytes of "agent—ü": each byte as a latin-1 character.
    sent = "agent—ü".encode().decode("latin-1")
    label = "clàss".encode().decode("latin-1")

    identity = agent_identity({"x-turnstream-agent": sent, "x-turnstream-request-class": label})
    latin = agent_identity({"x-turnstream-agent": "caf\xe9"})  # latin-1 bytes, not UTF-8

    assert identity is not None and (identity.id, identity.request_class) == ("agent—ü", "clàss")
    assert latin is not None and latin.id == "café"


def test_free_text_labels_are_cut_and_cleaned_not_refused() -> None:
    headers = {
        **CC_COMMON,
        "x-claude-code-agent-id": "a0123456789abcdef",
        "x-claude-code-agent-type": "t" * 1000,
        "x-claude-code-request-class": "sub\x00agent" + "x" * 200,
        "x-claude-code-prompt-id": "\x07" + "p" * 300,
    }

    identity = agent_identity(headers)

    assert identity is not None
    assert identity.type == "t" * MAX_LABEL and identity.kind == "fresh"
    assert identity.request_class == ("subagent" + "x" * 200)[:MAX_LABEL]
    assert identity.prompt_id == "p" * 128
