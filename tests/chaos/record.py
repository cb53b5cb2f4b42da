"""What the soak saw, saved in its data dir (``soak.json``) so a run can be audited again.

``python -m tests.chaos.soak --reaudit DIR`` restarts nats-server on DIR's store and audits the
saved agent sessions against it: after a failed soak, to see whether something still in flight
at the deadline arrived, or to check the auditor itself on a tampered copy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tests.chaos.agents import AgentSession, Completion
from tests.chaos.targets import Exit, Fault
from tests.chaos.trainer import Update

RECORD_FILE = "soak.json"


@dataclasses.dataclass
class SoakRecord:
    seed: int
    duration_s: float
    agents: int
    sessions: list[AgentSession]
    faults: list[Fault]
    exits: list[Exit]
    gateways: int = 1  # behind a round-robin proxy when 2
    gateway_counters: dict[str, int] = dataclasses.field(default_factory=dict)  # summed
    updates: list[Update] = dataclasses.field(default_factory=list)  # the soak's trainer's

    @property
    def published_versions(self) -> set[int]:
        """0 (the model the gateways start with) and every version the trainer published
        (or tried to: a put whose answer was lost may be stored)."""
        return {0, *(u.version for u in self.updates)}

    def version_weights(self, model_dir: Path) -> dict[int, Path]:
        """Each published version's weights: ``model_dir`` (what the gateways start with) is 0."""
        return {0: model_dir, **{u.version: Path(u.checkpoint) for u in self.updates}}

    def save(self, data_dir: Path) -> None:
        body = dataclasses.asdict(self)
        (data_dir / RECORD_FILE).write_text(json.dumps(body))

    @classmethod
    def load(cls, data_dir: Path) -> SoakRecord:
        body: dict[str, Any] = json.loads((data_dir / RECORD_FILE).read_text())
        sessions = [
            AgentSession(
                **{
                    **s,
                    "completions": [Completion(**c) for c in s["completions"]],
                }
            )
            for s in body["sessions"]
        ]
        return cls(
            seed=body["seed"],
            duration_s=body["duration_s"],
            agents=body["agents"],
            sessions=sessions,
            faults=[Fault(**f) for f in body["faults"]],
            exits=[Exit(**e) for e in body["exits"]],
            gateways=body.get("gateways", 1),  # records older than two gateways: one
            gateway_counters=body.get("gateway_counters", {}),
            updates=[Update(**u) for u in body.get("updates", [])],  # none before issue 37
        )
