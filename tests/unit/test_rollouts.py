"""The verl-free half of the agent-loop integration, pure: routing trajectories to the sessions
waited for, and the sample an episode becomes (forks, failures, length limits)."""

from __future__ import annotations

import pytest

from consumers import fold
from schemas.events import TrajectoryReady
from tests.helpers.agent_sessions import claude_code_session
from tests.helpers.sessions import TurnSpec, append_only, session_events
from turnstream.integrations.errors import AgentFailed, TrajectoryTimeout
from turnstream.integrations.rollouts import AgentTask, Episode, load_agent
from turnstream.integrations.samples import EXTRA_FIELDS, failed_sample, rollout_sample
from turnstream.integrations.sessions import OpenedSession
from turnstream.integrations.trajectories import SessionRouter, session_of_msg_id

RUN = "r"


def trajectories(
    session: str, specs: list[TurnSpec], reward: float | None = 1.0
) -> list[TrajectoryReady]:
    events = session_events(specs, run=RUN, session=session, group="g", final_reward=reward)
    return fold(events).trajectories


def forked(session: str) -> list[TrajectoryReady]:
    """Two turns; the second's prompt rewrites the first reply after its first token (a
    fork: it keeps a generated token): two segments."""
    specs = [
        TurnSpec(prompt=[1, 2, 3], completion=[4, 5], weight_version=2),
        TurnSpec(prompt=[1, 2, 3, 4, 9], completion=[7, 8, 6], weight_version=3),
    ]
    return trajectories(session, specs)


def episode(
    session: str, found: list[TrajectoryReady], error: AgentFailed | None = None
) -> Episode:
    opened = OpenedSession(session, RUN, "g", f"http://gw/sessions/{session}/v1")
    reward = None if error else 1.0
    return Episode(opened, "aborted" if error else "completed", found, reward, error, 0.5)


def test_msg_ids_name_their_session() -> None:
    assert session_of_msg_id("r/s-1/0") == "s-1"
    assert session_of_msg_id("dlq.fold.EVENTS.3") is None
    assert session_of_msg_id(None) is None


async def test_the_router_hands_each_session_its_segments_once_and_ignores_the_rest() -> None:
    router = SessionRouter(RUN)
    first, second = forked("a")
    [other] = trajectories("b", append_only(2))
    with router.expecting("a") as waiter:
        assert router.wants("a") and not router.wants("b")
        assert not router.deliver(other)  # nobody waits for b
        assert router.deliver(second)
        assert not waiter.done  # its metadata says 2 segments
        assert router.deliver(second)  # a repeat (the feed is at least once) ...
        assert [t.segment for t in waiter.received] == [1]  # ... is not kept twice
        assert router.deliver(first)
        assert waiter.done
        got = await waiter.wait(1.0)
        assert [t.trajectory_id for t in got] == ["r/a/0", "r/a/1"]
        with pytest.raises(ValueError, match="waited for already"), router.expecting("a"):
            pass
    assert router.waiting == 0 and not router.deliver(first)


async def test_a_session_whose_trajectories_never_come_times_out_naming_what_to_check() -> None:
    router = SessionRouter(RUN)
    with router.expecting("lost") as waiter, pytest.raises(TrajectoryTimeout) as raised:
        await waiter.wait(0.05, where=" (TRAJ at nats://h:4222)")
    message = str(raised.value)
    assert "r/lost" in message and "ts.traj.r (TRAJ at nats://h:4222)" in message
    assert "none arrived" in message and "fold worker" in message and "shard writer" in message

    with router.expecting("half") as waiter:
        router.deliver(forked("half")[0])
        with pytest.raises(TrajectoryTimeout, match="1 of 2 segments arrived"):
            await waiter.wait(0.05)


def test_an_episode_becomes_its_trajectory_token_for_token() -> None:
    [t] = trajectories("s", append_only(3))
    sample = rollout_sample(episode("s", [t]))
    assert sample is not None
    p = t.prompt_len
    assert sample.prompt_ids + sample.response_ids == t.input_ids.tolist()
    assert sample.response_mask == t.loss_mask[p:].tolist()
    assert sample.response_logprobs == t.logprobs[p:].tolist()
    assert (sample.reward, sample.num_turns) == (1.0, 3)
    assert tuple(sample.extra_fields) == EXTRA_FIELDS
    assert sample.extra_fields["min_global_steps"] == 0
    assert sample.extra_fields["max_global_steps"] == 2
    assert sample.extra_fields["turnstream_trajectory_id"] == "r/s/0"
    assert sample.extra_fields["turnstream_forks"] == 0
    assert sample.extra_fields["turnstream_dropped_segments"] == []
    assert sample.extra_fields["turnstream_error"] is None


