"""Errors of the integrations (running rollouts through a gateway, publishing weight versions).

TurnstreamError
└── IntegrationError
    ├── GatewayUnavailable    the gateway did not answer (connection refused, timeout)
    ├── GatewayRefused        the gateway answered an error (its status and message)
    │   └── SessionClosedElsewhere   a close found the session closed already (the reaper)
    ├── AgentFailed           the user's agent raised, timed out, returned no usable
    │                         reward, or made no model call through the session
    ├── TrajectoryTimeout     the session's trajectories did not reach TRAJ in time
    └── WeightVersionError    a weight version older than the one the run already serves
"""

from __future__ import annotations

from schemas.errors import TurnstreamError

__all__ = [
    "AgentFailed",
    "GatewayRefused",
    "GatewayUnavailable",
    "IntegrationError",
    "SessionClosedElsewhere",
    "TrajectoryTimeout",
    "WeightVersionError",
]


class IntegrationError(TurnstreamError):
    """Root of the integrations' errors."""


class GatewayUnavailable(IntegrationError):
    """The gateway's session API did not answer."""


class GatewayRefused(IntegrationError):
    """The gateway's session API answered an error."""

    def __init__(self, message: str, *, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SessionClosedElsewhere(GatewayRefused):
    """A close found the session already closed, e.g. by the reaper after its idle timeout."""


class AgentFailed(IntegrationError):
    """The agent of an episode did not finish with a reward."""


class TrajectoryTimeout(IntegrationError):
    """A closed session's trajectories did not arrive on the TRAJ stream in time."""


class WeightVersionError(IntegrationError):
    """A trainer published a weight version older than the one its run already serves."""
