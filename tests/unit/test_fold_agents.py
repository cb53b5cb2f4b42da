"""The fold of a session whose client names its agents (issue 35, point 2; fold v5): a chain is
one agent's, a fork sub-agent's copy of its parent's history is prompt, a side request is a
trajectory of its own that nothing continues, and a turn whose client went away ends its
trajectory. The metadata names each trajectory's agent."""

from __future__ import annotations

from typing import Any

import pytest

from consumers import FOLD_VERSION, FoldOptions, fold
from schemas.agents import SIDE_CLASSES
from schemas.events import JSON
from tests.helpers.tree_sessions import TreeTurn, tree_session

SYS = [1, 2, 3]  # the system prompt main and its fork share
SPAWN = [40, 41, 42]  # main's spawning reply: text, the fork's call, the fresh agent's call


def agent(agent_id: str, **fields: str) -> JSON:
    """``TurnCompleted.agent`` as the gateway records it."""
    return {"id": agent_id, "source": "claude_code", **fields}


MAIN = agent("main", kind="main", resolved_kind="main", request_class="main")
FORK = agent(
    "a9e64a5ca0980ef44", parent="main", kind="fork", type="fork", resolved_kind="fork",
    request_class="subagent",
)  # fmt: skip
FRESH = agent(
    "adfda152c31bc96cc", parent="main", kind="fresh", type="general-purpose",
    resolved_kind="fresh", request_class="subagent",
)  # fmt: skip


def turn(
    parent: int, prompt: list[int], completion: list[int], who: JSON, **extra: Any
) -> TreeTurn:
    return TreeTurn(parent, prompt, completion, extra={"agent": who, **extra})


def claude_code_background() -> list[TreeTurn]:
    """cc_bg's shape: main spawns a fork and a fresh agent in one reply; the fork's first
    request is main's spawning request plus the reply *rewritten* to keep only its own call
    (41), so it does not extend main's context; the fresh agent starts a new conversation; main
    goes on meanwhile, and each sub-agent takes a second turn."""
    main0 = turn(-1, [*SYS, 10], SPAWN, MAIN)
    fork1 = turn(0, [*SYS, 10, 41, 50], [51, 52], FORK)  # 41: main's token, copied by the CLI
    fresh2 = turn(0, [7, 8, 20], [21], FRESH)  # the gateway takes main's turn as its parent
    main3 = turn(0, [*main0.context, 60], [61], MAIN)
    fork4 = turn(1, [*fork1.context, 53], [54], FORK)
    fresh5 = turn(2, [*fresh2.context, 22], [23], FRESH)
    return [main0, fork1, fresh2, main3, fork4, fresh5]


def test_each_agent_of_a_claude_code_session_is_its_own_trajectory() -> None:
    turns = claude_code_background()

    result = fold(tree_session(turns, final_reward=1.0))

    assert result.turn_segments == (0, 1, 2, 0, 1, 2)
    main, fork, fresh = result.trajectories
    assert main.input_ids.tolist() == turns[3].context
    assert fork.input_ids.tolist() == turns[4].context
    assert fresh.input_ids.tolist() == turns[5].context
    assert {k: main.metadata.get(k) for k in ("agent_id", "parent_agent", "agent_kind")} == {
        "agent_id": "main", "parent_agent": None, "agent_kind": "main",
    }  # fmt: skip
    assert {k: v for k, v in fork.metadata.items() if "agent" in k or k == "request_class"} == {
        "agent_id": "a9e64a5ca0980ef44", "parent_agent": "main", "agent_kind": "fork",
        "agent_type": "fork", "request_class": "subagent", "agent_source": "claude_code",
    }  # fmt: skip
    assert fresh.metadata["agent_kind"] == "fresh"
    assert fresh.metadata["agent_type"] == "general-purpose"
    assert all(t.fold_version == FOLD_VERSION >= 5 for t in result.trajectories)
    assert all("side" not in t.metadata for t in result.trajectories)
    assert all("side_calls" not in t.metadata for t in result.trajectories)


