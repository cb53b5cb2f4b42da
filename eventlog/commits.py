"""The TRAJ sequences a live sink committed, kept where a crash of nats-server cannot lose them.

A trainer's commit acknowledges its batch's messages, and a committed batch must never be
delivered again (DESIGN §7, §8). But nats-server writes a consumer's ack state to disk
asynchronously: *measured* (the chaos soak, and a standalone test: 20 confirmed ``ack_sync``
calls, then SIGKILL), a nats-server killed within ~50 ms of confirmed acks forgets them all, with
or without ``sync_interval: always``, and redelivers the committed trajectories after the ack
wait. A stream's messages, by contrast, are written before the publish is acknowledged.

So a commit is recorded first, as one entry of the ``ts_commits`` bucket (key
``<durable>.<first seq>``, the batch's sequences as intervals), and acknowledged after. A
source opening the same durable reads its entries back; a delivery whose sequence is recorded is
acknowledged again and never handed to the trainer. Entries expire after
``log.commit_record_ttl_s`` (a day): the consumer's own state is on disk long before. One
process per durable: another process's commits are read only when a source opens.

>>> intervals = encode_seqs([7, 5, 6, 9])
>>> decode_seqs(intervals).intervals
[(5, 7), (9, 9)]
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext

from eventlog.buckets import Bucket
from eventlog.seqset import SeqSet
from schemas.errors import EventLogUnavailable

__all__ = ["CommitLedger", "decode_seqs", "encode_seqs"]


def encode_seqs(seqs: Sequence[int]) -> bytes:
    committed = SeqSet()
    committed.add_many(seqs)
    return msgspec.msgpack.encode(committed.intervals)


def decode_seqs(data: bytes) -> SeqSet:
    committed = SeqSet()
    for lo, hi in msgspec.msgpack.decode(data, type=list[tuple[int, int]]):
        committed.add_range(lo, hi)
    return committed


class CommitLedger:
    """One durable consumer's committed sequences: ``seq in ledger``; ``await record(seqs)``."""

    def __init__(self, bucket: Bucket, durable: str, committed: SeqSet) -> None:
        self._bucket = bucket
        self.durable = durable
        self._committed = committed

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, durable: str) -> CommitLedger:
        kv = await Bucket.open(js, bucket)
        committed = SeqSet()
        for entry in await kv.entries(f"{durable}.>"):
            try:
                part = decode_seqs(entry.value)
            except (msgspec.DecodeError, ValueError) as exc:
                raise EventLogUnavailable(
                    f"commit record {entry.key} in bucket {bucket} is not a list of sequence "
                    f"intervals ({exc}); delete it if it was not written by turnstream"
                ) from exc
            for lo, hi in part.intervals:
                committed.add_range(lo, hi)
        return cls(kv, durable, committed)

    def __contains__(self, seq: object) -> bool:
        return seq in self._committed

    def __len__(self) -> int:
        return len(self._committed)

    async def record(self, seqs: Sequence[int]) -> None:
        """Store the commit of ``seqs`` (returns once the log has it); raises
        EventLogUnavailable, and then nothing may be acknowledged."""
        if not seqs:
            return
        await self._bucket.put(f"{self.durable}.{min(seqs)}", encode_seqs(seqs))
        self._committed.add_many(seqs)
