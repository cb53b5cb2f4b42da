"""The session API: create, read, reward, close (DESIGN §4)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol.wire import FiniteFloat, JSONObject, Wire
from schemas.events import SessionStatus
from schemas.ids import ID_PATTERN

__all__ = [
    "CloseSessionRequest",
    "CreateSessionRequest",
    "RewardReceipt",
    "RewardRequest",
    "SessionCreated",
    "SessionInfo",
]

ID = f"^{ID_PATTERN}$"


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str | None = Field(None, pattern=ID, description="default: the request's run")
    session_id: str | None = Field(None, pattern=ID, description="default: random")
    group: str | None = Field(None, max_length=256, description="GRPO prompt id")
    metadata: JSONObject = Field(default_factory=dict, description="task, env, anything")


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: FiniteFloat
    turn: int | None = Field(None, ge=0, le=2**31 - 1, description="None: the whole episode")
    key: str = Field("default", pattern=ID)
    source: str = Field("", max_length=256)
    info: JSONObject = Field(default_factory=dict)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: SessionStatus = "completed"
    reward: FiniteFloat | None = None


class SessionInfo(Wire):
    session_id: str
    run: str
    group: str | None
    metadata: dict[str, Any]
    turns: int
    status: str
    closed: bool
    created_at: float


class SessionCreated(SessionInfo):
    base_url: str = Field(description="the OpenAI base URL of this session")


class RewardReceipt(Wire):
    session_id: str
    acknowledged: bool
    seq: int = Field(description="the reward's stream sequence in EVENTS")
