"""One episode through turnstream: a session on the gateway, an agent, the logged trajectories.

An episode (``Rollouts.episode``):

1. open a session on the gateway (its ``group``: the GRPO prompt id, e.g. verl's ``uid``);
2. wait for its trajectories on TRAJ from now on (``TrajectoryFeed``, before anything can close it);
3. run the user's agent, an async callable given an ``AgentTask`` (the session's OpenAI
   ``base_url``, the prompt's messages, tools, extra info, sampling parameters) that returns the
   reward;
4. close the session with that reward, or, when the agent failed, with status ``aborted``
   (``timeout`` past ``agent_timeout_s``) and no reward;
5. take the folded trajectories back from the log: the sample is what the fold made of the
   tokens the gateway served, not what the agent thinks it sent.

``samples`` turns an episode into the training sample a framework gets back.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import math
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from eventlog import LogSettings
from schemas.events import JSON, SessionStatus, TrajectoryReady
from schemas.ids import ID_PATTERN
from turnstream.integrations.errors import AgentFailed, SessionClosedElsewhere
from turnstream.integrations.sessions import ClosedSession, GatewaySessions, OpenedSession
from turnstream.integrations.trajectories import TrajectoryFeed

__all__ = [
    "Agent",
    "AgentTask",
    "Episode",
    "EpisodeSpec",
    "RolloutSettings",
    "Rollouts",
    "SharedRollouts",
    "load_agent",
]


class RolloutSettings(BaseModel):
    """Where episodes run: the gateway, the log it publishes to, the run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gateway_url: str = Field(description="the gateway's base URL (http://host:8000)")
    log_url: str = Field(description="the log the gateway publishes to (nats://host:4222)")
    run: str = Field(pattern=f"^{ID_PATTERN}$", description="the run sessions are opened in")
    api_key: SecretStr | None = Field(None, description="bearer key, if the gateway needs one")
    model: str | None = Field(None, description="model name agents send; unset: the gateway's")
    log: LogSettings = Field(
        default_factory=LogSettings, description="credentials and TLS of the log (url: log_url)"
    )
    http_timeout_s: float = Field(30.0, gt=0, description="per session-API request")
    agent_timeout_s: float = Field(600.0, gt=0, description="an agent running longer fails")
    trajectory_timeout_s: float = Field(
        120.0, gt=0, description="wait for a closed session's trajectories on TRAJ"
    )


@dataclass(frozen=True)
class EpisodeSpec:
    """One rollout as the framework asks for it."""

    messages: list[JSON]  # the prompt's chat messages
    group: str | None = None  # GRPO prompt id: the rollouts of one prompt share it
    tools: list[JSON] = field(default_factory=list)  # OpenAI tool schemas the agent may offer
    tools_kwargs: JSON = field(default_factory=dict)  # per-sample tool arguments (verl's)
    extra_info: JSON = field(default_factory=dict)  # the dataset row's extra info
    sampling_params: JSON = field(default_factory=dict)  # the framework's sampling parameters
    max_response_tokens: int | None = None  # the framework's budget for the whole response
    metadata: JSON = field(default_factory=dict)  # stored with the session (SessionOpened)


@dataclass(frozen=True)
class AgentTask:
    """What an agent gets: a session to talk to and the prompt to work on.

    Use ``base_url``, ``api_key`` and ``model`` with any OpenAI client; every request on it is a
    turn of this session. Return the episode's reward.
    """

    base_url: str
    api_key: str  # "unused" when the gateway needs none (the openai SDK insists on one)
    model: str
    run: str
    session_id: str
    group: str | None
    messages: list[JSON]
    tools: list[JSON]
    tools_kwargs: JSON
    extra_info: JSON
    sampling_params: JSON
    max_response_tokens: int | None

    def openai_sampling(self) -> dict[str, float]:
        """The sampling parameters an OpenAI chat request takes from ``sampling_params``
        (``temperature``, ``top_p``), to pass as ``create(..., **task.openai_sampling())``."""
        return {
            name: float(self.sampling_params[name])
            for name in ("temperature", "top_p")
            if isinstance(self.sampling_params.get(name), int | float)
        }


Agent = Callable[[AgentTask], Awaitable[float]]


