"""A turn continued across a weight update regenerates part by part (issue 37, point 6): a real
`turnstream gateway` on the tiny local model, the real `openai` SDK streaming, a real
nats-server; the trainer's side is a `ts_policy` entry in mode "abort" put while the turn is
being generated, so the local backend aborts it, loads the new weights and the gateway continues
it on them. Then `turnstream record` and `turnstream replay --regenerate` as processes: with
both versions' checkpoints each part comes back token for token; with one, the other part is
named as not regenerated; with the wrong weights for a version, its part differs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from nats import connect
from safetensors.torch import load_file, save_file

from eventlog.server import NatsServer
from gateway.serving.generating import continued_seed
from schemas.events import TurnCompleted
from schemas.policy import PolicyUpdate, encode_policy_update
from tests.e2e.test_gateway import client_for, events_of, turns_of
from tests.e2e.test_regenerate import turnstream
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration

RUN = "e2e"  # the gateway's run: its key in ts_policy, and its sessions'
PROMPT = [{"role": "user", "content": "Tell me a long story."}]
ATTEMPTS = 12  # a turn the backend finished before the abort reached it is tried again


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, tiny_model_dir, tmp_path_factory.mktemp("gw"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other weights of the same model: the tiny model's, each moved by seeded noise."""
    state = load_file(tiny_model_dir / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    moved = {
        name: t + 0.05 * torch.randn(t.shape, generator=noise) if t.is_floating_point() else t
        for name, t in state.items()
    }
    path = tmp_path_factory.mktemp("ckpt") / "v-perturbed.safetensors"
    save_file({name: t.contiguous() for name, t in moved.items()}, path)
    return path


def publish_on_first_token(
    url: str, update: PolicyUpdate
) -> tuple[threading.Event, threading.Thread]:
    """A trainer connected ahead of time, which puts ``update`` once the event is set: the
    turn's first token has arrived, so its generation is running."""
    ready, first_token = threading.Event(), threading.Event()

    async def trainer() -> None:
        nc = await connect(url)
        try:
            kv = await nc.jetstream().key_value("ts_policy")
            ready.set()
            await asyncio.to_thread(first_token.wait, 60)
            await kv.put(RUN, encode_policy_update(update))
        finally:
            await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(trainer(),))
    thread.start()
    assert ready.wait(30), "the trainer could not connect"
    return first_token, thread


@pytest.fixture(scope="module")
def interrupted(
    gateway: GatewayProcess, nats_server: NatsServer, tiny_model_dir: Path, perturbed: Path
) -> tuple[TurnCompleted, dict[int, Path]]:
    """A streamed turn aborted by a weight update and continued on the new version, and the
    checkpoint of every version served meanwhile (odd: perturbed, even: the tiny model's)."""
    checkpoints = {0: tiny_model_dir}
    for version in range(1, ATTEMPTS + 1):
        checkpoint = perturbed if version % 2 else tiny_model_dir / "model.safetensors"
        checkpoints[version] = checkpoint
        session = gateway.session(run=RUN)
        first_token, trainer = publish_on_first_token(
            nats_server.url, PolicyUpdate(version, checkpoint, "abort")
        )
        try:
            stream = client_for(session).chat.completions.create(
                model="tiny", messages=PROMPT, max_tokens=2000, temperature=1.0,
                seed=version, stream=True,
            )  # fmt: skip
            text = ""
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first_token.set()
                    text += chunk.choices[0].delta.content
        finally:
            first_token.set()
            trainer.join(30)
        wait_for(
            lambda v=version: httpx.get(f"{gateway.url}/health").json()["weight_version"] == v,
            30,
            f"the gateway serving version {version}",
        )
        [turn] = turns_of(events_of(nats_server, str(session["session_id"]), RUN))
        assert turn.text == text  # one answer, whole, whatever happened under it
        if turn.continuations():
            return turn, checkpoints
    pytest.fail(f"no turn of {ATTEMPTS} was still generating when its weights were updated")


def test_the_continued_turn_records_both_versions_and_where_they_meet(
    interrupted: tuple[TurnCompleted, dict[int, Path]],
) -> None:
    turn, _ = interrupted
    [(at, seed)] = turn.continuations()
    new = turn.weight_version + 1
    assert turn.version_spans == [(turn.weight_version, at), (new, len(turn.completion_ids) - at)]
    assert seed == continued_seed(turn.sampling["seed"], at)


def test_replay_regenerates_each_part_against_its_own_version(
    interrupted: tuple[TurnCompleted, dict[int, Path]],
    nats_server: NatsServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    turn, checkpoints = interrupted
    old, new = turn.weight_version, turn.weight_version + 1
    [(at, _)] = turn.continuations()
    n = len(turn.completion_ids)
    recorded = tmp_path / "interrupted.parquet"
    done = turnstream("record", "--log.url", nats_server.url, "--run", RUN, "-o", str(recorded))
    assert done.returncode == 0, done.stderr
    flags = ["--regenerate", "--model", str(tiny_model_dir), "--data-dir", str(tmp_path)]
    every = [f"--checkpoint={v}={path}" for v, path in checkpoints.items() if v <= new]

    both = turnstream("replay", str(recorded), *flags, *every)

    assert both.returncode == 0, both.stderr
    where = f"session {turn.session} turn 0"
    assert f"{where}: same {n} tokens" in both.stderr
    assert f"part 0 (tokens 0-{at - 1}, version {old}): same {at} tokens" in both.stderr
    assert f"part 1 (tokens {at}-{n - 1}, version {new}): same {n - at} tokens" in both.stderr
    assert " 0 differ, 0 failed, 0 not reproducible" in both.stderr

    # Without the new version's weights, its part is named and left alone; the rest passes.
    without = [flag for flag in every if not flag.startswith(f"--checkpoint={new}=")]
    one = turnstream("replay", str(recorded), *flags, *without)

    assert one.returncode == 0, one.stderr
    assert f"{where}: partial: 1 of 2 parts regenerated, the same" in one.stderr
    assert f"part 0 (tokens 0-{at - 1}, version {old}): same {at} tokens" in one.stderr
    assert (
        f"part 1 (tokens {at}-{n - 1}) at version {new}: no weights for that version here "
        f"(--checkpoint {new}=PATH); not regenerated"
    ) in one.stderr
    assert "1 partly regenerated" in one.stderr

    # The old version's weights given as the new one's: the continuation is not theirs.
    wrong = [*without, f"--checkpoint={new}={checkpoints[old]}"]
    differs = turnstream("replay", str(recorded), *flags, *wrong)

    assert differs.returncode == 1, differs.stderr
    assert f"{where}: differs: part 1 of 2 parts (below)" in differs.stderr
    assert f"part 1 (tokens {at}-{n - 1}, version {new}): differs: token " in differs.stderr


def test_inspect_shows_where_the_versions_meet(
    interrupted: tuple[TurnCompleted, dict[int, Path]],
    nats_server: NatsServer,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    turn, _ = interrupted
    [(at, _)] = turn.continuations()
    old, new = turn.weight_version, turn.weight_version + 1
    shown = turnstream(
        "inspect", turn.session, "--run", RUN, "--log.url", nats_server.url,
        "--model", str(tiny_model_dir), "--data-dir", str(tmp_path),
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    story = f"weight_version {old} · versions {old}→{new} at token {at} (continued after an abort)"
    assert f"── turn 0 · {story} · finish " in shown.stdout
    assert f"⟨v{old}→v{new}⟩" in shown.stdout