def test_a_forks_copy_of_its_parents_reply_is_prompt_never_trained() -> None:
    turns = claude_code_background()

    fork = fold(tree_session(turns)).trajectories[1]

    # The whole first request is prompt: main's system prompt and task, and the copy of main's
    # call (41) the CLI kept, though main generated it; only the fork's own replies are trained.
    assert fork.prompt_len == len(turns[1].prompt)
    assert fork.loss_mask.tolist() == [0] * 6 + [1, 1] + [0] + [1]
    assert fork.versions[: fork.prompt_len].tolist() == [-1] * fork.prompt_len
    # It shares main's request, not main's reply, whose first token (40, the text) it dropped.
    assert fork.metadata["branch_of"] == {"turn": 0, "segment": 0, "shared_tokens": 4}


def test_two_agents_extending_one_context_are_two_chains_whatever_arrives_first() -> None:
    """A fork whose first request extends main's whole context (Codex v2 keeps the full history)
    and arrives before main's next turn: by tokens alone it would carry main's chain on and
    main's own next turn would be the branch. Its agent id keeps it off main's chain."""
    main0 = turn(-1, [*SYS, 10], [11, 12], MAIN)
    fork1 = turn(0, [*main0.context, 70], [71], FORK)  # arrives first
    main2 = turn(0, [*main0.context, 13], [14], MAIN)
    fork3 = turn(1, [*fork1.context, 72], [73], FORK)
    turns = [main0, fork1, main2, fork3]

    result = fold(tree_session(turns))
    unnamed = fold(tree_session([TreeTurn(t.parent, t.prompt, t.completion) for t in turns]))

    assert result.turn_segments == (0, 1, 0, 1)
    main, fork = result.trajectories
    assert main.metadata["agent_id"] == "main" and fork.metadata["agent_id"] == FORK["id"]
    # The fork's copy of main's reply (11, 12) is its prompt; main's chain trains it once.
    assert fork.loss_mask.tolist() == [0] * 7 + [1, 0, 1]
    assert main.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 1]
    assert fork.metadata["branch_of"] == {"turn": 0, "segment": 0, "shared_tokens": 6}
    assert result.forks == 0  # a branch: nothing was rewritten
    # Without the ids, arrival order decides: the fork carries main's chain on.
    assert unnamed.turn_segments == (0, 0, 1, 0)


def test_an_agents_turns_never_join_a_chain_without_an_agent() -> None:
    plain0 = TreeTurn(-1, [*SYS, 10], [11])
    named1 = turn(0, [*plain0.context, 12], [13], MAIN)
    plain2 = TreeTurn(1, [*plain0.context, 12, 13, 14], [15])

    result = fold(tree_session([plain0, named1, plain2]))

    assert result.turn_segments == (0, 1, 2)
    assert "agent_id" not in result.trajectories[0].metadata
    assert result.trajectories[1].metadata["agent_id"] == "main"


@pytest.mark.parametrize("request_class", sorted(SIDE_CLASSES))
def test_a_side_request_is_a_trajectory_of_its_own_that_nothing_continues(
    request_class: str,
) -> None:
    """A compaction call extends main's context; main's next turn continues main, not the side
    call, and a turn that continues the side call's context starts a chain of its own."""
    side = {**MAIN, "request_class": request_class}
    main0 = turn(-1, [*SYS, 10], [11, 12], MAIN)
    side1 = turn(0, [*main0.context, 90], [91, 92], side)
    main2 = turn(0, [*main0.context, 13], [14], MAIN)
    after3 = turn(1, [*side1.context, 15], [16], MAIN)

    result = fold(tree_session([main0, side1, main2, after3], final_reward=1.0))

    assert result.turn_segments == (0, 1, 0, 2)
    main, side_call, after = result.trajectories
    assert side_call.metadata["side"] is True
    assert side_call.metadata["request_class"] == request_class
    assert side_call.num_turns == 1
    assert "side" not in main.metadata and "side" not in after.metadata
    # The session says how many of its samples are side calls (a batcher leaving them out
    # knows its rows without them); a session without any says nothing.
    assert {t.metadata["side_calls"] for t in result.trajectories} == {1}
    assert main.input_ids.tolist() == main2.context


