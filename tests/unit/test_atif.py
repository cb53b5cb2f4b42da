"""ATIF both ways (issue 38, point 3), pure: a session's samples as one ATIF document that
Harbor's own models accept, and a document as events that fold back to the same tokens."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

from consumers import fold
from consumers.atif import session_document
from consumers.atif_events import session_events
from consumers.errors import AtifRefused
from schemas.events import UNKNOWN_VERSION, SessionEvent, TrajectoryReady
from schemas.shards import trajectories_to_table
from tests.helpers.agent_sessions import claude_code_session
from tests.helpers.harbor import assert_valid_atif
from tests.helpers.sessions import (
    RUN,
    SESSION,
    append_only,
    closed,
    opened,
    reward,
    turn_specs,
)
from tests.helpers.sessions import session_events as served_session
from tests.helpers.tree_sessions import TreeTurn, tree_events

JSON = dict[str, Any]
SYS = [1, 2, 3]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}  # fmt: skip


def as_written(document: JSON) -> JSON:
    """The document as a file holds it: JSON text, read back."""
    return json.loads(json.dumps(document))


def imported(trajectories: list[TrajectoryReady]) -> tuple[JSON, list[TrajectoryReady]]:
    """The ATIF document of ``trajectories`` (one session), validated by Harbor, and what the
    fold makes of its events again, under run ``imp``."""
    document = as_written(session_document(trajectories))
    assert_valid_atif(document)
    session = session_events(document, run="imp", session=SESSION, source="s.json", now=5.0)
    return document, fold(session.events).trajectories


def assert_same_tokens(original: list[TrajectoryReady], again: list[TrajectoryReady]) -> None:
    assert [t.segment for t in again] == [t.segment for t in original]
    for before, after in zip(original, again, strict=True):
        assert after.input_ids.tolist() == before.input_ids.tolist()
        assert after.loss_mask.tolist() == before.loss_mask.tolist()
        assert after.logprobs.tobytes() == before.logprobs.tobytes()  # float32, bit for bit
        assert after.turn_ends.tolist() == before.turn_ends.tolist()
        assert after.prompt_len == before.prompt_len
        assert (after.reward, after.turn_rewards) == (before.reward, before.turn_rewards)
        # not on-policy samples of this run: no version is known, the log-probs are imported
        assert set(after.versions[after.loss_mask == 1].tolist()) <= {UNKNOWN_VERSION}
        if after.loss_mask.any():
            assert after.metadata["logprobs_kind"] == "imported"


@settings(max_examples=60, deadline=None)
@given(specs=turn_specs(max_turns=6, rewrites=True))
def test_any_linear_session_forks_included_round_trips_its_tokens(specs: list[Any]) -> None:
    events = served_session(
        specs, rewards=[reward(0.25, turn=len(specs) - 1)], final_reward=1.0, created_at=1.0
    )
    original = fold(events).trajectories

    document, again = imported(original)

    assert_same_tokens(original, again)
    assert len(document.get("subagent_trajectories", [])) == len(original) - 1  # the forks


def _interleaved() -> list[SessionEvent]:
    """A main agent (turns 0, 2, 4) and a sub-agent it started after turn 0 (1, 3, 5)."""
    main = [TreeTurn(-1, [*SYS, 10], [11, 12], [{"role": "user", "content": "task"}], "m0")]
    main.append(TreeTurn(0, [*SYS, 20], [21], [{"role": "user", "content": "sub task"}], "s0"))
    for k in range(2):
        previous_main, previous_sub = main[2 * k], main[2 * k + 1]
        main.append(TreeTurn(2 * k, [*previous_main.context, 30 + k], [40 + k],
                             [*previous_main.messages, previous_main.assistant_message,
                              {"role": "user", "content": f"go {k}"}], f"m{k + 1}"))  # fmt: skip
        main.append(TreeTurn(2 * k + 1, [*previous_sub.context, 50 + k], [60 + k],
                             [*previous_sub.messages, previous_sub.assistant_message,
                              {"role": "user", "content": f"more {k}"}], f"s{k + 1}"))  # fmt: skip
    return [opened(), *tree_events(main), closed(reward=1.0, num_turns=len(main))]


def test_a_sub_agent_is_embedded_and_referenced_from_the_turn_it_branched_off() -> None:
    original = fold(_interleaved()).trajectories
    assert original[1].metadata["branch_of"]["turn"] == 0

    document, again = imported(original)

    [sub] = document["subagent_trajectories"]
    assert sub["trajectory_id"] == original[1].trajectory_id
    first_agent_step = next(s for s in document["steps"] if s["source"] == "agent")
    [ref_result] = first_agent_step["observation"]["results"]
    assert ref_result["subagent_trajectory_ref"] == [
        {"trajectory_id": original[1].trajectory_id, "session_id": SESSION}
    ]
    assert [s["message"] for s in sub["steps"] if s["source"] == "agent"] == ["s0", "s1", "s2"]
    assert_same_tokens(original, again)
    assert again[1].metadata["agent_id"] == original[1].trajectory_id  # named by its document
    assert document["agent"]["model_name"] == again[0].metadata["model"] == "tiny"


def test_a_coding_agents_session_validates_and_round_trips_main_fork_fresh_and_side() -> None:
    original = claude_code_session(RUN, SESSION, 1.0)
    assert len(original) == 4  # main, the fork, the fresh agent, the side call

    document, again = imported(original)

    embedded = [t["trajectory_id"] for t in document["subagent_trajectories"]]
    assert embedded == [t.trajectory_id for t in original[1:]]
    assert_same_tokens(original, again)


def test_the_sink_never_takes_an_imported_sample_for_a_fresh_on_policy_one() -> None:
    from trainer_sink.assembly import assemble
    from trainer_sink.batching import Batcher, Sample
    from trainer_sink.config import BatchingSettings

    _, again = imported(fold(_interleaved()).trajectories)

    batch = assemble(again)
    assert batch["raw_logprobs"].tolist() == [True, True]  # no importance ratio against them
    batcher: Batcher[None] = Batcher(BatchingSettings(max_staleness=1000, batch_size=2))
    batcher.trainer_version = 0
    decision = batcher.add(Sample(again[0], None), now=0.0)
    # an unknown policy version: stale under any bound
    assert [d.reason for d in decision.dropped] == ["stale"] and not decision.batches


def test_tool_calls_and_their_results_become_calls_and_observations() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    reply = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    second = [*messages, reply, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    turns = [
        TreeTurn(-1, [*SYS, 4], [5, 6], messages, extra={"tool_calls": [CALL]}),
        TreeTurn(0, [*SYS, 4, 5, 6, 7], [8], second, "Sunny."),
    ]
    original = fold([opened(), *tree_events(turns), closed(num_turns=2)]).trajectories

    document, again = imported(original)

    steps = document["steps"]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent"]
    assert steps[2]["tool_calls"] == [
        {"tool_call_id": "call_1", "function_name": "get_weather", "arguments": {"city": "Paris"}}
    ]
    assert steps[2]["observation"] == {"results": [{"content": "18C", "source_call_id": "call_1"}]}
    assert steps[2]["metrics"]["prompt_token_ids"] == [*SYS, 4]
    assert steps[3]["metrics"]["prompt_token_ids"] == [*SYS, 4, 5, 6, 7]
    assert steps[3]["metrics"]["completion_token_ids"] == [8]
    assert_same_tokens(original, again)
    [call] = again[0].messages[2]["tool_calls"]  # the conversation as the model answered it
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert again[0].messages[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("field", ["prompt_token_ids", "completion_token_ids", "logprobs"])
def test_a_step_without_ids_refuses_the_document_naming_it(field: str) -> None:
    document = as_written(session_document(fold(_interleaved()).trajectories))
    broken = copy.deepcopy(document)
    agent_steps = [s for s in broken["subagent_trajectories"][0]["steps"] if "metrics" in s]
    del agent_steps[1]["metrics"][field]

    with pytest.raises(AtifRefused) as refused:
        session_events(broken, run="imp", session=SESSION, source="t.json", now=0.0)

    message = str(refused.value)
    step_id = agent_steps[1]["step_id"]
    assert f"t.json: trajectory {RUN}/{SESSION}/1: step {step_id} has no metrics.{field}" in message
    assert "never re-tokenizes" in message and "nothing was imported" in message


def test_copied_context_is_conversation_and_no_ids_at_all_is_refused() -> None:
    document = {
        "schema_version": "ATIF-v1.6",
        "agent": {"name": "terminus-2", "version": "1"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "hi"},
            {"step_id": 2, "source": "agent", "message": "earlier", "is_copied_context": True},
            {"step_id": 3, "source": "agent", "message": "hello",
             "metrics": {"prompt_tokens": 12, "completion_tokens": 3}},
        ],
    }  # fmt: skip
    assert_valid_atif(document)
    with pytest.raises(AtifRefused, match=r"x.json: step 3 has no metrics.prompt_token_ids"):
        session_events(document, run="imp", session="s", source="x.json", now=0.0)

    metrics = document["steps"][2]["metrics"]
    metrics.update(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=[-0.5, -1.0])
    events = session_events(document, run="imp", session="s", source="x.json", now=0.0).events
    [turn] = [e for e in events if type(e).__name__ == "TurnCompleted"]
    assert turn.new_messages == [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "earlier"}]  # fmt: skip
    assert turn.usage == {"prompt_tokens": 12, "completion_tokens": 3}
    assert np.array_equal(turn.token_versions(), [UNKNOWN_VERSION] * 2)


def test_an_export_writes_one_document_per_session_whatever_the_batches(tmp_path: Path) -> None:
    from consumers.export import TOKENS_SCHEMA
    from consumers.export_files import ExportDirectory
    from turnstream.data.export_atif import AtifSessions

    coding = claude_code_session(RUN, "coding", 1.0)  # main, fork, fresh, side call
    linear = fold(served_session(append_only(2), session="linear")).trajectories
    rows = list(enumerate([coding[0], coding[1], *linear, coding[2], coding[3]], start=1))
    out = tmp_path / "out"
    with ExportDirectory(out, format="parquet", schema=TOKENS_SCHEMA, rows_per_part=10,
                         overwrite=False) as directory:  # fmt: skip
        sessions = AtifSessions(directory, keep_side_calls=False)
        for batch in (rows[:2], rows[2:4], rows[4:]):  # the coding session across batches
            sessions.add(trajectories_to_table(batch))
        sessions.finish()
        directory.commit(*sessions.manifest({"run": RUN, "tokens": 0, "rows": 0, "columns": {}}))

    assert sorted(p.name for p in (out / "data").iterdir()) == ["coding.json", "linear.json"]
    assert (sessions.sessions, sessions.rows, sessions.side_calls) == (2, 4, 1)
    document = json.loads((out / "data" / "coding.json").read_text())
    assert_valid_atif(document)
    embedded = [t["trajectory_id"] for t in document["subagent_trajectories"]]
    assert embedded == [coding[1].trajectory_id, coding[2].trajectory_id]  # no side call
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "json" and manifest["sessions"] == 2
    assert "import-atif" in (out / "README.md").read_text()
