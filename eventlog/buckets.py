"""JetStream key-value buckets as the consumers use them, nats errors translated here.

Two buckets hold consumer state: ``ts_folded`` (a marker per folded session, so a close
redelivered late is a no-op) and ``ts_sessions`` (the reaper's activity entry per session,
written with compare-and-set so any number of reapers can share it). The gateway follows
``ts_policy`` with ``watch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from nats.js import JetStreamContext
from nats.js import errors as js_errors
from nats.js.kv import KeyValue

from eventlog.connection import UNAVAILABLE, answered
from schemas.errors import EventLogUnavailable

__all__ = ["Bucket", "Entry"]

_WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code; nats-py raises it as BadRequestError here


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    revision: int
    created_at: float | None = None  # when the log stored it (epoch seconds; watch only)


class Bucket:
    """One KV bucket: every method raises EventLogUnavailable when the log does not answer."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, name: str) -> None:
        self._js = js
        self._kv = kv
        self.name = name

    @classmethod
    async def open(cls, js: JetStreamContext, name: str) -> Bucket:
        try:  # a service opens its buckets as it starts: a lost answer is asked again
            kv = await answered(lambda: js.key_value(name), f"opening bucket {name}")
            return cls(js, kv, name)
        except UNAVAILABLE as exc:
            # Unanswered is not missing: a frozen or restarting nats-server (issue 38's soak)
            # was reported as a log not provisioned.
            why = (
                "nats-server did not answer: is it up, and not frozen or overloaded?"
                if isinstance(exc, TimeoutError)
                else "is the log provisioned?"
            )
            raise EventLogUnavailable(f"cannot open bucket {name}: {exc}; {why}") from exc

    async def get(self, key: str) -> Entry | None:
        """The entry, or None (never written, deleted or expired)."""
        try:
            entry = await self._kv.get(key)
        except js_errors.KeyNotFoundError:  # KeyDeletedError (an expired entry) included
            return None
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"reading {key} in bucket {self.name}: {exc}") from exc
        if entry.value is None or entry.revision is None:
            return None
        return Entry(key, entry.value, entry.revision)

    async def put(self, key: str, value: bytes) -> int:
        try:
            return int(await self._kv.put(key, value))
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"writing {key} in bucket {self.name}: {exc}") from exc

    async def swap(self, key: str, value: bytes, revision: int) -> int | None:
        """Write ``value`` if the entry is still at ``revision`` (0: if there is none yet);
        the new revision, or None when another writer got there first."""
        try:
            if revision:
                return int(await self._kv.update(key, value, last=revision))
            return int(await self._kv.create(key, value))
        except js_errors.KeyWrongLastSequenceError:
            return None
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"writing {key} in bucket {self.name}: {exc}") from exc

    async def delete(self, key: str, revision: int) -> bool:
        """Delete the entry if it is still at ``revision``; False if it changed or went."""
        try:
            await self._kv.delete(key, last=revision)
        except js_errors.NotFoundError:
            return False
        except js_errors.BadRequestError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                return False
            raise EventLogUnavailable(f"deleting {key} in bucket {self.name}: {exc}") from exc
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"deleting {key} in bucket {self.name}: {exc}") from exc
        return True

    async def watch(self, key: str) -> AsyncIterator[Entry]:
        """``key``'s current entry (if any), then every entry written to it, until the caller
        stops iterating; deletions are skipped. Raises EventLogUnavailable when the watch cannot
        be set up; it ends when the log stopped the watch under us (watch again)."""
        try:
            watcher = await self._kv.watch(key)
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"watching {key} in bucket {self.name}: {exc!r}") from exc
        try:
            async for entry in watcher:
                # None marks "initial values delivered"; a deletion carries no value
                if entry is None or entry.operation is not None or not entry.value:
                    continue
                if entry.revision is not None:
                    created = entry.created
                    stamp = created.timestamp() if isinstance(created, datetime) else None
                    yield Entry(entry.key, entry.value, entry.revision, stamp)
        finally:
            with contextlib.suppress(*UNAVAILABLE):  # the connection may already be gone
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def entries(self, keys: str = ">", timeout_s: float = 5.0) -> list[Entry]:
        """Every live entry whose key matches ``keys`` (NATS wildcards), as of the call.

        A watcher delivers the snapshot, but nats-py decides "nothing to deliver" from consumer
        info, which races with the deliveries themselves: seen right after a nats-server
        restart, a snapshot ended early and a sink's commit records read back without the latest
        one (the sink then handed committed trajectories out again). So the keys the bucket
        holds are listed first (stream info, one request), and a key the watcher did not deliver
        (neither as an entry nor as a deletion) is read on its own: none, unless it raced."""
        try:
            held = await self._keys(keys)
            found, seen = await self._watch(keys, timeout_s)
        except UNAVAILABLE as exc:
            raise EventLogUnavailable(f"reading bucket {self.name}: {exc}") from exc
        for key in sorted(held - seen):
            entry = await self.get(key)  # None: deleted, or expired since the listing
            if entry is not None:
                found.append(entry)
        return found

    async def _keys(self, keys: str) -> set[str]:
        """The keys matching ``keys`` that the bucket's stream holds a message for (deleted ones
        included: their delete marker is a message)."""
        prefix = f"$KV.{self.name}."
        info = await self._js.stream_info(f"KV_{self.name}", subjects_filter=prefix + keys)
        return {subject[len(prefix) :] for subject in info.state.subjects or {}}

    async def _watch(self, keys: str, timeout_s: float) -> tuple[list[Entry], set[str]]:
        """The live entries, and every key delivered (deleted ones included: their markers are
        what the listing counts too)."""
        found: list[Entry] = []
        seen: set[str] = set()
        watcher = await self._kv.watch(keys)
        try:
            while True:
                entry = await watcher.updates(timeout=timeout_s)  # type: ignore[no-untyped-call]
                if entry is None:
                    return found, seen
                seen.add(entry.key)
                if entry.operation is None and entry.value and entry.revision is not None:
                    found.append(Entry(entry.key, entry.value, entry.revision))
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
