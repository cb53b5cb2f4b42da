"""Event models, codec, subjects and errors: the contract every turnstream package shares."""

from schemas.codec import DEFAULT_MAX_PAYLOAD, Codec, Upcaster
from schemas.errors import (
    EventLogError,
    EventLogUnavailable,
    InvalidIdentifier,
    OutboxFull,
    PayloadTooLarge,
    ProvisioningError,
    SchemaError,
    TurnstreamError,
    UndecodableEvent,
    UnsupportedSchemaVersion,
    UntrustedEvent,
)
from schemas.events import (
    SCHEMA_VERSION,
    CompactTrajectory,
    Event,
    RewardAssigned,
    SessionClosed,
    SessionEvent,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.ids import validate_id
from schemas.routing import Route, route

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "SCHEMA_VERSION",
    "Codec",
    "CompactTrajectory",
    "Event",
    "EventLogError",
    "EventLogUnavailable",
    "InvalidIdentifier",
    "OutboxFull",
    "PayloadTooLarge",
    "ProvisioningError",
    "RewardAssigned",
    "Route",
    "SchemaError",
    "SessionClosed",
    "SessionEvent",
    "SessionOpened",
    "TrajectoryReady",
    "TurnCompleted",
    "TurnstreamError",
    "UndecodableEvent",
    "UnsupportedSchemaVersion",
    "UntrustedEvent",
    "Upcaster",
    "route",
    "validate_id",
]
