"""PolicyUpdated (DESIGN §3): the trainer's newest policy, one entry per run in ``ts_policy``.

The trainer puts ``{"version": int, "checkpoint": "/abs/path"}`` under the run's key; gateways
watch that key and follow every newer version. Both sides use this one format.

``mode`` (absent: "wait") says what a backend that loads the checkpoint itself (``local``) does
with the generations in flight, as vLLM's ``POST /pause?mode=`` does: "wait", they finish on the
weights they started with; "abort", they end at once (the gateway continues each on the new
weights, DESIGN §4) and new ones wait for the load; "keep", each goes on, on the new weights from
the next token. A trainer of remote servers pauses them itself, and the mode is not read.

``checkpoint`` may be absent (or null): the trainer loaded the weights into its inference
servers itself (verl syncs its vLLM servers in place), and the entry only says which version
they now serve. A gateway in front of such servers records that version on every new turn; a
backend that holds its own weights (``local``) cannot follow such an entry and keeps its own.

>>> raw = encode_policy_update(PolicyUpdate(3, Path("/ckpt/v3")))
>>> raw
b'{"version": 3, "checkpoint": "/ckpt/v3"}'
>>> parse_policy_update(raw)
PolicyUpdate(version=3, checkpoint=PosixPath('/ckpt/v3'), mode='wait')
>>> encode_policy_update(PolicyUpdate(4))
b'{"version": 4}'
>>> parse_policy_update(b'{"version": 4, "checkpoint": null}')
PolicyUpdate(version=4, checkpoint=None, mode='wait')
>>> encode_policy_update(PolicyUpdate(5, Path("/ckpt/v5"), "abort"))
b'{"version": 5, "checkpoint": "/ckpt/v5", "mode": "abort"}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

__all__ = ["PolicyUpdate", "UpdateMode", "encode_policy_update", "parse_policy_update"]

# What happens to the generations in flight when a backend loads new weights (vLLM's pause modes).
UpdateMode = Literal["wait", "abort", "keep"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)


@dataclass(frozen=True)
class PolicyUpdate:
    version: int
    checkpoint: Path | None = None  # None: the trainer updated its inference servers itself
    mode: UpdateMode = "wait"


def encode_policy_update(update: PolicyUpdate) -> bytes:
    doc: dict[str, object] = {"version": update.version}
    if update.checkpoint is not None:
        doc["checkpoint"] = str(update.checkpoint)
    if update.mode != "wait":
        doc["mode"] = update.mode
    return json.dumps(doc).encode()


def parse_policy_update(raw: bytes) -> PolicyUpdate:
    """Decode a ``ts_policy`` value; ValueError names what is wrong with it."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    version, checkpoint = doc.get("version"), doc.get("checkpoint")
    # bool is an int in Python; a version of `true` is a trainer bug, not version 1.
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f'"version" must be a non-negative integer, got {version!r}')
    mode = doc.get("mode", "wait")
    if mode not in UPDATE_MODES:
        raise ValueError(f'"mode" must be one of {", ".join(UPDATE_MODES)}, got {mode!r}')
    if checkpoint is None:
        return PolicyUpdate(version, mode=mode)
    if not isinstance(checkpoint, str) or not checkpoint:
        raise ValueError(
            f'"checkpoint" must be a non-empty path string, or absent, got {checkpoint!r}'
        )
    return PolicyUpdate(version, Path(checkpoint), mode)