def load_agent(path: str) -> Agent:
    """The async callable named ``package.module:function``; ValueError says what is wrong."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"agent {path!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"agent {path!r}: cannot import {module_name}: {exc}") from exc
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
    if target is None or not callable(target):
        raise ValueError(f"agent {path!r}: {module_name} has no callable {name}")
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(target.__call__)):
        raise ValueError(f"agent {path!r} must be an async function (async def) of an AgentTask")
    agent: Agent = target
    return agent


@dataclass(frozen=True)
class Episode:
    session: OpenedSession
    status: SessionStatus  # what the session was closed with
    trajectories: list[TrajectoryReady]  # by segment; empty when the agent made no turn
    reward: float | None  # what the agent returned; None when it failed
    error: AgentFailed | None  # why the agent failed; None when it finished
    agent_s: float  # how long the agent ran


class Rollouts:
    """Episodes on one gateway, their trajectories from one feed (see the module docstring)."""

    def __init__(
        self, settings: RolloutSettings, sessions: GatewaySessions, feed: TrajectoryFeed
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.feed = feed

    async def episode(self, agent: Agent, spec: EpisodeSpec) -> Episode:
        s = self.settings
        model = s.model or await self.sessions.served_model()
        session = await self.sessions.open(run=s.run, group=spec.group, metadata=spec.metadata)
        where = f"session {s.run}/{session.session_id}"
        with self.feed.expecting(session.session_id) as waiter:
            started = time.perf_counter()
            reward, error, status = await self._run_agent(agent, _task(spec, session, model, s))
            agent_s = time.perf_counter() - started
            try:
                closed = await self.sessions.close(session, reward=reward, status=status)
            except SessionClosedElsewhere as exc:
                # Folded all the same (the reaper's close), but without this episode's reward.
                error = error or AgentFailed(f"{where} was closed before its agent finished: {exc}")
                reward = None
                closed = ClosedSession(
                    session.session_id, "timeout", await self.sessions.turns(session)
                )
            if closed.turns == 0:
                error = error or AgentFailed(
                    f"the agent of {where} made no model call through its base_url "
                    f"({session.base_url}): nothing to train on"
                )
                return Episode(session, status, [], None, error, agent_s)
            trajectories = await waiter.wait(s.trajectory_timeout_s, where=self.feed.where)
        return Episode(session, status, trajectories, reward, error, agent_s)

    async def _run_agent(
        self, agent: Agent, task: AgentTask
    ) -> tuple[float | None, AgentFailed | None, SessionStatus]:
        where = f"the agent of session {task.run}/{task.session_id}"
        timeout_s = self.settings.agent_timeout_s
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                value = await agent(task)
        except asyncio.CancelledError:
            # The framework gave up on this sample: close the session (best effort) on the way.
            self.sessions.close_in_background(_session_of(task), status="aborted")
            raise
        except TimeoutError as exc:
            if deadline.expired():
                return (
                    None,
                    _failed(f"{where} did not finish within {timeout_s:g} s", exc),
                    "timeout",
                )
            return None, _failed(f"{where} raised {exc!r}", exc), "aborted"
        except Exception as exc:
            return None, _failed(f"{where} raised {exc!r}", exc), "aborted"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return None, AgentFailed(f"{where} returned {value!r}, not a finite reward"), "aborted"
        return float(value), None, "completed"


def _task(spec: EpisodeSpec, session: OpenedSession, model: str, s: RolloutSettings) -> AgentTask:
    return AgentTask(
        base_url=session.base_url,
        api_key=s.api_key.get_secret_value() if s.api_key is not None else "unused",
        model=model,
        run=session.run,
        session_id=session.session_id,
        group=session.group,
        messages=spec.messages,
        tools=spec.tools,
        tools_kwargs=spec.tools_kwargs,
        extra_info=spec.extra_info,
        sampling_params=spec.sampling_params,
        max_response_tokens=spec.max_response_tokens,
    )


def _session_of(task: AgentTask) -> OpenedSession:
    return OpenedSession(task.session_id, task.run, task.group, task.base_url)


def _failed(message: str, cause: BaseException) -> AgentFailed:
    error = AgentFailed(message)
    error.__cause__ = cause
    return error


# -- sharing per event loop ---------------------------------------------------------------------

FeedKey = tuple[str, str, LogSettings]  # (log url, run, credentials and TLS)
GatewayKey = tuple[str, SecretStr | None, float]  # (gateway url, key, timeout)


class _LoopShare:
    """What the samples running on one event loop share."""

    def __init__(self) -> None:
        self.feeds: dict[FeedKey, asyncio.Task[TrajectoryFeed]] = {}
        self.gateways: dict[GatewayKey, GatewaySessions] = {}

    async def aclose(self) -> None:
        for starting in self.feeds.values():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await (await starting).close()
        for gateway in self.gateways.values():
            await gateway.aclose()
        self.feeds.clear()
        self.gateways.clear()


class SharedRollouts:
    """``Rollouts`` for every sample of an event loop, sharing ONE ``TrajectoryFeed`` per (log,
    run) and one connection pool per gateway.

    verl makes an agent-loop object per sample and runs a batch of them with ``asyncio.gather``,
    so what they share cannot live in those objects; an instance of this class (one, held by the
    agent-loop class) keeps it per event loop, since asyncio connections belong to the loop that
    made them. A loop's share is dropped when the loop is; ``aclose`` closes the running loop's.
    """

    def __init__(self) -> None:
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopShare] = (
            weakref.WeakKeyDictionary()
        )

    async def get(self, settings: RolloutSettings) -> Rollouts:
        share = self._loops.setdefault(asyncio.get_running_loop(), _LoopShare())
        key: FeedKey = (settings.log_url, settings.run, settings.log)
        starting = share.feeds.get(key)
        if starting is None:
            starting = asyncio.ensure_future(
                TrajectoryFeed.open(settings.log_url, settings.run, settings.log)
            )
            share.feeds[key] = starting
        try:
            # shield: one sample cancelled while the feed starts must not cancel it for all.
            feed = await asyncio.shield(starting)
        except asyncio.CancelledError:
            raise
        except Exception:
            if share.feeds.get(key) is starting:  # the next sample tries again
                del share.feeds[key]
            raise
        gateway_key: GatewayKey = (settings.gateway_url, settings.api_key, settings.http_timeout_s)
        sessions = share.gateways.get(gateway_key)
        if sessions is None:
            sessions = GatewaySessions(
                settings.gateway_url,
                api_key=settings.api_key.get_secret_value() if settings.api_key else None,
                timeout_s=settings.http_timeout_s,
            )
            share.gateways[gateway_key] = sessions
        return Rollouts(settings, sessions, feed)

    def feeds(self) -> int:
        """How many feeds the running loop holds (for tests and metrics)."""
        share = self._loops.get(asyncio.get_running_loop())
        return len(share.feeds) if share is not None else 0

    async def aclose(self) -> None:
        """Close the running loop's feeds and connection pools."""
        share = self._loops.pop(asyncio.get_running_loop(), None)
        if share is not None:
            await share.aclose()
