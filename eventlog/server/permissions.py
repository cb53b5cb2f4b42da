"""Who may do what on the log: the subjects each role may publish to and subscribe on (pure).

JetStream has no permissions of its own: every API call, fetch, ack and key-value write is a
publish to a subject, so a role's rights are two lists of subjects. The roles follow the
pipeline's trust boundaries: only the gateway writes turns, only workers write trajectories,
the trainer reads trajectories and moves the policy.

    role      publishes                                 reads
    gateway   ts.ev.>, ts_images (put)                  EVENTS (direct get), ts_policy (watch),
                                                        ts_images
    worker    ts.traj.>, ts.dlq.>, ts.ev.*.*.close      EVENTS, TRAJ (durable consumers),
                                                        ts_sessions, ts_folded (read + write),
                                                        ts_images
    trainer   ts.dlq.>, ts_policy (write)               TRAJ (durable consumer), ts_images
    admin     everything                                everything

Every role may read the config of turnstream's streams and buckets (``$JS.API.STREAM.INFO``):
every service checks them at start (``provision``, which changes nothing when they already
match; only admin can create or change them). Replies come back on ``_INBOX.>``. Within a
stream it reads, a role may use any consumer: durable names are settings, not pinned here.

>>> "ts.ev.>" in role_permissions("gateway", StreamNames()).publish
True
>>> any(s.startswith("ts.ev") for s in role_permissions("trainer", StreamNames()).publish)
False
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from eventlog.config import StreamNames
from schemas.ids import DLQ_SUBJECT_PREFIX, EVENT_SUBJECT_PREFIX, TRAJ_SUBJECT_PREFIX

__all__ = [
    "ROLES",
    "ROLE_DUTIES",
    "Permissions",
    "Role",
    "authorization_block",
    "role_permissions",
]

Role = Literal["admin", "gateway", "worker", "trainer"]
ROLES: tuple[Role, ...] = ("admin", "gateway", "worker", "trainer")
ROLE_DUTIES: Mapping[Role, str] = {
    "admin": "provisioning, `turnstream status`, tools: everything",
    "gateway": "`turnstream gateway`: writes turns (ts.ev.>) and their images, follows the policy",
    "worker": "`turnstream worker`, `shard-writer`: reads EVENTS, writes TRAJ and dead letters",
    "trainer": "a trainer's live sink: reads TRAJ, writes the policy bucket",
}

_API = "$JS.API"
_INBOX = "_INBOX.>"  # nats-py's reply subjects: API answers, fetched messages, publish acks


@dataclass(frozen=True)
class Permissions:
    """Subjects a user may publish to and subscribe on (NATS wildcards)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _stream_info(names: StreamNames) -> list[str]:
    streams = [names.events, names.trajectories, names.dead_letters]
    buckets = [
        names.policy_bucket,
        names.sessions_bucket,
        names.folded_bucket,
        names.commits_bucket,
    ]
    return (
        [f"{_API}.INFO"]
        + [f"{_API}.STREAM.INFO.{s}" for s in streams]
        + [f"{_API}.STREAM.INFO.KV_{b}" for b in buckets]
        + [f"{_API}.STREAM.INFO.OBJ_{names.images_bucket}"]
    )


def _get(stream: str) -> list[str]:
    """Read messages by sequence or subject: direct get (batched or by last subject) and the
    stream's own get (what nats-py's ``get_last_msg`` sends)."""
    return [
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
        f"{_API}.STREAM.MSG.GET.{stream}",
    ]


def _consume(stream: str) -> list[str]:
    """Everything a consumer of ``stream`` sends: create (durable, named with a filter, or
    ephemeral), info, delete (ephemeral scans delete their consumer), pull, ack/nak/progress,
    and flow-control answers of ordered push consumers (key-value watches, range reads)."""
    return [
        f"{_API}.CONSUMER.CREATE.{stream}",
        f"{_API}.CONSUMER.CREATE.{stream}.>",
        f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{_API}.CONSUMER.INFO.{stream}.*",
        f"{_API}.CONSUMER.DELETE.{stream}.*",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
        *_get(stream),
    ]


def _bucket(bucket: str, *, write: bool) -> list[str]:
    """A key-value bucket is the stream ``KV_<bucket>``: reads are gets and watches on it;
    puts, creates, updates and deletes are publishes to ``$KV.<bucket>.<key>``."""
    return _consume(f"KV_{bucket}") + ([f"$KV.{bucket}.>"] if write else [])


def _images(bucket: str, *, write: bool) -> list[str]:
    """An object store bucket is the stream ``OBJ_<bucket>``. A read (nats-py's ``get``) looks
    the object up (``STREAM.MSG.GET``), finds the stream of its chunk subject
    (``STREAM.NAMES``) and follows the chunks with an ordered consumer; a put publishes chunks
    and the object's record to ``$O.<bucket>.>`` and purges the chunks it replaces (or its own,
    cut short)."""
    stream = f"OBJ_{bucket}"
    read = [f"{_API}.STREAM.NAMES", *_consume(stream)]
    return read + ([f"$O.{bucket}.>", f"{_API}.STREAM.PURGE.{stream}"] if write else [])


def role_permissions(role: Role, names: StreamNames) -> Permissions:
    """The subjects ``role`` may publish to and subscribe on."""
    if role == "admin":
        return Permissions(publish=(">",), subscribe=(">",))
    publish = _stream_info(names)
    if role == "gateway":
        publish += [
            f"{EVENT_SUBJECT_PREFIX}.>",
            *_get(names.events),  # a session's events read back after an eviction or restart
            *_bucket(names.policy_bucket, write=False),
            *_images(names.images_bucket, write=True),  # a turn's images, before its event
        ]
    elif role == "worker":
        publish += [
            f"{TRAJ_SUBJECT_PREFIX}.>",
            f"{DLQ_SUBJECT_PREFIX}.>",
            # The one event a worker writes: the reaper closes a session left idle (its
            # SessionClosed on ts.ev.<run>.<session>.close). Turns, opens and rewards stay the
            # gateway's alone, so a worker's credentials cannot forge what an agent was told.
            f"{EVENT_SUBJECT_PREFIX}.*.*.close",
            *_consume(names.events),
            *_consume(names.trajectories),  # the shard writer, and the fold's repeat check
            *_bucket(names.sessions_bucket, write=True),
            *_bucket(names.folded_bucket, write=True),
            *_images(names.images_bucket, write=False),
        ]
    elif role == "trainer":
        publish += [
            f"{DLQ_SUBJECT_PREFIX}.>",  # the live sink dead-letters what is no trajectory
            *_consume(names.trajectories),
            *_bucket(names.policy_bucket, write=True),
            *_bucket(names.commits_bucket, write=True),  # the live sink's commit records
            *_images(names.images_bucket, write=False),
        ]
    else:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return Permissions(publish=tuple(publish), subscribe=(_INBOX,))


def _list(subjects: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(s) for s in subjects) + "]"


def authorization_block(password_hashes: Mapping[Role, str], names: StreamNames) -> str:
    """The nats-server ``authorization`` block: one user per role (user name = role), with its
    bcrypt password hash and permissions. Quoted strings keep ``$`` literal in NATS config."""
    users = []
    for role, password_hash in password_hashes.items():
        p = role_permissions(role, names)
        users.append(
            f"    {{user: {json.dumps(role)}, password: {json.dumps(password_hash)}, "
            f"permissions: {{publish: {{allow: {_list(p.publish)}}}, "
            f"subscribe: {{allow: {_list(p.subscribe)}}}}}}}"
        )
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}"
