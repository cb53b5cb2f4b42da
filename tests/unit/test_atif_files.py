"""``turnstream import-atif`` reading a Harbor trial directory (issue 38, point 3): a
trajectory, its continuation and a sub-agent stored as files are one session, the trial's
other JSON files are passed over, and its result.json gives the reward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from consumers.errors import AtifRefused
from schemas.events import RewardAssigned, TurnCompleted
from tests.helpers.harbor import assert_valid_atif
from turnstream.data.import_atif import read_sessions

JSON = dict[str, Any]


def agent_step(step_id: int, prompt: list[int], completion: list[int], **more: Any) -> JSON:
    return {"step_id": step_id, "source": "agent", "message": f"reply {step_id}",
            "metrics": {"prompt_token_ids": prompt, "completion_token_ids": completion,
                        "logprobs": [-0.5] * len(completion)}, **more}  # fmt: skip


def trajectory(session_id: str, steps: list[JSON], **more: Any) -> JSON:
    document = {"schema_version": "ATIF-v1.6", "session_id": session_id,
                "agent": {"name": "terminus-2", "version": "2.0", "model_name": "m"},
                "steps": steps, **more}  # fmt: skip
    assert_valid_atif(document)  # as Harbor writes them
    return document


def write(path: Path, document: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))


@pytest.fixture
def trial(tmp_path: Path) -> Path:
    agent = tmp_path / "trial-1" / "agent"
    ref = {"subagent_trajectory_ref": [{"session_id": "sum-1",
           "trajectory_path": "trajectory.summarization-1-summary.json"}]}  # fmt: skip
    write(agent / "trajectory.json", trajectory("run-abc", [
        {"step_id": 1, "source": "user", "message": "task"},
        agent_step(2, [1, 2], [3, 4], observation={"results": [ref]}),
    ], continued_trajectory_ref="trajectory.cont-1.json"))  # fmt: skip
    write(agent / "trajectory.cont-1.json", trajectory("run-abc", [
        {"step_id": 1, "source": "user", "message": "summary"},
        agent_step(2, [1, 9], [5]),
    ]))  # fmt: skip
    write(agent / "trajectory.summarization-1-summary.json", trajectory("sum-1", [
        agent_step(1, [1, 2, 3, 4, 7], [8]),
    ]))  # fmt: skip
    write(tmp_path / "trial-1" / "result.json",
          {"task_name": "t", "verifier_result": {"rewards": {"reward": 1.0}}})  # fmt: skip
    write(tmp_path / "trial-1" / "config.json", {"agent": {"name": "terminus-2"}})
    return tmp_path / "trial-1"


def test_a_trial_directory_is_one_session_with_its_continuation_sub_agent_and_reward(
    trial: Path,
) -> None:
    sessions, passed_over = read_sessions([trial], "imp", now=1.0)

    assert passed_over == 2  # result.json and config.json
    [session] = sessions
    assert (session.session, session.trajectories, session.turns) == ("run-abc", 3, 3)
    turns = [e for e in session.events if isinstance(e, TurnCompleted)]
    assert [t.parent for t in turns] == [-1, -1, -1]  # three chains: each file its own
    assert [t.completion_ids.tolist() for t in turns] == [[3, 4], [8], [5]]
    [episode] = [e for e in session.events if isinstance(e, RewardAssigned)]
    assert (episode.value, episode.turn) == (1.0, None)


def test_naming_only_the_root_reads_the_files_it_refers_to(trial: Path) -> None:
    sessions, _ = read_sessions([trial / "agent" / "trajectory.json"], "imp", now=1.0)

    [session] = sessions
    assert session.trajectories == 3


def test_a_named_file_that_is_no_trajectory_is_refused(trial: Path) -> None:
    with pytest.raises(AtifRefused, match=r"config.json: not an ATIF trajectory"):
        read_sessions([trial / "config.json"], "imp", now=1.0)
