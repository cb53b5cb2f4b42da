"""Create or update the streams and buckets from settings; running it twice changes nothing.

Streams: EVENTS (``ts.ev.>``, direct get on, so a fold worker can read one session's events by
subject), TRAJ (``ts.traj.>``), DLQ (``ts.dlq.>``). KV buckets: policy versions, reaper idle
state, fold markers, commit records. Object store: images (``eventlog.objects``: its max age
follows the events'). A setting that differs from the live config is updated in place; one JetStream
cannot change (storage type, for one) raises ProvisioningError naming both values.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js import errors as js_errors

from eventlog.config import LogSettings
from eventlog.connection import answered
from eventlog.objects import image_bucket_config
from schemas.errors import EventLogUnavailable, ProvisioningError
from schemas.ids import DLQ_SUBJECT_PREFIX, EVENT_SUBJECT_PREFIX, TRAJ_SUBJECT_PREFIX

__all__ = ["ProvisionAction", "desired_streams", "provision"]

log = logging.getLogger(__name__)

Action = Literal["created", "updated", "unchanged"]

# The fields we own; anything else on a live stream (set by an operator) is left alone.
# JetStream's 'error creating store for stream': a store of that name still being removed.
_STORE_BUSY = 10049
_STORE_BUSY_TRIES = 20
_OWNED = (
    "subjects",
    "max_age",
    "max_bytes",
    "duplicate_window",
    "num_replicas",
    "storage",
    "allow_direct",
    "discard",
    "retention",
    "max_msgs_per_subject",
)


@dataclass(frozen=True)
class ProvisionAction:
    name: str
    action: Action
    changed: tuple[str, ...] = ()


def _stream(
    name: str,
    subjects: list[str],
    max_age: float,
    max_bytes: int,
    s: LogSettings,
    duplicate_window: float | None = None,
) -> js_api.StreamConfig:
    window = s.duplicate_window_s if duplicate_window is None else duplicate_window
    if max_age:
        window = min(window, max_age)  # JetStream refuses a window longer than the retention
    return js_api.StreamConfig(
        name=name,
        subjects=subjects,
        retention=js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        num_replicas=s.replicas,
        max_age=max_age or None,
        max_bytes=max_bytes,
        duplicate_window=window,
        discard=js_api.DiscardPolicy.OLD,
        allow_direct=True,
        max_msgs_per_subject=-1,
    )


def desired_streams(s: LogSettings) -> list[js_api.StreamConfig]:
    n = s.names
    return [
        _stream(n.events, [f"{EVENT_SUBJECT_PREFIX}.>"], s.events_max_age_s, s.events_max_bytes, s),
        _stream(
            n.trajectories,
            [f"{TRAJ_SUBJECT_PREFIX}.>"],
            s.trajectories_max_age_s,
            s.trajectories_max_bytes,
            s,
        ),
        _stream(n.dead_letters, [f"{DLQ_SUBJECT_PREFIX}.>"], s.dead_letters_max_age_s, -1, s),
    ]


def desired_buckets(s: LogSettings) -> list[js_api.KeyValueConfig]:
    n = s.names
    return [
        js_api.KeyValueConfig(
            bucket=n.policy_bucket, history=5, replicas=s.replicas, storage=js_api.StorageType.FILE
        ),
        js_api.KeyValueConfig(
            bucket=n.sessions_bucket,
            history=1,
            replicas=s.replicas,
            ttl=s.session_idle_ttl_s or None,
            storage=js_api.StorageType.FILE,
        ),
        js_api.KeyValueConfig(
            bucket=n.folded_bucket,
            history=1,
            replicas=s.replicas,
            ttl=s.folded_marker_ttl_s or None,
            storage=js_api.StorageType.FILE,
        ),
        js_api.KeyValueConfig(
            bucket=n.commits_bucket,
            history=1,
            replicas=s.replicas,
            ttl=s.commit_record_ttl_s,
            storage=js_api.StorageType.FILE,
        ),
    ]


def _norm(value: Any) -> Any:
    """Compare configs as the server reports them: 0 / None / -1 all mean 'no limit'."""
    if value in (None, 0, 0.0, -1):
        return None
    if isinstance(value, list):
        return sorted(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return getattr(value, "value", value)


def _diff(live: js_api.StreamConfig, want: js_api.StreamConfig) -> list[str]:
    return [f for f in _OWNED if _norm(getattr(live, f)) != _norm(getattr(want, f))]


async def _ensure_stream(js: JetStreamContext, want: js_api.StreamConfig) -> ProvisionAction:
    assert want.name is not None
    try:
        info = await js.stream_info(want.name)
    except js_errors.NotFoundError:
        await js.add_stream(config=want)
        return ProvisionAction(want.name, "created")
    changed = _diff(info.config, want)
    if not changed:
        return ProvisionAction(want.name, "unchanged")
    if "storage" in changed:
        raise ProvisioningError(
            f"stream {want.name} uses {_norm(info.config.storage)} storage but settings ask for "
            f"{_norm(want.storage)}; JetStream cannot change that in place: migrate the stream"
        )
    updated = js_api.StreamConfig.from_response(info.config.as_dict())
    for field in changed:
        setattr(updated, field, getattr(want, field))
    await js.update_stream(config=updated)
    return ProvisionAction(want.name, "updated", tuple(changed))


async def _match_bucket(
    js: JetStreamContext, bucket: str, live: js_api.StreamConfig, wanted: dict[str, Any]
) -> ProvisionAction:
    """Update the fields of a bucket's stream that differ from ``wanted`` (the stream's names)."""
    changed = [f for f, v in wanted.items() if _norm(getattr(live, f)) != _norm(v)]
    if not changed:
        return ProvisionAction(bucket, "unchanged")
    updated = js_api.StreamConfig.from_response(live.as_dict())
    for field in changed:
        setattr(updated, field, wanted[field])
    await js.update_stream(config=updated)
    return ProvisionAction(bucket, "updated", tuple(changed))


async def _ensure_bucket(js: JetStreamContext, want: js_api.KeyValueConfig) -> ProvisionAction:
    stream = f"KV_{want.bucket}"
    try:
        info = await js.stream_info(stream)
    except js_errors.NotFoundError:
        await js.create_key_value(config=want)
        return ProvisionAction(want.bucket, "created")
    live = info.config
    wanted = {
        "max_age": want.ttl,
        "max_msgs_per_subject": want.history,
        "num_replicas": want.replicas,
    }
    return await _match_bucket(js, want.bucket, live, wanted)


async def _ensure_object_store(
    js: JetStreamContext, want: js_api.ObjectStoreConfig
) -> ProvisionAction:
    assert want.bucket is not None
    stream = f"OBJ_{want.bucket}"
    try:
        info = await js.stream_info(stream)
    except js_errors.NotFoundError:
        await js.create_object_store(want.bucket, config=want)
        return ProvisionAction(want.bucket, "created")
    live = info.config
    if _norm(live.storage) != _norm(want.storage):
        raise ProvisioningError(
            f"bucket {want.bucket} uses {_norm(live.storage)} storage but settings ask for "
            f"{_norm(want.storage)}; JetStream cannot change that in place: migrate the bucket"
        )
    wanted = {
        "max_age": want.ttl,
        "max_bytes": want.max_bytes,
        "num_replicas": want.replicas,
        "description": want.description,
    }
    return await _match_bucket(js, want.bucket, live, wanted)


async def provision(js: JetStreamContext, settings: LogSettings) -> list[ProvisionAction]:
    """Make the live streams and buckets (the image bucket too) match ``settings``; returns
    what was done to each.

    Every step is idempotent, so a lost answer (nats-server restarting) provisions again
    (``answered``); a step whose answer was lost may then be reported ``unchanged``."""

    async def each() -> list[ProvisionAction]:
        actions = [await _ensure_stream(js, stream) for stream in desired_streams(settings)]
        actions += [await _ensure_bucket(js, b) for b in desired_buckets(settings)]
        return [*actions, await _ensure_object_store(js, image_bucket_config(settings))]

    async def once_its_store_is_free() -> list[ProvisionAction]:
        # nats-server removes a deleted (or purged) stream's messages in the background
        # (filestore: rename, then RemoveAll on a goroutine): a stream of that name made at once
        # can meet the removal, refused with 10049 'error creating store for stream'. Only that
        # refusal is asked again, for about 5 s (seen in CI, after tests deleted the streams).
        for attempt in range(_STORE_BUSY_TRIES):
            try:
                return await each()
            except js_errors.APIError as exc:
                if exc.err_code != _STORE_BUSY or attempt + 1 == _STORE_BUSY_TRIES:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    try:
        actions = await answered(once_its_store_is_free, "provisioning streams and buckets")
    except js_errors.APIError as exc:
        raise ProvisioningError(
            f"JetStream refused the stream/bucket configuration: {exc}"
        ) from exc
    except (TimeoutError, js_errors.Error, OSError) as exc:
        raise EventLogUnavailable(
            f"cannot provision streams: the log did not answer ({exc})"
        ) from exc
    done = [f"{a.name} {a.action}" for a in actions if a.action != "unchanged"]
    if done:
        log.info("provisioned: %s", ", ".join(done))
    return actions
