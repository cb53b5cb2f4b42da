"""ATIF round trip (issue 38, point 3) with real processes: sessions served by ``turnstream up``
on the tiny tool model, ``turnstream export --kind atif`` (validated file by file by Harbor's own
validator), ``turnstream import-atif`` into a fresh run of the same log, folded by its workers:
the same token ids and log-probs, marked as not this run's on-policy samples. A document
without token ids is refused naming its file and step, and nothing is published."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from schemas.events import UNKNOWN_VERSION
from tests.helpers.harbor import harbor_trajectories
from tests.helpers.services import shard_table_rows
from tests.helpers.tiny_model import WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOLS
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration

JSON = dict[str, Any]


def turnstream(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip


def serve_session(up: UpProcess, turns: int) -> str:
    """The weather question and ``turns`` turns, each reply and tool result fed back."""
    opened = httpx.post(f"{up.url}/v1/sessions", json={}, timeout=30).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[JSON] = [*WEATHER_QUESTION]
    for _ in range(turns):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=WEATHER_TOOLS, temperature=1.0,  # type: ignore[arg-type]
            max_tokens=48,
        )  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": WEATHER_RESULT}
            for c in message.tool_calls or ()
        ]
        messages.append({"role": "user", "content": "And tomorrow?"})
    closed = httpx.post(f"{up.url}/v1/sessions/{opened['session_id']}/close",
                        json={"reward": 0.5}, timeout=30)  # fmt: skip
    assert closed.status_code == 200, closed.text
    return str(opened["session_id"])


def rows_of(data: Path, run: str) -> dict[str, JSON]:
    return {
        str(r["trajectory_id"]).split("/", 1)[1]: r
        for r in shard_table_rows(data / "shards")
        if r["run"] == run
    }


def test_served_sessions_export_as_atif_and_import_back_to_the_same_tokens(
    tmp_path: Path, tool_model_dir: Path
) -> None:
    data = tmp_path / "data"
    up = UpProcess(data, tool_model_dir)
    try:
        up.wait_healthy()
        sessions = [serve_session(up, 2), serve_session(up, 1)]
        wait_for(lambda: len(rows_of(data, "up")) >= 2, 90, "the sessions in the shards")
        served = rows_of(data, "up")

        out = tmp_path / "atif"
        done = turnstream("export", "--data-dir", str(data), "--run", "up", "--kind", "atif",
                          "-o", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "exported 2 ATIF trajectories" in done.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["kind"], manifest["format"], manifest["sessions"]) == ("atif", "json", 2)
        files = sorted(p.name for p in (out / "data").iterdir())
        assert files == sorted(f"{s}.json" for s in sessions)
        _, validator = harbor_trajectories()
        for name in files:  # Harbor's own validator, on the files as written
            checker = validator.TrajectoryValidator()
            assert checker.validate(out / "data" / name), checker.get_errors()
        document = json.loads((out / "data" / f"{sessions[0]}.json").read_text())
        agent_steps = [s for s in document["steps"] if s["source"] == "agent"]
        assert len(agent_steps) == 2
        assert document["extra"]["reward"] == 0.5

        broken = tmp_path / "broken.json"
        del agent_steps[1]["metrics"]["prompt_token_ids"]
        broken.write_text(json.dumps(document))
        good = out / "data" / f"{sessions[1]}.json"  # converted, and still not published
        refused = turnstream("import-atif", str(good), str(broken), "--run", "bad",
                             "--data-dir", str(data))  # fmt: skip
        assert refused.returncode == 1, refused.stderr
        step_id = agent_steps[1]["step_id"]
        assert f"{broken}: step {step_id} has no metrics.prompt_token_ids" in refused.stderr
        assert "Traceback" not in refused.stderr

        imported = turnstream("import-atif", str(out / "data"), "--run", "imp",
                              "--data-dir", str(data))  # fmt: skip
        assert imported.returncode == 0, imported.stderr
        assert "imported 2 ATIF trajectories (3 turns) into run imp" in imported.stderr
        wait_for(lambda: len(rows_of(data, "imp")) >= 2, 90, "the imported sessions folded")
        again = turnstream("import-atif", str(out / "data"), "--run", "imp",
                           "--data-dir", str(data))  # fmt: skip
        assert again.returncode == 0 and "0 events published" in again.stderr, again.stderr
    finally:
        assert up.stop() == 0, up.output()[-4000:]
        up.cleanup()

    folded = rows_of(data, "imp")
    assert sorted(folded) == sorted(served)
    assert not rows_of(data, "bad")  # the refused import published nothing
    for key, before in served.items():
        after = folded[key]
        for column in ("input_ids", "loss_mask", "turn_ends", "prompt_len", "num_turns"):
            assert after[column] == before[column], (key, column)
        assert np.array_equal(np.float32(after["logprobs"]), np.float32(before["logprobs"]))
        assert after["reward"] == before["reward"] == 0.5
        generated = np.array(after["loss_mask"]) == 1
        assert set(np.array(after["versions"])[generated].tolist()) == {UNKNOWN_VERSION}
        assert after["min_weight_version"] == UNKNOWN_VERSION  # stale under any bound
        metadata = json.loads(str(after["metadata"]))
        assert metadata["logprobs_kind"] == "imported"
        assert metadata["atif"]["session_id"] == before["session"]
