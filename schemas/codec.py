"""The one wire format of the log: msgpack maps, arrays as raw little-endian bytes.

Every event is a msgpack map with ``type`` (the event name) and ``v`` (schema version). Token
ids, logprobs and masks are msgpack *ext* values whose payload is the array's raw little-endian
bytes and whose ext code names the dtype:

    ext 1 = int32 LE    ext 2 = float32 LE    ext 3 = int8

A TrajectoryReady travels as its ``CompactTrajectory`` (token ids once, generated spans with
one weight version each, logprobs of generated tokens only; the fold hands that form over
as it is); ``decode`` expands it back (``schemas.spans``), and reads the per-token form of
older messages the same way.

Decoding maps each payload with ``numpy.frombuffer`` onto the message buffer: no copy, no
per-token object. Unknown fields are ignored; an event with an older ``v`` is passed through the
registered upcasters (v -> v+1, on the raw map) before it is typed; a newer ``v``, undecodable
bytes and oversized payloads each raise their own SchemaError.

    >>> codec = Codec()
    >>> ev = SessionClosed(run="r", session="s", status="timeout")
    >>> codec.decode(codec.encode(ev)) == ev
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np

from schemas.errors import PayloadTooLarge, UndecodableEvent, UnsupportedSchemaVersion
from schemas.events import (
    SCHEMA_VERSION,
    CompactTrajectory,
    Event,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)

__all__ = ["DEFAULT_MAX_PAYLOAD", "Codec", "Upcaster"]

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024  # matches the embedded nats-server's max_payload

_EXT_DTYPE: dict[int, np.dtype[Any]] = {1: np.dtype("<i4"), 2: np.dtype("<f4"), 3: np.dtype("i1")}
_DTYPE_EXT = {dtype: code for code, dtype in _EXT_DTYPE.items()}

_WireEvent = SessionOpened | TurnCompleted | RewardAssigned | SessionClosed | CompactTrajectory
"""What a message decodes to: a TrajectoryReady travels in its compact form."""

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""Turns the raw map of a version-v event into the raw map of version v+1."""


def _enc_hook(obj: object) -> msgspec.msgpack.Ext:
    if isinstance(obj, np.ndarray):
        code = _DTYPE_EXT.get(obj.dtype)
        if code is None:
            raise TypeError(f"arrays on the wire must be int32, float32 or int8, not {obj.dtype}")
        return msgspec.msgpack.Ext(code, np.ascontiguousarray(obj).data)
    raise TypeError(f"cannot encode {type(obj).__name__} in an event")


def _ext_hook(code: int, data: memoryview) -> np.ndarray:
    dtype = _EXT_DTYPE.get(code)
    if dtype is None:
        raise ValueError(f"unknown array ext code {code} (known: 1 int32, 2 float32, 3 int8)")
    if len(data) % dtype.itemsize:
        raise ValueError(f"array payload of {len(data)} bytes is not a whole number of {dtype}")
    return np.frombuffer(data, dtype)


def _dec_hook(tp: type, obj: object) -> object:
    if tp is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected an array (msgpack ext 1/2/3), got {type(obj).__name__}")


class Codec:
    """Encodes and decodes events, enforcing the payload limit both ways."""

    def __init__(
        self,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        upcasters: Mapping[int, Upcaster] | None = None,
    ) -> None:
        self.max_payload = max_payload
        self._upcasters = dict(upcasters or {})
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(_WireEvent, ext_hook=_ext_hook, dec_hook=_dec_hook)
        self._raw_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)

    def encode(self, event: Event) -> bytes:
        """The event's message; a TrajectoryReady in its compact form."""
        data = self._encoder.encode(
            event.compact() if isinstance(event, TrajectoryReady) else event
        )
        if len(data) > self.max_payload:
            raise PayloadTooLarge(
                f"{type(event).__name__} run={event.run} session={event.session}",
                len(data),
                self.max_payload,
            )
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> Event:
        """The event; a TrajectoryReady with its per-token arrays (expanded from the spans)."""
        event = self._decode_wire(data)
        return _expand(event) if isinstance(event, CompactTrajectory) else event

    def decode_trajectory(
        self, data: bytes | bytearray | memoryview, where: str
    ) -> TrajectoryReady:
        """``data`` (read from ``where``, e.g. a TRAJ subject) as a TrajectoryReady, or a
        SchemaError: TRAJ holds trajectories only."""
        return _expand(self.decode_compact_trajectory(data, where))

    def decode_compact_trajectory(
        self, data: bytes | bytearray | memoryview, where: str
    ) -> CompactTrajectory:
        """As ``decode_trajectory``, left in its wire form (spans, or the per-token arrays of
        an older message): for a consumer that builds its own columns (the shard writer)."""
        event = self._decode_wire(data)
        if not isinstance(event, CompactTrajectory):
            raise UndecodableEvent(
                f"{where} carries a {type(event).__name__}; TRAJ holds TrajectoryReady"
            )
        return event

    def _decode_wire(
        self, data: bytes | bytearray | memoryview
    ) -> SessionOpened | TurnCompleted | RewardAssigned | SessionClosed | CompactTrajectory:
        if len(data) > self.max_payload:
            raise PayloadTooLarge("event payload", len(data), self.max_payload)
        try:
            event: _WireEvent = self._decoder.decode(data)
        # ValidationError subclasses DecodeError; ext_hook's ValueError escapes msgspec as is.
        except (msgspec.DecodeError, ValueError) as exc:
            return self._decode_versioned(data, exc)
        if event.v != SCHEMA_VERSION:
            return self._decode_versioned(data, None)
        return event

    def _decode_versioned(
        self, data: bytes | bytearray | memoryview, typed_error: Exception | None
    ) -> SessionOpened | TurnCompleted | RewardAssigned | SessionClosed | CompactTrajectory:
        """Slow path: read the raw map, check ``v``, upcast an older event, then type it."""
        try:
            raw = self._raw_decoder.decode(data)
        except (msgspec.DecodeError, ValueError) as exc:
            raise UndecodableEvent(f"not a msgpack event: {exc}") from exc
        if not isinstance(raw, dict):
            raise UndecodableEvent(f"an event is a msgpack map, got {type(raw).__name__}")
        version = raw.get("v")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise UndecodableEvent(f"field `v` must be a schema version >= 1, got {version!r}")
        if version > SCHEMA_VERSION:
            raise UnsupportedSchemaVersion(version, SCHEMA_VERSION)
        if version == SCHEMA_VERSION:
            raise UndecodableEvent(
                f"invalid {raw.get('type', 'event')}: {typed_error}"
            ) from typed_error
        while version < SCHEMA_VERSION:
            upcast = self._upcasters.get(version)
            if upcast is None:
                raise UnsupportedSchemaVersion(version, SCHEMA_VERSION, missing_upcaster=True)
            raw = upcast(raw)
            version += 1
            raw["v"] = version
        try:
            upcasted: _WireEvent = msgspec.convert(raw, _WireEvent, dec_hook=_dec_hook)
        except msgspec.ValidationError as exc:
            raise UndecodableEvent(
                f"invalid {raw.get('type', 'event')} after upcast: {exc}"
            ) from exc
        return upcasted


def _expand(compact: CompactTrajectory) -> TrajectoryReady:
    try:
        return compact.expand()
    except ValueError as exc:  # checked on decode already; kept a SchemaError all the same
        raise UndecodableEvent(f"invalid TrajectoryReady: {exc}") from exc


# Make the doctest in the module docstring self-contained.
__test__ = {"SessionClosed": SessionClosed}
