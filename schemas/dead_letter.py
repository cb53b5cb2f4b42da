"""A dead letter: a message the pipeline could not use, kept with why (DESIGN §8).

Published to ``ts.dlq.<source>.<reason>`` in the DLQ stream, msgpack-encoded, carrying the
original bytes, so a fixed build (a new upcaster, a fold fix) can re-publish or re-fold them.
Its Msg-Id is derived from the original's stream and sequence, so a worker that dead-letters
the same message twice (it crashed before its ack) stores it once.

>>> letter = DeadLetter(source="fold", reason="undecodable", error="not msgpack",
...                     stream="EVENTS", subject="ts.ev.r.s.turn", seq=7, payload=b"\\x00")
>>> decode_dead_letter(encode_dead_letter(letter)) == letter
True
>>> letter.msg_id, letter.subject_out
('dlq.fold.EVENTS.7', 'ts.dlq.fold.undecodable')
"""

from __future__ import annotations

import msgspec

from schemas.errors import SchemaError, UndecodableEvent
from schemas.ids import dlq_subject

__all__ = [
    "DeadLetter",
    "decode_dead_letter",
    "encode_dead_letter",
    "schema_reason",
]

_MAX_ERROR_CHARS = 4000


def schema_reason(error: BaseException) -> str | None:
    """The dead-letter reason of bad input (a SchemaError), else None."""
    return error.reason if isinstance(error, SchemaError) else None


class DeadLetter(msgspec.Struct, kw_only=True, frozen=True):
    source: str  # which component gave up: "fold", "reaper", "shard-writer"
    reason: str  # short code: undecodable, unsupported_version, fold_error, missing_turns, ...
    error: str  # the error message, naming run / session / turn where known
    stream: str  # where the original is
    subject: str
    seq: int
    deliveries: int = 1
    run: str | None = None
    session: str | None = None
    payload: bytes = b""  # the original message's bytes (truncated: see payload_truncated)
    payload_truncated: bool = False
    created_at: float = 0.0

    @property
    def msg_id(self) -> str:
        return f"dlq.{self.source}.{self.stream}.{self.seq}"

    @property
    def subject_out(self) -> str:
        return f"{dlq_subject(self.source)}.{self.reason}"

    def fitted(self, max_bytes: int) -> DeadLetter:
        """This letter, its payload cut so the whole record fits ``max_bytes``."""
        error = self.error[:_MAX_ERROR_CHARS]
        room = max_bytes - len(encode_dead_letter(msgspec.structs.replace(self, payload=b"")))
        room -= 64  # the flag and the longer length prefix of a big payload
        if len(self.payload) <= room and error == self.error:
            return self
        payload = self.payload if len(self.payload) <= room else self.payload[: max(room, 0)]
        return msgspec.structs.replace(
            self,
            error=error,
            payload=payload,
            payload_truncated=self.payload_truncated or payload is not self.payload,
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DeadLetter)


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _encoder.encode(letter)


def decode_dead_letter(data: bytes) -> DeadLetter:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise UndecodableEvent(f"not a dead letter: {exc}") from exc