def test_the_last_scope_rewards_the_last_sample_that_is_not_a_side_request() -> None:
    main0 = turn(-1, [*SYS, 10], [11, 12], MAIN)
    main1 = turn(0, [*main0.context, 13], [14], MAIN)
    side2 = turn(1, [*main1.context, 90], [91], {**MAIN, "request_class": "compaction"})
    events = tree_session([main0, main1, side2], final_reward=1.0)

    last = fold(events, FoldOptions(final_reward_scope="last")).trajectories
    every = fold(events).trajectories

    assert [t.reward for t in last] == [1.0, None]
    assert [t.reward for t in every] == [1.0, 1.0]
    assert [t.metadata.get("side") for t in last] == [None, True]


def test_a_turn_whose_client_went_away_ends_its_trajectory() -> None:
    """Codex ``exec`` exits while a sub-agent's request runs: the backend finished it, the turn
    is recorded, but the client never saw it; a turn that extends it anyway starts anew."""
    main0 = turn(-1, [*SYS, 10], [11], MAIN)
    sub1 = turn(0, [4, 5], [6, 7], FRESH)
    sub2 = turn(1, [4, 5, 6, 7, 8], [9], FRESH, client_gone=True)
    sub3 = turn(2, [4, 5, 6, 7, 8, 9, 10], [11], FRESH)

    result = fold(tree_session([main0, sub1, sub2, sub3]))
    per_turn = fold(tree_session([main0, sub1, sub2, sub3]), FoldOptions(per_turn=True))

    assert result.turn_segments == (0, 1, 1, 2)
    main, cut, after = result.trajectories
    assert cut.metadata["client_gone"] is True and cut.num_turns == 2
    assert "client_gone" not in main.metadata and "client_gone" not in after.metadata
    assert after.metadata["branch_of"] == {"turn": 2, "segment": 1, "shared_tokens": 6}
    assert [t.metadata.get("client_gone") for t in per_turn.trajectories] == [
        None, None, True, None,
    ]  # fmt: skip


def test_a_retry_after_a_cut_stream_carries_the_conversation_on() -> None:
    """The client's stream was cut (turn 1: recorded, client_gone); it resent the request
    (turn 2, sampled anew) and went on from that answer (turn 3): the conversation is one
    trajectory through the retry, the cut turn a branch of its own."""
    main0 = turn(-1, [*SYS, 10], [11], MAIN)
    cut1 = turn(0, [*SYS, 10, 11, 12], [13], MAIN, client_gone=True)
    retry2 = turn(0, [*SYS, 10, 11, 12], [14], MAIN)
    main3 = turn(2, [*SYS, 10, 11, 12, 14, 15], [16], MAIN)

    result = fold(tree_session([main0, cut1, retry2, main3]))

    assert result.turn_segments == (0, 1, 0, 0)
    main, cut = result.trajectories
    assert main.input_ids.tolist() == [*SYS, 10, 11, 12, 14, 15, 16]
    assert cut.metadata["client_gone"] is True and cut.metadata["branch_of"]["turn"] == 0
    assert "client_gone" not in main.metadata


def test_the_clients_kind_stands_in_where_the_gateway_resolved_none() -> None:
    claimed = {"id": "t1", "parent": "root", "kind": "fork", "source": "codex"}
    resolved = {**claimed, "resolved_kind": "fresh", "mismatch": "shares no parent request"}
    root = {"id": "root", "kind": "main", "source": "codex"}

    for who, kind in ((claimed, "fork"), (resolved, "fresh")):
        result = fold(tree_session([turn(-1, [1], [2], root), turn(0, [3], [4], who)]))
        sub = result.trajectories[1].metadata
        assert sub["agent_kind"] == kind and sub["parent_agent"] == "root"
    assert sub["agent_mismatch"] == "shares no parent request"
