"""Every request's randomness is its own and recorded, and a recorded run regenerates (issue 19,
point 2): a real `turnstream gateway` on the tiny local model, the real `openai` SDK, a real
nats-server; `turnstream record` and `turnstream replay --regenerate` as processes.

A GRPO group of four sessions asks one prompt with no seed (then a second turn at temperature
0.7, top_p 0.9): each turn samples with the seed derived from (run, session, turn), recorded in
its event; the rollouts are not all alike; sent again to the same weights, every turn comes back
token for token, its log-probs within 1e-5.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.recording import RecordedEvent, read_recording, write_recording
from eventlog.server import NatsServer
from gateway.backends.local import LocalBackend
from gateway.serving.engine import derived_seed
from schemas.codec import Codec
from schemas.events import SessionEvent, TurnCompleted
from tests.e2e.test_gateway import assistant_turn, client_for, events_of, turns_of
from tests.helpers.gateway_process import GatewayProcess
from turnstream.data.regenerate import regenerate

pytestmark = pytest.mark.integration

RUN = "seeds"
GROUP = "g"
INSTANCE = "gw-1"  # the gateway's name among a fleet's, mixed into its derived seeds
PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url,
        tiny_model_dir,
        tmp_path_factory.mktemp("gateway"),
        "--instance-id",
        INSTANCE,
    )
    yield process
    process.stop()


def two_turns(gateway: GatewayProcess, seed: int | None = None) -> str:
    """One rollout: the group's prompt, then a follow-up continuing the reply."""
    session = gateway.session(run=RUN, group=GROUP)
    client = client_for(session)
    seeded: dict[str, Any] = {} if seed is None else {"seed": seed}
    first = client.chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=16, temperature=1.0, **seeded
    )
    client.chat.completions.create(
        model="tiny",
        messages=[
            *PROMPT,
            assistant_turn(first.choices[0].message),
            {"role": "user", "content": "Why?"},
        ],
        max_tokens=16,
        temperature=0.7,
        top_p=0.9,
        **seeded,
    )
    return str(session["session_id"])


@pytest.fixture(scope="module")
def group(gateway: GatewayProcess, nats_server: NatsServer) -> dict[str, list[TurnCompleted]]:
    """The group's four sessions' turns, by session id."""
    sessions = [two_turns(gateway) for _ in range(4)]
    return {sid: turns_of(events_of(nats_server, sid, RUN)) for sid in sessions}


def turnstream(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_each_turn_records_the_seed_derived_for_it(
    group: dict[str, list[TurnCompleted]],
) -> None:
    for sid, turns in group.items():
        assert [t.turn for t in turns] == [0, 1]
        for turn in turns:
            assert turn.sampling["seed"] == derived_seed(RUN, sid, turn.turn, INSTANCE)
            assert turn.sampling["seed_derived"] is True
            assert turn.sampling["stop_token_ids"]  # the template's end tokens
        assert turns[1].sampling["temperature"] == 0.7 and turns[1].sampling["top_p"] == 0.9
    seeds = [t.sampling["seed"] for turns in group.values() for t in turns]
    assert len(set(seeds)) == len(seeds) == 8


def test_the_group_members_sample_their_own_rollouts(
    group: dict[str, list[TurnCompleted]],
) -> None:
    firsts = [tuple(turns[0].completion_ids.tolist()) for turns in group.values()]
    prompts = {tuple(turns[0].prompt_ids.tolist()) for turns in group.values()}
    assert len(prompts) == 1  # one prompt...
    assert len(set(firsts)) > 1, firsts  # ...not one sample


def test_a_client_seed_is_used_and_recorded_as_given(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    a, b = two_turns(gateway, seed=1234), two_turns(gateway, seed=1234)
    turns_a, turns_b = (turns_of(events_of(nats_server, s, RUN)) for s in (a, b))
    for turn in (*turns_a, *turns_b):
        assert turn.sampling["seed"] == 1234 and "seed_derived" not in turn.sampling
    # The client's seed is the client's choice: two sessions asking alike with it sample alike.
    assert turns_a[0].completion_ids.tolist() == turns_b[0].completion_ids.tolist()


async def test_the_group_regenerates_token_for_token(
    group: dict[str, list[TurnCompleted]], tiny_model_dir: Path
) -> None:
    events: list[SessionEvent] = [t for turns in group.values() for t in turns]
    backend = await asyncio.to_thread(LocalBackend.load, tiny_model_dir)
    try:
        report = await regenerate(events, backend)
    finally:
        await backend.close()
    assert [t.status for t in report.turns] == ["same"] * 8, [t.line() for t in report.turns]
    assert max(t.max_logprob_delta for t in report.turns) <= 1e-5


def test_replay_regenerate_checks_a_recorded_run_and_fails_on_a_changed_token(
    group: dict[str, list[TurnCompleted]],
    nats_server: NatsServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    recorded = tmp_path / "seeds.parquet"
    done = turnstream("record", "--log.url", nats_server.url, "--run", RUN, "-o", str(recorded))
    assert done.returncode == 0, done.stderr
    flags = ("--regenerate", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path))
    same = turnstream("replay", str(recorded), *flags)
    assert same.returncode == 0, same.stderr
    recording = read_recording(recorded)
    codec = Codec()
    turns = sum(isinstance(codec.decode(e.data), TurnCompleted) for e in recording.events)
    assert turns >= 8  # the group's, and the client-seeded sessions' when they ran first
    assert f"{turns} turns of {turns // 2} sessions: {turns} same, 0 differ" in same.stderr

    # One token changed in one recorded turn: that turn is named and the command fails.
    victim = next(iter(group))
    events: list[RecordedEvent] = []
    for stored in recording.events:
        event = codec.decode(stored.data)
        if isinstance(event, TurnCompleted) and event.session == victim and event.turn == 1:
            ids = event.completion_ids.copy()
            ids[0] = (ids[0] + 1) % 256
            stored = stored._replace(
                data=codec.encode(msgspec.structs.replace(event, completion_ids=ids))
            )
        events.append(stored)
    changed = tmp_path / "changed.parquet"
    write_recording(changed, events, stream=recording.meta.stream, run=RUN)
    differs = turnstream("replay", str(changed), *flags)
    assert differs.returncode == 1, differs.stderr
    assert f"session {victim} turn 1: differs: token 0" in differs.stderr
    assert "1 differ" in differs.stderr
