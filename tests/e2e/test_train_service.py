"""``turnstream train`` (issue 11, point 6): the reference trainer as a process of its own beside
``turnstream up``, meeting the gateway only in the log; agents on the real openai SDK."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.up_process import UpProcess

pytestmark = pytest.mark.integration

RUN = "up"  # UpProcess's run
GROUP_SIZE = 2
TEMPERATURE = 0.8  # not 1: the trainer is told the agents' temperature, and checks it
_groups = itertools.count()


@pytest.fixture
def up(tmp_path: Path, tiny_model_dir: Path) -> Iterator[UpProcess]:
    stack = UpProcess(tmp_path / "data", tiny_model_dir)
    try:
        yield stack.wait_healthy()
    finally:
        stack.stop()
        stack.cleanup()


class TrainProcess:
    def __init__(self, data_dir: Path, model: Path, *args: str) -> None:
        self.log_path = data_dir / f"train-{next(_groups)}.log"
        with self.log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnstream.cli", "train", "--data-dir", str(data_dir),
                 "--model", str(model), "--temperature", str(TEMPERATURE),
                 "--sink.group-size", str(GROUP_SIZE), "--lr", "1e-3", *args],
                stdout=log_file, stderr=subprocess.STDOUT,
                env={**os.environ, "TURNSTREAM_LOG_LEVEL": "INFO", "COLUMNS": "400"},
            )  # fmt: skip

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"train did not exit:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def weight_version(up: UpProcess) -> int:
    return int(httpx.get(f"{up.url}/health", timeout=10).json()["weight_version"])


def episode(up: UpProcess, group: str, number: int) -> None:
    """One agent episode through the OpenAI API: a turn, a tool result, a turn; then a reward."""
    opened = httpx.post(f"{up.url}/v1/sessions", json={"group": group}, timeout=30).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"Say something, {group}."}]
    for turn in range(2):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, temperature=TEMPERATURE, max_tokens=6
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if turn == 0:
            messages.append({"role": "user", "content": "(tool) nothing found"})
    client.close()
    httpx.post(
        f"{up.url}/v1/sessions/{opened['session_id']}/close",
        json={"reward": float(number % GROUP_SIZE)},  # a spread within each group: an advantage
        timeout=30,
    )


def agents_until(up: UpProcess, done: Callable[[], bool], max_groups: int = 40) -> int:
    """Complete GRPO groups, one after another, until ``done()``; the number of groups."""
    for count in range(max_groups):
        if done():
            return count
        group = f"g{next(_groups)}"
        for number in range(GROUP_SIZE):
            episode(up, group, number)
    raise AssertionError(f"not done after {max_groups} groups of {GROUP_SIZE}")


def wait_served(up: UpProcess, version: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while weight_version(up) < version:
        assert time.monotonic() < deadline, f"the gateway never served version {version}"
        time.sleep(0.1)


def test_train_learns_live_publishes_policies_and_stops_cleanly(
    up: UpProcess, tiny_model_dir: Path
) -> None:
    stack = json.loads((up.data_dir / "stack.json").read_text())
    assert weight_version(up) == 0

    # A trainer given a step count and the log's URL: trains, publishes, exits 0 by itself.
    first = TrainProcess(up.data_dir, tiny_model_dir, "--log.url", stack["nats_url"], "--run",
                         RUN, "--steps", "1")  # fmt: skip
    try:
        agents_until(up, lambda: first.proc.poll() is not None)
        assert first.wait() == 0, first.output()[-4000:]
    finally:
        first.kill()
    out = first.output()
    assert f"training run {RUN} from policy version 0 (grpo" in out
    assert "step 1: policy version 1, 2 samples, mean reward 0.500" in out
    assert "trainer stopped after 1 steps at policy version 1" in out
    # A service's log is lines: no progress bar of transformers' model loading.
    assert "Loading weights" not in out
    wait_served(up, 1)  # the gateway loaded the trainer's checkpoint through ts_policy

    # One with neither: it joins the stack in data/stack.json (its log and run), resumes at the
    # published version, trains until SIGTERM, finishes the step and exits 0.
    second = TrainProcess(up.data_dir, tiny_model_dir)
    try:
        agents_until(up, lambda: weight_version(up) >= 3)
        second.proc.send_signal(signal.SIGTERM)
        assert second.wait() == 0, second.output()[-4000:]
    finally:
        second.kill()
    out = second.output()
    assert f"training run {RUN} from policy version 1 (grpo" in out
    assert f"waiting for trajectories on {stack['nats_url']}" in out
    assert "step 1: policy version 2," in out and "step 2: policy version 3," in out
    steps = out.count(": policy version ")
    assert f"trainer stopped after {steps} steps at policy version {steps + 1}" in out
    assert "Loading weights" not in out  # nor when it starts from a checkpoint
    wait_served(up, steps + 1)
    for version in range(1, steps + 2):
        assert (up.data_dir / "checkpoints" / RUN / f"v{version}" / "model.safetensors").is_file()


def test_train_refuses_to_start_without_a_log_to_join(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "train", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "train needs the log's URL: --log.url" in done.stderr
