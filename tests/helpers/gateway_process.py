"""A real ``turnstream gateway`` process on a free port, like vLLM's RemoteOpenAIServer."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from eventlog.server import free_port
from tests.helpers.services import LAUNCHER
from turnstream.services.gateway.http import http_url


class GatewayProcess:
    def __init__(
        self,
        nats_url: str,
        model_dir: Path,
        data_dir: Path,
        *extra: str,
        launcher: Sequence[str] = LAUNCHER,
        host: str = "127.0.0.1",
    ) -> None:
        self.port = free_port()
        self.url = http_url(host, self.port)
        self.log_path = data_dir / "gateway.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            *launcher,
            "gateway",
            "--host",
            host,
            "--port",
            str(self.port),
            "--log.url",
            nats_url,
            "--model",
            str(model_dir),
            "--model-name",
            "tiny",
            "--data-dir",
            str(data_dir),
            "--run",
            "e2e",
            *extra,
        ]
        with self.log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TURNSTREAM_LOG_LEVEL": "INFO"},
            )
        self._wait_healthy(120)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"gateway not healthy in {timeout}s: {self.log_path.read_text()[-3000:]}"
        )

    def session(self, **body: object) -> dict[str, object]:
        response = httpx.post(f"{self.url}/v1/sessions", json=body, timeout=10)
        response.raise_for_status()
        return dict(response.json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