def test_a_forked_session_gives_its_final_segment_and_names_the_others() -> None:
    segments = forked("f")
    sample = rollout_sample(episode("f", segments))
    assert sample is not None
    final = segments[-1]
    assert sample.prompt_ids + sample.response_ids == final.input_ids.tolist()
    assert sample.reward == final.reward == 1.0
    assert sample.num_turns == 1
    assert sample.extra_fields["turnstream_forks"] == 1
    assert sample.extra_fields["turnstream_dropped_segments"] == ["r/f/0"]
    assert sample.extra_fields["min_global_steps"] == sample.extra_fields["max_global_steps"] == 3


def test_a_side_call_is_never_the_sample() -> None:
    """A coding agent's session (main, a fork, a fresh sub-agent) whose last segment is a
    compaction call: the sample is the last segment that is not, with the reward the fold gave
    it under either reward scope."""
    for scope in ("all", "last"):
        segments = claude_code_session(RUN, "cc", 1.0, final_reward_scope=scope)
        assert segments[-1].metadata["side"] is True

        sample = rollout_sample(episode("cc", segments))

        assert sample is not None
        assert sample.extra_fields["turnstream_trajectory_id"] == f"{RUN}/cc/2"
        assert sample.reward == 1.0
        assert sample.extra_fields["turnstream_dropped_segments"] == [
            f"{RUN}/cc/0", f"{RUN}/cc/1", f"{RUN}/cc/3",
        ]  # fmt: skip


def test_a_failed_agent_gives_a_sample_that_trains_nothing() -> None:
    [t] = trajectories("x", append_only(2), reward=None)
    error = AgentFailed("the agent of session r/x raised RuntimeError('boom')")
    sample = rollout_sample(episode("x", [t], error), failure_reward=-1.0)
    assert sample is not None
    assert sample.prompt_ids + sample.response_ids == t.input_ids.tolist()  # what the log holds
    assert set(sample.response_mask) == {0}
    assert sample.reward == -1.0
    assert "boom" in sample.extra_fields["turnstream_error"]

    # A trajectory without a reward (its session closed by someone else) is a failure too.
    unrewarded = rollout_sample(episode("x", [t]))
    assert unrewarded is not None and set(unrewarded.response_mask) == {0}
    assert "no reward" in unrewarded.extra_fields["turnstream_error"]

    # No turn at all: no trajectory; the framework's rendering of the prompt, one masked token.
    assert rollout_sample(episode("y", [], error)) is None
    empty = failed_sample(episode("y", [], error), [5, 6, 7, 8], pad_token_id=0, prompt_length=3)
    assert (empty.prompt_ids, empty.response_ids, empty.response_mask) == ([6, 7, 8], [0], [0])
    assert (empty.reward, empty.num_turns) == (0.0, 0)
    assert tuple(empty.extra_fields) == EXTRA_FIELDS


def test_a_sample_longer_than_the_framework_allows_is_cut_as_verl_cuts() -> None:
    [t] = trajectories("long", append_only(3))  # prompt 3 tokens, response 2 + 1 + 2 + 1 + 2
    sample = rollout_sample(episode("long", [t]), prompt_length=2, response_length=4)
    assert sample is not None
    ids = t.input_ids.tolist()
    assert sample.prompt_ids == ids[1:3]  # the prompt keeps its end
    assert sample.response_ids == ids[3:7]  # the response its start
    assert len(sample.response_mask) == len(sample.response_logprobs) == 4
    assert sample.extra_fields["turnstream_truncated"] is True


async def example_agent(task: AgentTask) -> float:
    return 1.0


def not_async(task: AgentTask) -> float:
    return 1.0


def test_agents_are_named_by_module_and_function() -> None:
    assert load_agent("tests.unit.test_rollouts:example_agent") is example_agent
    for path, complaint in [
        ("tests.unit.test_rollouts", "package.module:function"),
        ("tests.nowhere:agent", "cannot import"),
        ("tests.unit.test_rollouts:missing", "no callable"),
        ("tests.unit.test_rollouts:not_async", "async"),
    ]:
        with pytest.raises(ValueError, match=complaint):
            load_agent(path)


def test_the_openai_sampling_parameters_of_a_task() -> None:
    task = AgentTask(
        base_url="http://gw",
        api_key="unused",
        model="tiny",
        run=RUN,
        session_id="s",
        group="g",
        messages=[],
        tools=[],
        tools_kwargs={},
        extra_info={},
        sampling_params={"temperature": 0.7, "top_p": 1, "top_k": -1, "logprobs": True},
        max_response_tokens=64,
    )
    assert task.openai_sampling() == {"temperature": 0.7, "top_p": 1.0}
