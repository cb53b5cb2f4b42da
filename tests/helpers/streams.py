"""Streams in tests: publishing events as the gateway would, reading TRAJ or DLQ back whole."""

from __future__ import annotations

from collections.abc import Sequence

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import errors as js_errors

from eventlog import JetStreamPublisher
from schemas.codec import Codec
from schemas.dead_letter import DeadLetter, decode_dead_letter
from schemas.events import Event, TrajectoryReady


async def stream_payloads(js: JetStreamContext, stream: str) -> list[tuple[int, str, bytes]]:
    """(seq, subject, data) of every message in ``stream``, in order."""
    info = await js.stream_info(stream)
    found: list[tuple[int, str, bytes]] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if not info.state.messages:
            break
        try:
            msg = await js.get_msg(stream, seq=seq, direct=True)
        except js_errors.NotFoundError:
            continue
        assert msg.seq is not None and msg.subject is not None
        found.append((msg.seq, msg.subject, msg.data or b""))
    return found


async def trajectories(js: JetStreamContext, stream: str = "TRAJ") -> list[TrajectoryReady]:
    codec = Codec()
    found = []
    for _, _, data in await stream_payloads(js, stream):
        event = codec.decode(data)
        assert isinstance(event, TrajectoryReady)
        found.append(event)
    return found


async def dead_letters(js: JetStreamContext, stream: str = "DLQ") -> list[DeadLetter]:
    return [decode_dead_letter(data) for _, _, data in await stream_payloads(js, stream)]


async def message_count(js: JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


async def publish_events(nc: NATS, events: Sequence[Event]) -> None:
    """Publish ``events`` (routed and Msg-Id'd as in production) and wait for their acks."""
    pub = await JetStreamPublisher(nc).start()
    await pub.publish_many(events)
    await pub.close()
