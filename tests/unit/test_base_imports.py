"""The base commands import none of the extras' packages (issue 12, point 5): a cheap guard
beside tests/integration/test_base_install.py, which builds a real base venv.

A fresh interpreter (this venv has torch, and other tests here import it) marks torch,
tensordict, safetensors, openai, matplotlib and ray as missing (``sys.modules[name] = None``:
``import`` raises ModuleNotFoundError and ``importlib.util.find_spec`` answers None, so
transformers, which asks before importing torch, sees no torch, as in a base install). It then
loads every base command, builds the remote backends as ``turnstream gateway --backend vllm``
and ``sglang`` do, and checks that the commands needing an extra name it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("torch", "tensordict", "safetensors", "openai", "matplotlib", "ray")
BASE_COMMANDS = (
    "export",
    "gateway",
    "inspect",
    "nats",
    "provision",
    "record",
    "refold",
    "replay",
    "shard-writer",
    "status",
    "up",
    "worker",
)

PROBE = """
import json, sys
from pathlib import Path
for name in {blocked!r}:
    sys.modules[name] = None

from schemas import TurnstreamError
from turnstream.cli import COMMANDS
from turnstream.services.gateway.assembly import build_backend, local_backend_class
from turnstream.services.gateway.settings import GatewaySettings

report = {{"loaded": [], "needs_extra": {{}}, "backends": []}}
for name in {base!r}:
    COMMANDS[name][1]()
    report["loaded"].append(name)
for kind in ("vllm", "sglang"):
    settings = GatewaySettings(
        backend=kind, backend_urls=["http://127.0.0.1:1"], max_context=4096, model=Path(".")
    )
    report["backends"].append(type(build_backend(settings, Path("."), "m")).__name__)
for name in ("train", "demo"):
    try:
        COMMANDS[name][1]()
    except TurnstreamError as exc:
        report["needs_extra"][name] = str(exc)
try:
    local_backend_class()
except TurnstreamError as exc:
    report["needs_extra"]["local"] = str(exc)
report["extras_loaded"] = sorted(
    m for m in sys.modules if m.split(".")[0] in {blocked!r} and sys.modules[m] is not None
)
print(json.dumps(report))
"""


def test_the_base_commands_and_remote_backends_need_no_extra() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", PROBE.format(blocked=EXTRAS_ONLY, base=BASE_COMMANDS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report["loaded"] == list(BASE_COMMANDS)
    assert report["backends"] == ["ReplicaRouter", "ReplicaRouter"]
    assert report["extras_loaded"] == []
    needs = report["needs_extra"]
    assert set(needs) == {"train", "demo", "local"}
    for extra, message in needs.items():
        assert f"pip install 'turnstream[{extra}]'" in message, message
